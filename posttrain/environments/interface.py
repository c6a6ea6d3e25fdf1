"""The environment interface: what the rollout loop calls to score (and continue) conversations.

An environment receives a batch of message logs (one conversation per sample, see
`posttrain.data.message_log`) with per-sample metadata (e.g. `{"ground_truth": "42"}`) and
returns one `EnvironmentReturn` for the whole batch. It mirrors NeMo-RL's
`EnvironmentInterface.step` (nemo_rl/environments/interfaces.py).

Rules every environment follows:
- `step` is batched: every field of the return has one entry per input conversation, in order.
- `step` never raises because of what the model wrote: a malformed, missing or pathological
  answer scores 0. It may raise for caller errors (e.g. metadata without a required key).
- Every episode ends in exactly one of two calls: a `step` that returns it terminated, or
  `finish` when the rollout stops it first (token limit, `grpo.max_rollout_turns`): an
  environment with a verifier scores the unfinished episode there (and releases its state).
- Environments usually run as Ray actors (`posttrain.environments.registry.create_env`), so
  everything they return must be picklable.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Optional

import torch

Message = dict[str, Any]
MessageLog = list[Message]


class EnvironmentReturn(NamedTuple):
    """Batched result of `Environment.step` (B = number of conversations).

    Attributes:
        observations: B messages `{"role": "environment", "content": str}` to append to each
            conversation (the rollout loop tokenises them; they are never trained on).
        metadata: B per-sample metadata dicts for the next turn (usually the input, unchanged).
        next_stop_strings: B stop-string lists for the next generation turn, or None for the
            generation config's default.
        rewards: FloatTensor[B], the reward of this turn.
        terminateds: BoolTensor[B], True where the episode is over.
        answers: B extracted answers (str) or None where nothing could be extracted; used for
            logging and for majority voting (cons@k) in evaluation.
        metrics: optional counts of this call (e.g. `{"tool_errors": 2}`), summed over the calls
            of a rollout and logged as `train/env/<task>/<key>` (default None). Keys starting
            with `reward/` (`reward/<component>`) are per-episode values summed over the call's
            episodes instead; they are logged as their mean per episode of the task.
        reward_components: optional B dicts `{name: value}`, the named parts of each sample's reward
            (e.g. one per reward function, raw: before the environment's weights; NaN or absent
            where a part does not apply). Summed over turns per sample; GDPO
            (`grpo.adv_estimator.name=gdpo`) normalises each within its group (default None).
        reward_component_weights: optional `{name: weight}`, the weight of each component in
            `rewards`; GDPO weighs the normalised components by it unless
            `grpo.adv_estimator.reward_component_weights` sets one (default None: 1.0 each).
    """

    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[Optional[list[str]]]
    rewards: torch.Tensor
    terminateds: torch.Tensor
    answers: list[Optional[str]]
    metrics: Optional[dict[str, float]] = None
    reward_components: Optional[list[dict[str, float]]] = None
    reward_component_weights: Optional[dict[str, float]] = None


class Environment(abc.ABC):
    """Base class of all environments. Subclasses implement `step` and may override `shutdown`.

    Plug-in contract (config section `env.<name>`, see `posttrain.environments.registry.resolve_env`):
    - `config_class`: an optional pydantic model; the section's fields (all but `class_path`) are
      validated into it before any worker starts and the instance is passed to `__init__`.
      Without it, `__init__` receives the section's fields as a dict (or None).
    - `metadata_problem(metadata)`: an optional check of one data row's metadata (what `step`
      receives for it), run on every row before any worker starts.
    - `make_rows(cfg, count, seed)`: optional; the rows of `data.dataset=env` (games).
    - `prompt_tools(cfg)`: optional; tool schemas rendered into every prompt of the environment.
    - Observations may carry `"chat_template": True` to be rendered as the next chat turn
      (`{"role": "tool" | "user", ...}`), see `posttrain.data.chat.observation_ids`.
    - `live_episode_state`: True when an episode's state between turns lives in the environment
      (a game object, an HTTP session) rather than in the sample's metadata; GRPO's partial
      rollouts, which checkpoint episodes mid-way, refuse such environments in multi-turn runs.
    """

    config_class: Optional[type] = None
    live_episode_state: bool = False

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        """Why this environment cannot score a row with this metadata, or None (the default)."""
        return None

    @classmethod
    def make_rows(cls, cfg: Any, count: int, seed: int) -> list[dict]:
        """`count` data rows (`{"prompt", ...fields step reads}`) made by the environment itself, for
        `data.dataset=env` (games: one board per row). Row i must depend only on `(seed, i)`."""
        raise NotImplementedError

    @classmethod
    def prompt_tools(cls, cfg: Any) -> Optional[list[dict]]:
        """OpenAI-style function schemas the prompt should describe (default None: no tools)."""
        return None

    @abc.abstractmethod
    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        """Score one turn of `len(message_logs)` conversations. Never raises on bad model output."""

    def finish(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        """End episodes the rollout stopped before `step` terminated them (token limit, max turns):
        their final reward (added to what `step` gave) and answers, one per conversation; the
        returned observations and stop strings are ignored. Default: reward 0, nothing released.
        Environments with a verifier or per-episode state override it."""
        return ended(len(message_logs), metadata)

    def shutdown(self) -> None:
        """Release processes or other resources the environment holds. Safe to call twice."""


def ended(n: int, metadata: list[Any], rewards: Optional[list[float]] = None,
          answers: Optional[list[Optional[str]]] = None, metrics: Optional[dict[str, float]] = None,
          reward_components: Optional[list[dict[str, float]]] = None) -> EnvironmentReturn:
    """The `EnvironmentReturn` of `n` episodes that are over: empty observations, `rewards`
    (default 0), `answers` (default None) and `reward_components` (default None)."""
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": ""} for _ in range(n)], metadata=list(metadata),
        next_stop_strings=[None] * n,
        rewards=torch.tensor(rewards if rewards is not None else [0.0] * n, dtype=torch.float32),
        terminateds=torch.ones(n, dtype=torch.bool), answers=list(answers) if answers is not None else [None] * n,
        metrics=metrics, reward_components=reward_components,
    )


def last_assistant_text(message_log: MessageLog) -> str:
    """Content of the last `assistant` message of a conversation, or "" when there is none."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            content = message.get("content", "")
            return content if isinstance(content, str) else str(content)
    return ""
