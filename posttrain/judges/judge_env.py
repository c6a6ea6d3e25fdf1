"""The `judge` environment: an LLM judge scores responses (LLM-as-judge and pairwise GenRM).

The judge is any local Hugging Face causal LM (`judge_model`: a directory, a hub id already in
the cache, or a built-in preset such as `tiny`), loaded in the environment's own Ray actor and
generating with posttrain's engine (`NativeGenerationEngine`, greedy by default). Its prompt is
rendered through its chat template when it has one.

Modes (`mode`):
- `pointwise`: `prompt_template` (fields `{prompt}`, `{response}`) asks for a score; the last
  match of `score_regex` in the judgement is the score, mapped from `[score_min, score_max]` to
  `[0, 1]` (clipped). A judgement without a score gives reward 0 (`unparsed` count).
- `pairwise` (GenRM, as NeMo-Gym's `genrm_compare`): the responses of one prompt (the samples
  of a GRPO group, recognised by an identical prompt; the rollout always steps a group whole) are
  compared in pairs: `circular` compares (i, i+1 mod N), N comparisons; `all_pairs` N(N-1)/2.
  `pairwise_template` (fields `{prompt}`, `{response_1}`, `{response_2}`) asks for `score_1`,
  `score_2` (1-5) and a `ranking` (1-6, 1 = response 1 much better), answered as JSON
  (`{"score_1": 4, "score_2": 2, "ranking": 2}`, NeMo-Gym's GenRM format; the last such object,
  also nested under "overall") or as `score_1: 4, score_2: 2, ranking: 2`. On equal scores
  `3.5 - ranking` is added to score_1 and subtracted from score_2, each kept within [0, 5]. A
  response's reward is the mean of its scores over its comparisons, divided by 5. A comparison
  whose answer cannot be parsed gives both responses the neutral `default_score` (3, as NeMo-Gym;
  counted as `unparsed`), and so does a response without any comparison (alone in its group;
  counted as `uncompared`). With `length_bonus_alpha` > 0, each response with at least one parsed
  comparison also gets `alpha * (mean_length - length) / max_length` over those of its group
  (ours: shorter than average gains, longer loses, zero-sum; after the Nemotron recipe's
  length-normalised bonus, whose exact form is not given here). Rewards are clipped to [0, 1].
"""

from __future__ import annotations

import json
import re
from itertools import combinations
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env

POINTWISE_TEMPLATE = (
    "Rate how well the response answers the question, from 1 (bad) to 10 (excellent).\n"
    "Question: {prompt}\nResponse: {response}\nAnswer with 'Score: <number>'."
)
PAIRWISE_TEMPLATE = (
    "Compare two responses to the question.\nQuestion: {prompt}\nResponse 1: {response_1}\n"
    "Response 2: {response_2}\nRate each from 1 to 5 and rank them from 1 (response 1 much better) to 6 "
    "(response 2 much better). Answer as 'score_1: <n>, score_2: <n>, ranking: <n>'."
)


class JudgeEnvConfig(BaseModel):
    """`env.judge.*`."""

    model_config = ConfigDict(extra="forbid")

    judge_model: str = Field(..., description="The judge: a local HF causal LM directory, a cached hub id, or a preset (tiny).")
    mode: Literal["pointwise", "pairwise"] = Field("pointwise", description="One score per response, or GenRM pairwise.")
    prompt_template: str = Field(POINTWISE_TEMPLATE, description="Pointwise judge prompt ({prompt}, {response}).")
    score_regex: str = Field(r"[Ss]core:?\s*(-?\d+(?:\.\d+)?)", description="Pointwise: group 1 of its last match is the score.")
    score_min: float = Field(1.0, description="Pointwise: the score mapped to reward 0. Default 1.")
    score_max: float = Field(10.0, description="Pointwise: the score mapped to reward 1. Default 10.")
    pairwise_template: str = Field(PAIRWISE_TEMPLATE, description="Pairwise judge prompt ({prompt}, {response_1}, {response_2}).")
    comparison_strategy: Literal["circular", "all_pairs"] = Field("circular", description="Pairs compared per group.")
    length_bonus_alpha: float = Field(0.0, ge=0, description="Pairwise length bonus weight (0: off; Nemotron used 0.5).")
    default_score: float = Field(3.0, ge=1, le=5, description="Pairwise: both scores of an unparsable comparison, and "
                                 "the score of a response compared with none. Default 3 (neutral, as NeMo-Gym).")
    max_new_tokens: int = Field(64, ge=1, description="Judgement length. Default 64.")
    greedy: bool = Field(True, description="Greedy judgements (deterministic). Default True.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature when not greedy.")
    batch_size: int = Field(16, ge=1, description="Judge prompts per generation call. Default 16.")
    max_response_chars: int = Field(4000, ge=1, description="Longest response shown to the judge (its end kept).")

    @field_validator("score_regex")
    @classmethod
    def _regex(cls, pattern: str) -> str:
        if re.compile(pattern).groups < 1:
            raise ValueError(f"{pattern!r} needs a group holding the score")
        return pattern


_FIELDS = ("score_1", "score_2", "ranking")
_PAIR_FIELDS = {name: re.compile(rf"{name}\s*[:=]\s*(\d+(?:\.\d+)?)", re.IGNORECASE) for name in _FIELDS}
MAX_SCORE = 5.0  # a pairwise score's top; reward = mean score / MAX_SCORE


def _json_fields(judgement: str) -> Optional[tuple[float, float, float]]:
    """`(score_1, score_2, ranking)` of the last JSON object in the text that has all three
    (NeMo-Gym's GenRM answer; also nested under "overall"), or None."""
    decoder, found = json.JSONDecoder(), None
    start = judgement.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(judgement, start)
        except ValueError:
            start = judgement.find("{", start + 1)
            continue
        if isinstance(value, dict) and isinstance(value.get("overall"), dict):
            value = value["overall"]
        if isinstance(value, dict) and all(name in value for name in _FIELDS):
            try:
                found = tuple(float(value[name]) for name in _FIELDS)
            except (TypeError, ValueError):
                pass
        start = judgement.find("{", end)
    return found


def _text_fields(judgement: str) -> Optional[tuple[float, float, float]]:
    """`(score_1, score_2, ranking)` from `score_1: 4, score_2: 2, ranking: 2` (last of each), or None."""
    values = []
    for pattern in _PAIR_FIELDS.values():
        found = pattern.findall(judgement)
        if not found:
            return None
        values.append(float(found[-1]))
    return values[0], values[1], values[2]


def parse_pairwise(judgement: str) -> Optional[tuple[float, float]]:
    """`(score_1, score_2)` after the tie-break, each within [0, 5], or None when the answer has
    no JSON or text form with all three fields in range."""
    values = _json_fields(judgement) or _text_fields(judgement)
    if values is None:
        return None
    s1, s2, rank = values
    if not (1 <= s1 <= MAX_SCORE and 1 <= s2 <= MAX_SCORE and 1 <= rank <= 6):
        return None
    if s1 == s2:
        adjust = 3.5 - rank
        s1, s2 = s1 + adjust, s2 - adjust
    return min(max(s1, 0.0), MAX_SCORE), min(max(s2, 0.0), MAX_SCORE)


def comparison_pairs(n: int, strategy: str) -> list[tuple[int, int]]:
    if n < 2:
        return []
    if strategy == "circular":
        return [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)]
    return list(combinations(range(n), 2))


def prompt_of(message_log: MessageLog) -> str:
    """The user's question: the content of the first user message (the templated prompt text)."""
    return next((str(m.get("content", "")) for m in message_log if m.get("role") == "user"), "")


@register_env("judge")
class JudgeEnvironment(Environment):
    """LLM-as-judge and GenRM pairwise rewards. Config: `JudgeEnvConfig`."""

    config_class = JudgeEnvConfig

    def __init__(self, cfg: JudgeEnvConfig | dict):
        from posttrain.models.generation.engine import NativeGenerationEngine
        from posttrain.models.hf import load_causal_lm, load_tokenizer

        self.cfg = cfg if isinstance(cfg, JudgeEnvConfig) else JudgeEnvConfig.model_validate(cfg)
        # cuda: a GPU-only path (docs/scaling.md, "GPU-only paths")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = load_tokenizer(self.cfg.judge_model)
        self.model = load_causal_lm(self.cfg.judge_model, device=device)
        self.engine = NativeGenerationEngine(self.model, self.tokenizer, pad_token_id=self.tokenizer.pad_token_id,
                                             eos_token_id=self.tokenizer.eos_token_id)
        self.score_pattern = re.compile(self.cfg.score_regex)

    def judge(self, prompts: list[str]) -> list[str]:
        """The judge's answer to each prompt."""
        texts = []
        for text in prompts:
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
            texts.append(text)
        out = []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), self.cfg.batch_size):
            chunk = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[start: start + self.cfg.batch_size]]
            width = max(len(c) for c in chunk)
            ids = torch.full((len(chunk), width), self.tokenizer.pad_token_id, dtype=torch.long)
            for b, c in enumerate(chunk):
                ids[b, : len(c)] = torch.tensor(c)
            lengths = torch.tensor([len(c) for c in chunk])
            result = self.engine.generate(ids.to(device), lengths.to(device), max_new_tokens=self.cfg.max_new_tokens,
                                          greedy=self.cfg.greedy, temperature=self.cfg.temperature,
                                          seeds=torch.arange(start, start + len(chunk), device=device))
            for b in range(len(chunk)):
                n, g = int(lengths[b]), int(result["generation_lengths"][b])
                out.append(self.tokenizer.decode(result["output_ids"][b, n: n + g].tolist(), skip_special_tokens=True))
        return out

    def _response(self, log_: MessageLog) -> str:
        return last_assistant_text(log_)[-self.cfg.max_response_chars:]

    def pointwise(self, message_logs: list[MessageLog]) -> tuple[list[float], list[Optional[str]], int]:
        judgements = self.judge([self.cfg.prompt_template.format(prompt=prompt_of(log_), response=self._response(log_))
                                 for log_ in message_logs])
        rewards, answers, unparsed = [], [], 0
        span = self.cfg.score_max - self.cfg.score_min
        for judgement in judgements:
            found = self.score_pattern.findall(judgement)
            if not found:
                rewards.append(0.0)
                answers.append(None)
                unparsed += 1
                continue
            score = float(found[-1] if isinstance(found[-1], str) else found[-1][0])
            rewards.append(min(max((score - self.cfg.score_min) / span, 0.0), 1.0) if span else 0.0)
            answers.append(str(score))
        return rewards, answers, unparsed

    def pairwise(self, message_logs: list[MessageLog]) -> tuple[list[float], dict[str, float]]:
        """Rewards of the responses, and the counts `judgements`, `unparsed`, `uncompared`."""
        groups: dict[str, list[int]] = {}
        for i, log_ in enumerate(message_logs):
            groups.setdefault(prompt_of(log_), []).append(i)
        jobs = []  # (i, j, judge prompt)
        for prompt, members in groups.items():
            for a, b in comparison_pairs(len(members), self.cfg.comparison_strategy):
                i, j = members[a], members[b]
                jobs.append((i, j, self.cfg.pairwise_template.format(
                    prompt=prompt, response_1=self._response(message_logs[i]), response_2=self._response(message_logs[j]))))
        judgements = self.judge([job[2] for job in jobs]) if jobs else []
        totals = [0.0] * len(message_logs)
        counts = [0] * len(message_logs)
        parsed = [0] * len(message_logs)
        unparsed = 0
        for (i, j, _), judgement in zip(jobs, judgements):
            scores = parse_pairwise(judgement)
            if scores is None:
                unparsed += 1
                scores = (self.cfg.default_score, self.cfg.default_score)
            else:
                parsed[i] += 1
                parsed[j] += 1
            totals[i] += scores[0]
            totals[j] += scores[1]
            counts[i] += 1
            counts[j] += 1
        rewards = [(totals[i] / counts[i] if counts[i] else self.cfg.default_score) / MAX_SCORE
                   for i in range(len(message_logs))]
        if self.cfg.length_bonus_alpha:
            for members in groups.values():
                members = [i for i in members if parsed[i]]  # no bonus without a judgement
                if not members:
                    continue
                lengths = [len(self._response(message_logs[i])) for i in members]
                longest = max(lengths) or 1
                mean = sum(lengths) / len(lengths)
                for i, length in zip(members, lengths):
                    rewards[i] += self.cfg.length_bonus_alpha * (mean - length) / longest
        rewards = [min(max(r, 0.0), 1.0) for r in rewards]
        return rewards, {"judgements": float(len(jobs)), "unparsed": float(unparsed),
                         "uncompared": float(counts.count(0))}

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        n = len(message_logs)
        if self.cfg.mode == "pointwise":
            rewards, answers, unparsed = self.pointwise(message_logs)
            metrics = {"judgements": float(n), "unparsed": float(unparsed)}
        else:
            rewards, metrics = self.pairwise(message_logs)
            answers = [None] * n
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Judge reward: {r:.3f}"} for r in rewards],
            metadata=list(metadata), next_stop_strings=[None] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=answers, metrics=metrics,
        )
