"""Multiple-choice QA: find the letter the response chose and compare it with the correct one.

Data fields: `options` (`[{"A": "text"}, {"B": "text"}]` as in NeMo-Gym, `{"A": "text", ...}`, or
a list of texts lettered A, B, ...) and the correct letter in `answer` (-> `ground_truth`) or
`expected_answer`; it may also be the correct option's text. Optional per-row
`template_metadata.output_regex` (NeMo-Gym) overrides `answer_regex`.

Modes (`grading_mode`):
- `strict` (default): the letter must be stated as the answer: the last `\\boxed{B}`, `<answer>B</answer>`,
  or "Answer: B" / "answer is (B)"; the extracted text must be one option letter, optionally in
  parentheses or followed by `)`, `.` or `:` and the option's text.
- `lenient`: if strict finds nothing, also the last standalone "(B)" / "B)" in the response, a
  response that is just a letter, or a final line equal to one option's text.
Several different letters in one answer ("A or B") score 0.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.math_env import extract_boxed
from posttrain.environments.registry import register_env


class MCQAEnvConfig(BaseModel):
    """`env.mcqa.*`."""

    model_config = ConfigDict(extra="forbid")

    grading_mode: Literal["strict", "lenient"] = Field("strict", description="Which answer forms count (module docstring).")
    answer_regex: Optional[str] = Field(None, description="A regex whose first group is the letter; replaces the built-in forms.")


_ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:)?\s*[:\-]?\s*\(?\s*([A-Za-z])\s*\)?(?![A-Za-z])", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_PAREN_LETTER = re.compile(r"(?<![A-Za-z])\(([A-Z])\)|(?<![A-Za-z(])([A-Z])\)")


def option_map(options) -> dict[str, str]:
    """Letter -> option text, from any of the accepted `options` shapes."""
    if isinstance(options, dict):
        return {str(k).strip().upper(): str(v) for k, v in options.items()}
    letters: dict[str, str] = {}
    for i, item in enumerate(options or []):
        if isinstance(item, dict):
            letters.update({str(k).strip().upper(): str(v) for k, v in item.items()})
        else:
            letters[chr(ord("A") + i)] = str(item)
    return letters


def _letter_of(text: str, letters: dict[str, str]) -> Optional[str]:
    """The one option letter `text` states ("B", "(B)", "B.", "B) text"), else None."""
    text = text.strip().strip("*").strip()
    match = re.fullmatch(r"\(?\s*([A-Za-z])\s*(?:[).:]\s*(.*))?", text, re.DOTALL)
    if match:
        letter = match.group(1).upper()
        rest = (match.group(2) or "").strip()
        if letter in letters and (not rest or rest.rstrip(".").lower() == letters[letter].strip().rstrip(".").lower()):
            return letter
        return None
    for letter, option in letters.items():  # the option's own text
        if text.rstrip(".").lower() == option.strip().rstrip(".").lower():
            return letter
    return None


def extract_choice(response: str, letters: dict[str, str], mode: str = "strict", regex: Optional[str] = None) -> Optional[str]:
    """The option letter a response chose, or None (see the module docstring)."""
    if regex is not None:
        matches = re.findall(regex, response, re.DOTALL)
        if not matches:
            return None
        last = matches[-1] if isinstance(matches[-1], str) else matches[-1][0]
        return _letter_of(last, letters)
    for candidate in (extract_boxed(response), (_ANSWER_TAG.findall(response) or [None])[-1]):
        if candidate is not None:
            return _letter_of(candidate, letters)
    phrases = _ANSWER_PHRASE.findall(response)
    if phrases:
        letter = phrases[-1].upper()
        return letter if letter in letters else None
    if mode != "lenient":
        return None
    whole = _letter_of(response, letters)
    if whole is not None:
        return whole
    marked = [a or b for a, b in _PAREN_LETTER.findall(response)]
    marked = [m for m in marked if m in letters]
    if marked and len(set(marked)) == 1:
        return marked[-1]
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return _letter_of(lines[-1], letters) if lines else None


def correct_letter(meta: dict, letters: dict[str, str]) -> Optional[str]:
    truth = meta.get("ground_truth")
    truth = meta.get("expected_answer") if truth is None else truth
    return None if truth is None else _letter_of(str(truth), letters)


@register_env("mcqa")
class MCQAEnvironment(Environment):
    """Single-turn multiple-choice grading. Config: `MCQAEnvConfig`."""

    config_class = MCQAEnvConfig

    def __init__(self, cfg: MCQAEnvConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, MCQAEnvConfig) else MCQAEnvConfig.model_validate(cfg or {})

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        letters = option_map(metadata.get("options"))
        if not letters:
            return "mcqa rows need 'options' ([{'A': text}, ...], {'A': text, ...} or a list of texts)"
        if correct_letter(metadata, letters) is None:
            truth = metadata.get("ground_truth", metadata.get("expected_answer"))
            return f"the correct answer {truth!r} is neither an option letter ({', '.join(letters)}) nor an option's text"
        return None

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        rewards, answers = [], []
        for log_, meta in zip(message_logs, metadata, strict=True):
            problem = self.metadata_problem(meta)
            if problem:
                raise ValueError(f"mcqa environment: {problem}")
            letters = option_map(meta["options"])
            regex = (meta.get("template_metadata") or {}).get("output_regex") or self.cfg.answer_regex
            choice = extract_choice(last_assistant_text(log_), letters, self.cfg.grading_mode, regex)
            rewards.append(float(choice is not None and choice == correct_letter(meta, letters)))
            answers.append(choice)
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "Environment: correct" if r else "Environment: incorrect"}
                          for r in rewards],
            metadata=list(metadata), next_stop_strings=[None] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=answers,
        )
