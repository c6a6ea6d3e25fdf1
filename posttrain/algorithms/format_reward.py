"""R1-Zero's format reward (`reward_shaping.format_reward`): a small reward for a completion in its
task's answer format, added to the environment's reward before the advantages.

DeepSeek-R1-Zero (DeepSeek-AI 2025, arXiv:2501.12948, section 2.2.2) trained a base model with two
rule-based rewards: accuracy, and format (the reasoning and answer in their tags). A base model
that does not answer in the form a verifier reads scores 0 on every sample of most groups, and a
group whose rewards all agree has no advantage to learn from; the format reward gives such groups
a difference (the completions in format against the others) until answers are scored.

A completion is in format when its last assistant message matches the task's pattern
(`pattern`, or `task_patterns[task]`; `re.search`), or, with no pattern, when its environment
extracted an answer from it (`Sample.answer`). The reward is a shaping term: `train/reward` and
validation accuracy stay the environment's reward; the share of completions in format is logged
as `train/format_rate` (and `train/format_rate/<task>` with several tasks).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional, Sequence

import torch

from posttrain.utils.metrics import per_task_means

FORMAT_RATE_METRIC = "train/format_rate"


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def in_format(text: str, answer: Optional[str], pattern: Optional[str]) -> bool:
    """Whether a completion (`text`, its last assistant message) is in format: it matches `pattern`
    (`re.search`), or, when `pattern` is None, its environment extracted an `answer` from it."""
    if pattern is None:
        return answer is not None
    return _compiled(pattern).search(text) is not None


def _last_assistant_text(message_log: list[dict]) -> str:
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            content = message.get("content", "")
            return content if isinstance(content, str) else str(content)
    return ""


def format_flags(cfg: Any, samples: Sequence[Any]) -> torch.Tensor:
    """[B] 1.0 where a sample's completion is in its task's format, else 0.0 (`cfg`: a
    `FormatRewardConfig`)."""
    return torch.tensor([
        float(in_format(_last_assistant_text(s.message_log), getattr(s, "answer", None),
                        cfg.task_patterns.get(s.task_name, cfg.pattern)))
        for s in samples], dtype=torch.float32)


def format_metrics(flags: torch.Tensor, task_names: Sequence[str], tasks: Sequence[str]) -> dict[str, float]:
    """`train/format_rate` (the share of `flags` set) and, with several `tasks`, one per task."""
    if flags.numel() == 0:
        return {}
    per_task = per_task_means(flags, list(task_names), FORMAT_RATE_METRIC, list(tasks))
    return {FORMAT_RATE_METRIC: flags.mean().item(),
            **{key: value for key, value in per_task.items() if "_count/" not in key}}  # train/reward_count has them
