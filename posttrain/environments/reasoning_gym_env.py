"""reasoning-gym environment: extract the answer and score it with the task's own scorer.

Rows come from `data.dataset=reasoning_gym` (metadata `reasoning_gym: {task, config, seed, size,
index}`: the entry is regenerated here, exactly) or in NeMo-Gym's shape (`question`, `answer` /
`expected_answer`, `metadata.source_dataset`: scored with `reasoning_gym.get_score_answer_fn`).

The answer is the last `<answer>...</answer>`, else the last `\\boxed{...}`, else the whole
response (`answer_format`). Scorers that raise on odd input score 0 (counted). `strict` (the
default) gives reward 1 only for a fully correct answer (score >= 1): several scorers give
exploitable partial credit (gold "1", answer "11" -> 0.5).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.math_env import extract_boxed, extract_last_number
from posttrain.environments.registry import register_env

log = logging.getLogger(__name__)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


class ReasoningGymEnvConfig(BaseModel):
    """`env.reasoning_gym.*`."""

    model_config = ConfigDict(extra="forbid")

    strict: bool = Field(True, description="Reward 1 only for a score >= 1 (else 0); false: the scorer's partial credit.")
    answer_format: Literal["auto", "answer_tag", "boxed", "raw", "last_number"] = Field(
        "auto",
        description=(
            "auto: <answer>, else \\boxed{}, else the whole response; or only one of them; last_number: the "
            "last number of the response (for tasks whose answer is a number, asked of a model that answers in "
            "a sentence: 'The letter r appears 3 times.')"
        ),
    )


def extract_rg_answer(text: str, answer_format: str = "auto") -> Optional[str]:
    """The answer in a response (see the module docstring); None when there is none."""
    if answer_format == "last_number":
        return extract_last_number(text)
    if answer_format in ("auto", "answer_tag"):
        tags = _ANSWER_TAG.findall(text)
        if tags and tags[-1].strip():
            return tags[-1].strip()
        if answer_format == "answer_tag":
            return None
    if answer_format in ("auto", "boxed"):
        boxed = extract_boxed(text)
        if boxed is not None or answer_format == "boxed":
            return boxed
    stripped = text.strip()
    return stripped or None


@register_env("reasoning_gym")
class ReasoningGymEnvironment(Environment):
    """Single-turn scoring with reasoning-gym's scorers. Config: `ReasoningGymEnvConfig`."""

    config_class = ReasoningGymEnvConfig

    def __init__(self, cfg: ReasoningGymEnvConfig | dict | None = None):
        from posttrain.data.reasoning_gym import import_reasoning_gym

        self.cfg = cfg if isinstance(cfg, ReasoningGymEnvConfig) else ReasoningGymEnvConfig.model_validate(cfg or {})
        self.rg = import_reasoning_gym()
        self._datasets: dict[str, Any] = {}
        self.scorer_errors = 0

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        if isinstance(metadata.get("reasoning_gym"), dict):
            return None
        if isinstance(metadata.get("metadata"), dict) and "source_dataset" in metadata["metadata"] and "question" in metadata:
            return None
        return "reasoning_gym rows need a 'reasoning_gym' field (data.dataset=reasoning_gym) or NeMo-Gym's question + metadata.source_dataset"

    def _entry_and_scorer(self, meta: dict):
        spec = meta.get("reasoning_gym")
        if isinstance(spec, dict):
            key = json.dumps([spec["task"], spec.get("config", {}), spec["seed"], spec["size"]], sort_keys=True)
            if key not in self._datasets:
                from posttrain.data.reasoning_gym import make_dataset

                self._datasets[key] = make_dataset(spec["task"], spec.get("config", {}), spec["seed"], spec["size"])
            dataset = self._datasets[key]
            return dataset[spec["index"]], dataset.score_answer
        problem = self.metadata_problem(meta)
        if problem:
            raise ValueError(f"reasoning_gym environment: {problem} (got keys {sorted(meta)})")
        answer = meta.get("ground_truth")
        entry = {"question": meta["question"], "answer": meta.get("expected_answer") if answer is None else answer,
                 "metadata": meta["metadata"]}
        return entry, self.rg.get_score_answer_fn(meta["metadata"]["source_dataset"])

    def score(self, response: str, meta: dict) -> tuple[float, Optional[str]]:
        """(reward, extracted answer) of one response."""
        entry, scorer = self._entry_and_scorer(meta)
        answer = extract_rg_answer(response, self.cfg.answer_format)
        if answer is None:
            return 0.0, None
        try:
            score = float(scorer(answer, entry))
        except Exception as e:  # scorers raise on junk; junk scores 0
            self.scorer_errors += 1
            log.debug("reasoning-gym scorer raised %s on %.200r", type(e).__name__, answer)
            score = 0.0
        if score != score:  # NaN
            score = 0.0
        return (1.0 if score >= 1.0 - 1e-9 else 0.0) if self.cfg.strict else min(max(score, 0.0), 1.0), answer

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"got {len(message_logs)} message logs but {len(metadata)} metadata entries")
        scored = [self.score(last_assistant_text(m), meta) for m, meta in zip(message_logs, metadata)]
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Environment: score {r:g}"} for r, _ in scored],
            metadata=list(metadata), next_stop_strings=[None] * n,
            rewards=torch.tensor([r for r, _ in scored], dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[a for _, a in scored],
        )
