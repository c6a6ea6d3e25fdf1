"""Instruction following: IFEval-style checkable constraints (Zhou et al. 2023, arXiv:2311.07911).

Each row lists instruction ids and their arguments, as in IFEval and NeMo-Gym:
`instruction_id_list: ["length_constraints:number_words", ...]` and `kwargs: [{"num_words": 50,
"relation": "at least"}, ...]` at the top level or inside `verifier_metadata`. The reward is 1 when
every instruction is followed (`reward: all`, the default) or the fraction followed.

The checkers follow the IFEval definitions (google-research/instruction_following_eval), written
here because the maintained packages need NLTK data downloads (punkt) and langdetect at run time;
the differences: sentences are split with a regex (at `.`, `!`, `?` followed by space) rather than
NLTK's punkt, words are `\\w+` runs (as IFEval's word counter), capital words are `\\w+` runs in
upper case, and `language:response_language` (needs language detection) is not supported: rows
using it are refused before training starts. `loose: true` also accepts a response that passes
after removing its first line, its last line, or markdown asterisks (IFEval's loose accuracy).
"""

from __future__ import annotations

import json
import re
from typing import Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env


class InstructionsEnvConfig(BaseModel):
    """`env.instructions.*`."""

    model_config = ConfigDict(extra="forbid")

    reward: Literal["all", "fraction"] = Field("all", description="1 only when every instruction is followed, or the fraction followed.")
    loose: bool = Field(False, description="IFEval's loose variant: also try without the first/last line and asterisks.")


def _compare(count: int, relation: str, n: int) -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise ValueError(f"relation must be 'less than' or 'at least', got {relation!r}")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]


def _keywords_existence(text, keywords):
    return all(re.search(re.escape(k), text, re.IGNORECASE) for k in keywords)


def _keyword_frequency(text, keyword, frequency, relation):
    return _compare(len(re.findall(re.escape(keyword), text, re.IGNORECASE)), relation, frequency)


def _forbidden_words(text, forbidden_words):
    return not any(re.search(r"\b" + re.escape(w) + r"\b", text, re.IGNORECASE) for w in forbidden_words)


def _letter_frequency(text, letter, let_frequency, let_relation):
    return _compare(text.lower().count(letter.lower()), let_relation, let_frequency)


def _number_sentences(text, num_sentences, relation):
    return _compare(len(_sentences(text)), relation, num_sentences)


def _number_paragraphs(text, num_paragraphs):
    paragraphs = re.split(r"\s?\*\*\*\s?", text)
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False
    return count == num_paragraphs


def _number_words(text, num_words, relation):
    return _compare(len(_words(text)), relation, num_words)


def _nth_paragraph_first_word(text, num_paragraphs, nth_paragraph, first_word):
    paragraphs = re.split(r"\n\n", text)
    count = sum(1 for p in paragraphs if p.strip())
    if nth_paragraph > count:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'\"")
    got = ""
    for char in word:
        if char in {".", ",", "?", "!", "'", '"'}:
            break
        got += char.lower()
    return count == num_paragraphs and got == first_word.lower()


def _number_placeholders(text, num_placeholders):
    return len(re.findall(r"\[.*?\]", text)) >= num_placeholders


def _postscript(text, postscript_marker):
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def _number_bullet_lists(text, num_bullets):
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def _constrained_response(text):
    return any(option in text.strip() for option in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def _number_highlighted_sections(text, num_highlights):
    count = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    count += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.removeprefix("**").removesuffix("**").strip())
    return count >= num_highlights


def _multiple_sections(text, section_spliter, num_sections):
    sections = re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", text)
    return len(sections) - 1 >= num_sections


def _json_format(text):
    value = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        value = value.removeprefix(prefix)
    value = value.removesuffix("```").strip()
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def _title(text):
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


def _two_responses(text):
    parts = text.split("******")
    valid = []
    for i, part in enumerate(parts):
        if not part.strip():
            if i not in (0, len(parts) - 1):
                return False
        else:
            valid.append(part)
    return len(valid) == 2 and valid[0].strip() != valid[1].strip()


def _repeat_prompt(text, prompt_to_repeat):
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _end_checker(text, end_phrase):
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _quotation(text):
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _capital_word_frequency(text, capital_frequency, capital_relation):
    return _compare(sum(1 for w in _words(text) if w.isupper()), capital_relation, capital_frequency)


def _english_capital(text):
    return text.isupper()


def _english_lowercase(text):
    return text.islower()


def _no_comma(text):
    return "," not in text


CHECKERS: dict[str, Callable[..., bool]] = {
    "keywords:existence": _keywords_existence,
    "keywords:frequency": _keyword_frequency,
    "keywords:forbidden_words": _forbidden_words,
    "keywords:letter_frequency": _letter_frequency,
    "length_constraints:number_sentences": _number_sentences,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:number_words": _number_words,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_content:number_placeholders": _number_placeholders,
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _number_bullet_lists,
    "detectable_format:constrained_response": _constrained_response,
    "detectable_format:number_highlighted_sections": _number_highlighted_sections,
    "detectable_format:multiple_sections": _multiple_sections,
    "detectable_format:json_format": _json_format,
    "detectable_format:title": _title,
    "combination:two_responses": _two_responses,
    "combination:repeat_prompt": _repeat_prompt,
    "startend:end_checker": _end_checker,
    "startend:quotation": _quotation,
    "change_case:capital_word_frequency": _capital_word_frequency,
    "change_case:english_capital": _english_capital,
    "change_case:english_lowercase": _english_lowercase,
    "punctuation:no_comma": _no_comma,
}


def instructions_of(meta: dict) -> tuple[list[str], list[dict]]:
    """(instruction ids, their kwargs) of a row (top level or `verifier_metadata`)."""
    source = meta.get("verifier_metadata") if isinstance(meta.get("verifier_metadata"), dict) and \
        "instruction_id_list" in meta["verifier_metadata"] else meta
    ids = list(source.get("instruction_id_list") or [])
    kwargs = list(source.get("kwargs") or [{} for _ in ids])
    return ids, [{k: v for k, v in (kw or {}).items() if v is not None} for kw in kwargs]


def check_instruction(instruction_id: str, text: str, kwargs: dict) -> bool:
    """Whether `text` follows one instruction (unknown ids and bad arguments raise ValueError)."""
    if instruction_id not in CHECKERS:
        raise ValueError(f"unsupported instruction {instruction_id!r} (supported: {sorted(CHECKERS)})")
    try:
        return bool(CHECKERS[instruction_id](text, **kwargs))
    except TypeError as e:
        raise ValueError(f"instruction {instruction_id!r}: bad arguments {kwargs}: {e}") from None


def _loose_variants(text: str) -> list[str]:
    lines = text.split("\n")
    first_removed = "\n".join(lines[1:]).strip()
    last_removed = "\n".join(lines[:-1]).strip()
    both_removed = "\n".join(lines[1:-1]).strip()
    variants = [text, text.replace("*", ""), first_removed, first_removed.replace("*", ""), last_removed,
                last_removed.replace("*", ""), both_removed, both_removed.replace("*", "")]
    return [v for v in variants if v.strip()]


def followed(text: str, meta: dict, loose: bool = False) -> list[bool]:
    """Per instruction of the row: followed or not."""
    ids, kwargs = instructions_of(meta)
    variants = _loose_variants(text) if loose else [text]
    return [any(check_instruction(i, v, kw) for v in variants) for i, kw in zip(ids, kwargs)]


@register_env("instructions")
class InstructionFollowingEnvironment(Environment):
    """Single-turn IFEval-style grading. Config: `InstructionsEnvConfig`."""

    config_class = InstructionsEnvConfig

    def __init__(self, cfg: InstructionsEnvConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, InstructionsEnvConfig) else InstructionsEnvConfig.model_validate(cfg or {})

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        ids, kwargs = instructions_of(metadata)
        if not ids:
            return "instruction rows need 'instruction_id_list' and 'kwargs' (top level or in verifier_metadata)"
        if len(kwargs) != len(ids):
            return f"{len(ids)} instruction ids but {len(kwargs)} kwargs entries"
        try:
            for i, kw in zip(ids, kwargs):
                check_instruction(i, "probe", kw)
        except ValueError as e:
            return str(e)
        return None

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        rewards, observations = [], []
        for log_, meta in zip(message_logs, metadata, strict=True):
            results = followed(last_assistant_text(log_), meta, self.cfg.loose)
            done = sum(results)
            rewards.append(done / len(results) if self.cfg.reward == "fraction" else float(done == len(results)))
            observations.append(f"Environment: {done}/{len(results)} instructions followed")
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": o} for o in observations], metadata=list(metadata),
            next_stop_strings=[None] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
        )
