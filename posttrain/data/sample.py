"""`Sample`: one RL sample, from the data set to the training batch (NeMo-RL's `DatumSpec`,
slime's `Sample`).

A processor (`posttrain.data.processors`) makes it from a data row: the prompt as the first
message of `message_log`, where it goes (`task_name`, `env_name`) and what its environment needs
(`extra_env_info`). The rollout extends `message_log` turn by turn (each generated message keeps
its token ids and generation logprobs) and records `reward`; GRPO adds `advantage` and
`sample_mask`, and the training batch is flattened from the message logs with those two.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

# The task (and environment) of a row that names none: `data.env_name` sets it per data set.
DEFAULT_TASK_NAME = "math"


@dataclass
class Sample:
    """One prompt and, after a rollout, its conversation, reward and training weights.

    Attributes:
        message_log: the conversation: the prompt message first, then generated turns (with
            `token_ids` and `generation_logprobs`) and environment observations.
        prompt_length: tokens of the prompt message.
        extra_env_info: what the environment reads (`ground_truth` and the row's own fields);
            the environment may replace it after each turn.
        task_name: the task, for per-task metrics and routing (default "math").
        env_name: the `env.<name>` section that serves the task (default: `task_name`).
        idx: the row's position in its split.
        loss_multiplier: 0.0 keeps the sample out of the loss (an over-long prompt), else 1.0.
        stop_strings: per-sample stop strings of the first turn (None: the generation config's).
        source, source_weight: the blend component the row came from, and its weight.
        reward: the rollout's reward, summed over turns (before any shaping).
        advantage: GRPO's advantage of the sample (same for all of its tokens).
        sample_mask: the weight of the sample in the loss: `loss_multiplier` times the filters
            (DAPO overlong filtering; 0 for padding rows).
    """

    message_log: list[dict]
    prompt_length: int
    extra_env_info: dict[str, Any] = field(default_factory=dict)
    task_name: str = DEFAULT_TASK_NAME
    env_name: str = ""
    idx: int = 0
    loss_multiplier: float = 1.0
    stop_strings: Optional[list[str]] = None
    source: Optional[str] = None
    source_weight: float = 1.0
    reward: float = 0.0
    advantage: float = 0.0
    sample_mask: float = 1.0

    def __post_init__(self) -> None:
        self.env_name = self.env_name or self.task_name

    @property
    def prompt(self) -> str:
        return self.message_log[0]["content"]

    def fresh_copy(self) -> "Sample":
        """An independent copy to roll out (its conversation grows in place)."""
        return copy.deepcopy(self)
