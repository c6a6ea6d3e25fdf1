"""`Sample`: one RL sample, from the data set to the training batch (NeMo-RL's `DatumSpec`,
slime's `Sample`).

A processor (`posttrain.data.processors`) makes it from a data row: the prompt as the first
message of `message_log`, where it goes (`task_name`, `env_name`) and what its environment needs
(`extra_env_info`). The rollout extends `message_log` turn by turn (each generated message keeps
its token ids and generation logprobs) and records its progress there (`status`, turns, tokens,
`reward`, the extracted `answer`; `posttrain.rollouts`); GRPO adds `advantage` and `sample_mask`,
and the training batch is flattened from the message logs with those two.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Optional

# The task (and environment) of a row that names none: `data.env_name` sets it per data set.
DEFAULT_TASK_NAME = "math"


class SampleStatus(enum.Enum):
    """Where a sample is in its rollout (slime's `Sample.Status`): not started, running, or how
    its episode ended. A COMPLETED episode was scored by its environment's last `step`; TRUNCATED
    and TURN_LIMIT ones are then scored by its `finish` (`Environment.finish`); TIMED_OUT ones
    are dropped. PAUSED ones were stopped mid-generation by a partial rollout and continue in the
    next step (`posttrain.algorithms.partial_rollouts`)."""

    PENDING = "pending"  # not rolled out yet (a prompt)
    RUNNING = "running"  # in a rollout, generating its next turn
    COMPLETED = "completed"  # its environment ended the episode (a `step` returned it terminated)
    TRUNCATED = "truncated"  # the token limit: the last observation did not fit with room to answer
    TURN_LIMIT = "turn_limit"  # still going after `max_rollout_turns` turns
    TIMED_OUT = "timed_out"  # its environment missed the rollout's deadline in a `step`: dropped
    PAUSED = "paused"  # stopped mid-generation by a partial rollout: its tokens carry over to the next step


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
        stop_strings: stop strings of its next turn (None: the generation config's): the row's for
            the first, then those its environment gives (`EnvironmentReturn.next_stop_strings`).
        source, source_weight: the blend component the row came from, and its weight.
        reward: the rollout's reward, summed over turns (before any shaping).
        shaped_reward: the reward the advantages are computed from, set when its group is scored
            (`algorithms.experience.score_groups`): `reward` after reward shaping (DAPO's overlong
            penalty, Kimi's length reward); None before. A critic's estimator (PPO's GAE) reads it too.
        reward_components: the named parts of the reward its environment reported
            (`EnvironmentReturn.reward_components`), each summed over turns; a part that never
            applied is absent. GDPO's input.
        reward_component_weights: the environment's weight of each component in `reward`.
        advantage: GRPO's advantage of the sample (same for all of its tokens).
        sample_mask: the weight of the sample in the loss: `loss_multiplier` times the filters
            (DAPO overlong filtering; 0 for padding rows).
        status: where its rollout is, or how its episode ended (`SampleStatus`).
        turns: assistant turns generated in the rollout.
        generated_tokens, observation_tokens: tokens the rollout generated, and tokens of the
            environment observations it appended (the last observation of an episode is never
            appended).
        answer: the answer its environment extracted: the last `step`'s (None too), replaced by
            `finish`'s when that gives one.
        hit_max_new_tokens: the last turn stopped at `max_new_tokens` (with TRUNCATED, what
            `overlong` flags for DAPO's overlong filter).
        timed_out: its environment missed the rollout's deadline, in a `step` (status TIMED_OUT)
            or in the `finish` of an episode the rollout stopped (status stays TRUNCATED or
            TURN_LIMIT); such a sample is dropped, its reward incomplete.
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
    shaped_reward: Optional[float] = None
    reward_components: dict[str, float] = field(default_factory=dict)
    reward_component_weights: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    sample_mask: float = 1.0
    status: SampleStatus = SampleStatus.PENDING
    turns: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    answer: Optional[str] = None
    hit_max_new_tokens: bool = False
    timed_out: bool = False

    def __post_init__(self) -> None:
        self.env_name = self.env_name or self.task_name

    def start_rollout(self) -> None:
        """Set the rollout's state to that of a rollout starting: RUNNING, no reward, counts zero."""
        self.status = SampleStatus.RUNNING
        self.reward, self.turns, self.generated_tokens, self.observation_tokens = 0.0, 0, 0, 0
        self.shaped_reward = None
        self.reward_components, self.reward_component_weights = {}, {}
        self.answer, self.hit_max_new_tokens, self.timed_out = None, False, False

    @property
    def overlong(self) -> bool:
        """Stopped by the token limit, or its last turn hit `max_new_tokens` (DAPO's overlong filter)."""
        return self.status is SampleStatus.TRUNCATED or self.hit_max_new_tokens

    @property
    def prompt(self) -> str:
        return self.message_log[0]["content"]

    def fresh_copy(self) -> "Sample":
        """An independent copy to roll out (its conversation grows in place)."""
        return copy.deepcopy(self)
