"""The multi-turn rollout loop over message logs.

Each sample is a `Sample` (`posttrain.data.sample`): its message log, task and environment info.
A turn generates one assistant message for every still-active sample, asks its environment for a
reward and an observation, and appends the observation as a new message. Generated messages keep
their token ids and the generation logprobs (never re-tokenised); environment messages get loss
mask 0 later because they carry no `generation_logprobs`. An observation flagged
`"chat_template": True` (tool results, game boards) is rendered as the next chat turn of the
tokenizer's template (`posttrain.data.chat.observation_ids`); others are tokenised as they are.

A sample ends when its environment says it terminated, when its conversation reaches the token
limit (truncated), or after `max_rollout_turns` turns; the last two end in the environment's
`finish` (`Environment.finish`: a verifier scores the unfinished episode), so every episode is scored.
Each sample keeps its progress: `Sample.status` (`SampleStatus`: running, then which of these
endings, or timed out when its environment missed the rollout's deadline) and its counts.

Samples come in prompt groups (`group_size` consecutive samples, GRPO's generations of one prompt):
each turn a group's active samples go to their environment together, once the last of them is
generated, so an environment that scores a group as a whole (the pairwise judge) sees all of it
however the generation workers split the batch.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from posttrain.data.chat import observation_ids
from posttrain.data.message_log import append_message, flatten_message_logs, message_log_source_images
from posttrain.data.sample import Sample, SampleStatus
from posttrain.distributed.batch import Batch
from posttrain.environments.interface import EnvironmentReturn
from posttrain.environments.registry import PendingStep, launch_step
from posttrain.models.generation.speculative import SPECULATIVE_COUNTS


@dataclass
class RolloutResult:
    """A rollout's samples and what is read from their state at its end (`Sample.status`, `reward`,
    `answer` and the rollout's counts): per-sample tensors and metrics."""

    samples: list[Sample]  # the input samples: message logs extended, `reward` and the state set, in place
    rewards: torch.Tensor  # [B] summed over turns: each sample's `reward`
    truncated: torch.Tensor  # [B] bool: stopped by the token limit, not by the environment (status TRUNCATED)
    overlong: torch.Tensor  # [B] bool: truncated, or the last turn hit max_new_tokens (`Sample.overlong`)
    answers: list[Optional[str]]  # the answer each environment extracted at the sample's last turn (`answer`)
    metrics: dict[str, float] = field(default_factory=dict)
    env_seconds: float = 0.0  # wall time spent waiting for environments (the "reward" timing)
    # Per-sample progress, in seconds: `env_step_wait` (mean time from a sample's generation coming
    # back to its environment step starting) and `generation_shard_spread` (first to last engine
    # shard back, summed over turns: what early samples would wait without per-shard stepping).
    timings: dict[str, float] = field(default_factory=dict)
    # [B] bool: samples whose environment did not answer before the rollout's deadline (dropped;
    # `Sample.timed_out`).
    timed_out: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    def add_timings(self, timer, seconds: float) -> None:
        """Split the rollout's `seconds` between `generation` and `reward` (environment time not
        hidden behind generation) on `timer`, so a step's time breakdown adds up, and add the
        per-sample progress timings."""
        timer.add("generation", seconds - self.env_seconds)
        timer.add("reward", self.env_seconds)
        for name, value in self.timings.items():
            timer.add(name, value)


# A sample's turn t samples with seed `seed + t * TURN_SEED_STRIDE` (`_turn_batch`; partial rollouts
# continue turns with the same seeds).
TURN_SEED_STRIDE = 1_000_003


def sample_seeds(base_seed: int, step: int, n: int) -> torch.Tensor:
    """Per-sample sampling seeds that depend only on (seed, step, index).

    Generation is then reproducible across resume, batching and the number of workers.
    """
    return torch.arange(n, dtype=torch.long) + (base_seed * 1_000_003 + step * 65_537) % (2**40)


def text_only(message_log: list[dict]) -> list[dict]:
    """The conversation as environments see it: roles and contents, without the token tensors,
    which environments do not need and which dominate the cost of sending a batch to an actor."""
    return [{"role": m["role"], "content": m["content"]} for m in message_log]


def run_multi_turn_rollout(generation, *args, **kwargs) -> RolloutResult:
    """Roll out `samples` (already repeated per generation) until every sample is done; arguments
    as `_rollout_turns`. The generation engine is told when its phase begins and ends
    (`prepare_for_generation` / `finish_generation`): colocated with training on a GPU it wakes
    its weights for the rollout and frees that memory for the policy afterwards."""
    generation.prepare_for_generation()
    try:
        return _rollout_turns(generation, *args, **kwargs)
    finally:
        generation.finish_generation()


def _rollout_turns(
    generation,
    samples: list[Sample],
    tokenizer,
    envs: dict[str, Any],
    *,
    max_seq_len: int,
    max_rollout_turns: int = 1,
    greedy: bool = False,
    seeds: Optional[torch.Tensor] = None,
    weight_version: int = 0,
    params: Optional[dict[str, Any]] = None,
    deadline: Optional[float] = None,
    group_size: int = 1,
) -> RolloutResult:
    """The turns of `run_multi_turn_rollout`. Each sample's progress is kept on it (`status`,
    counts, `reward`, `answer`; `Sample`), and the result is read from the samples at the end.

    Args:
        generation: a `GenerationInterface` (`generate(batch, greedy) -> Batch`).
        envs: task name -> environment (actor handle or local instance).
        max_seq_len: total token limit of a conversation (prompt + all turns).
        seeds: optional per-sample sampling seeds `[B]`; turn t uses `seeds + t * 1_000_003`, so
            a fixed seed reproduces the whole rollout regardless of batching.
        params: per-call sampling overrides passed to `generate` (e.g. `{"temperature": 0.6}` for
            validation at `policy.generation.val_temperature`).
        deadline: `time.monotonic()` after which environment steps are not waited for: samples
            whose environment has not answered end there, flagged in `timed_out` (default None:
            wait for every environment).
        group_size: consecutive samples that form one prompt group, stepped together (module
            docstring; default 1: every sample on its own).
    """
    for sample in samples:
        sample.start_rollout()
    totals = RolloutTotals()
    for turn in range(max_rollout_turns):
        running = [i for i, s in enumerate(samples) if s.status is SampleStatus.RUNNING]
        if not running:
            break
        batch = _turn_batch(samples, running, tokenizer, seeds, turn)
        pending = _generate_and_launch(generation, batch, samples, running, tokenizer, envs, totals, greedy=greedy,
                                       params=params, weight_version=weight_version, group_size=group_size)
        stepped = _wait(pending, samples, deadline, totals)
        for i in running:
            take_env_step(samples[i], *stepped[i], tokenizer, max_seq_len)
    for sample in samples:
        if sample.status is SampleStatus.RUNNING:
            sample.status = SampleStatus.TURN_LIMIT
    finish_episodes(envs, samples, deadline, totals)
    return rollout_result(samples, totals)


@dataclass
class RolloutTotals:
    """What the rollout adds up over its turns, beside the samples' own state."""

    env_seconds: float = 0.0  # environment time the rollout waited for (beyond what overlapped generation)
    env_counts: dict[str, float] = field(default_factory=dict)  # environments' own counts (EnvironmentReturn.metrics)
    waits: list[float] = field(default_factory=list)  # per sample and turn: from its generation's return to its step
    shard_spread: float = 0.0  # per turn, first to last engine shard back: what early shards no longer wait for
    speculative: dict[str, float] = field(default_factory=dict)  # summed SPECULATIVE_COUNTS and generated tokens


def _turn_batch(samples: list[Sample], running: list[int], tokenizer, seeds: Optional[torch.Tensor],
                turn: int) -> Batch:
    """The `running` samples' conversations as one padded batch, with their stop strings and this
    turn's seeds."""
    flat = flatten_message_logs([samples[i].message_log for i in running], pad_token_id=tokenizer.pad_token_id)
    batch = Batch(input_ids=flat["input_ids"], input_lengths=flat["input_lengths"])
    if "pixel_values" in flat:  # a vision-language model's images (models/vision_inputs.py)
        batch["pixel_values"] = flat["pixel_values"]
        batch["images"] = message_log_source_images([samples[i].message_log for i in running])
    batch["stop_strings"] = [samples[i].stop_strings for i in running]
    if seeds is not None:
        batch["seeds"] = seeds[running] + turn * TURN_SEED_STRIDE
    return batch


def _generate_and_launch(generation, batch: Batch, samples: list[Sample], running: list[int], tokenizer,
                         envs: dict[str, Any], totals: RolloutTotals, *, greedy: bool, params: Optional[dict[str, Any]],
                         weight_version: int, group_size: int) -> list[tuple[list[int], PendingStep]]:
    """Generate the turn of the `running` samples (the rows of `batch`) and launch their
    environment steps: the launched steps, each with its samples.

    Engines return their shards as they finish: each shard's samples are appended and their
    environments start stepping at once (with the rest of their group once it is generated),
    while the other shards still generate.
    """
    pending, ready_at = [], []
    group_left = Counter(i // group_size for i in running)  # each group's samples not generated yet
    waiting: dict[int, list[int]] = {}  # group -> its samples generated, waiting for the rest
    generated_at: dict[int, float] = {}  # when each sample's generation came back
    for rows, out in generation.generate_shards(batch, greedy=greedy, params=params):
        ready_at.append(time.perf_counter())
        add_speculative_counts(totals.speculative, out)
        members = [running[row] for row in rows]
        for k, (row, i) in enumerate(zip(rows, members)):
            _append_generation(samples[i], out, k, int(batch["input_lengths"][row]), tokenizer, weight_version)
            generated_at[i] = ready_at[-1]
        members = _whole_groups(members, group_size, group_left, waiting)
        if members:
            t0 = time.perf_counter()
            totals.waits.extend(t0 - generated_at[i] for i in members)
            pending.append((members, launch_env(envs, samples, members)))
            totals.env_seconds += time.perf_counter() - t0  # local environments step right here
    totals.shard_spread += ready_at[-1] - ready_at[0] if ready_at else 0.0
    return pending


def _append_generation(sample: Sample, out: Batch, k: int, start: int, tokenizer, weight_version: int) -> None:
    """Append row `k` of a generation shard (its tokens from `start`) as the sample's next turn."""
    length = int(out["generation_lengths"][k])
    routed = out.get("routed_experts")  # router replay (models/router_replay.py)
    append_turn(sample, out["output_ids"][k, start : start + length].clone(),
                out["logprobs"][k, start : start + length].clone(), tokenizer, weight_version,
                hit_max_new_tokens=bool(out["truncated"][k]),
                routed_experts=None if routed is None else routed[k, start : start + length].clone())


def append_turn(sample: Sample, token_ids: torch.Tensor, logprobs: torch.Tensor, tokenizer, weight_version: int, *,
                hit_max_new_tokens: bool, routed_experts: Optional[torch.Tensor] = None) -> dict:
    """Append a generated turn (its tokens and their generation logprobs) to the sample's
    conversation and count it; the new message."""
    append_message(
        sample.message_log,
        "assistant",
        tokenizer.decode(token_ids.tolist(), skip_special_tokens=True),
        token_ids,
        generation_logprobs=logprobs,
        weight_version=weight_version,
        routed_experts=routed_experts,
    )
    sample.generated_tokens += len(token_ids)
    sample.turns += 1
    sample.hit_max_new_tokens = hit_max_new_tokens
    return sample.message_log[-1]


def launch_env(envs: dict[str, Any], samples: list[Sample], members: list[int], method: str = "step") -> PendingStep:
    """Start the environment call `method` ("step" or "finish") on the samples `members`."""
    return launch_step(envs, [text_only(samples[i].message_log) for i in members],
                       [samples[i].extra_env_info or {} for i in members],
                       [samples[i].task_name for i in members], method=method)


def collect_env(step: PendingStep, deadline: Optional[float], samples: list[Sample], members: list[int],
             totals: RolloutTotals) -> EnvironmentReturn:
    """The launched call's result, waited for until the deadline: samples whose environment missed
    it are marked timed out (and end TIMED_OUT if still running)."""
    env_out = step.result(None if deadline is None else deadline - time.monotonic())
    for row in step.timed_out:
        sample = samples[members[row]]
        sample.timed_out = True
        if sample.status is SampleStatus.RUNNING:
            sample.status = SampleStatus.TIMED_OUT
    add_counts(totals.env_counts, env_out.metrics)
    return env_out


def _wait(pending: list[tuple[list[int], PendingStep]], samples: list[Sample], deadline: Optional[float],
          totals: RolloutTotals) -> dict[int, tuple[EnvironmentReturn, int]]:
    """Wait for the turn's environment steps: sample -> (its launch's results, its row there)."""
    t0 = time.perf_counter()
    stepped = {}
    for members, step in pending:
        env_out = collect_env(step, deadline, samples, members, totals)
        stepped.update({i: (env_out, row) for row, i in enumerate(members)})
    totals.env_seconds += time.perf_counter() - t0
    return stepped


def take_env_step(sample: Sample, env_out: EnvironmentReturn, row: int, tokenizer, max_seq_len: int) -> None:
    """Record the sample's environment step (row `row` of `env_out`): its reward, answer and
    metadata, then how it goes on: ended by the environment (COMPLETED), stopped because the
    observation does not fit (TRUNCATED), or with the observation appended for its next turn."""
    if sample.status is not SampleStatus.RUNNING:  # timed out: its step has no results
        return
    _add_reward(sample, env_out, row)
    if env_out.answers is not None:
        sample.answer = env_out.answers[row]
    sample.extra_env_info = env_out.metadata[row]
    if bool(env_out.terminateds[row]):
        sample.status = SampleStatus.COMPLETED
        return
    total_len = sum(len(m["token_ids"]) for m in sample.message_log)
    obs = env_out.observations[row]
    _, obs_ids = observation_ids(tokenizer, obs, sample.message_log[-1]["token_ids"].tolist())
    obs_ids = torch.tensor(obs_ids, dtype=torch.long)
    if total_len + len(obs_ids) >= max_seq_len:
        # The observation cannot fit with room left to answer: stop here.
        sample.status = SampleStatus.TRUNCATED
        return
    append_message(sample.message_log, obs.get("role", "environment"), obs["content"], obs_ids)
    sample.observation_tokens += len(obs_ids)
    sample.stop_strings = env_out.next_stop_strings[row]


def finish_episodes(envs: dict[str, Any], samples: list[Sample], deadline: Optional[float], totals: RolloutTotals) -> None:
    """Score the episodes the rollout stopped before their environment ended them (TRUNCATED,
    TURN_LIMIT) with the environment's `finish`, so every episode is scored."""
    unfinished = [i for i, s in enumerate(samples) if s.status in (SampleStatus.TRUNCATED, SampleStatus.TURN_LIMIT)]
    if not unfinished:
        return
    t0 = time.perf_counter()
    env_out = collect_env(launch_env(envs, samples, unfinished, method="finish"), deadline, samples, unfinished, totals)
    for row, i in enumerate(unfinished):
        if not samples[i].timed_out:
            _add_reward(samples[i], env_out, row)
            if env_out.answers[row] is not None:
                samples[i].answer = env_out.answers[row]
    totals.env_seconds += time.perf_counter() - t0


def _add_reward(sample: Sample, env_out: EnvironmentReturn, row: int) -> None:
    """Add row `row` of `env_out`'s reward (and its named components) to the sample's."""
    # Summed in float32, as a reward tensor would be, so that `reward` is its entry of `rewards`.
    sample.reward = (torch.tensor(sample.reward, dtype=torch.float32) + float(env_out.rewards[row])).item()
    components = getattr(env_out, "reward_components", None)
    for name, value in (components[row] if components is not None else {}).items():
        if value is not None and not math.isnan(value):  # NaN: the component does not apply to this sample
            sample.reward_components[name] = sample.reward_components.get(name, 0.0) + float(value)
    sample.reward_component_weights.update(getattr(env_out, "reward_component_weights", None) or {})


def rollout_result(samples: list[Sample], totals: RolloutTotals) -> RolloutResult:
    """The rollout's tensors, metrics and timings, read from the samples' state."""
    def flags(of) -> torch.Tensor:
        return torch.tensor([bool(of(s)) for s in samples], dtype=torch.bool)

    def mean(of) -> float:
        return torch.tensor([float(of(s)) for s in samples], dtype=torch.float32).mean().item()

    metrics = {
        "mean_gen_tokens_per_sample": mean(lambda s: s.generated_tokens),
        "mean_env_tokens_per_sample": mean(lambda s: s.observation_tokens),
        "avg_turns_per_sample": mean(lambda s: s.turns),
        "natural_termination_rate": mean(lambda s: s.status is SampleStatus.COMPLETED),
        "truncation_rate": mean(lambda s: s.status is SampleStatus.TRUNCATED),
        "max_turns_reached_rate": mean(lambda s: s.status is SampleStatus.TURN_LIMIT),
        "max_new_tokens_hit_rate": mean(lambda s: s.hit_max_new_tokens),
        **{f"env/{key}": value for key, value in per_episode_components(totals.env_counts, samples).items()},
        **speculative_metrics(totals.speculative),
    }
    waits = totals.waits
    timings = {"env_step_wait": sum(waits) / len(waits) if waits else 0.0,
               "generation_shard_spread": totals.shard_spread}
    return RolloutResult(
        samples, torch.tensor([s.reward for s in samples], dtype=torch.float32),
        flags(lambda s: s.status is SampleStatus.TRUNCATED), flags(lambda s: s.overlong), [s.answer for s in samples],
        metrics, totals.env_seconds, timings, flags(lambda s: s.timed_out),
    )


def _whole_groups(members: list[int], group_size: int, group_left: Counter, waiting: dict[int, list[int]]) -> list[int]:
    """Of the samples just generated (`members`), those whose whole group (its samples active this
    turn) is now generated, with their group-mates generated earlier, in sample order; the others
    wait in `waiting`. `group_left` counts each group's samples still being generated."""
    ready = []
    for i in members:
        group = i // group_size
        group_left[group] -= 1
        waiting.setdefault(group, []).append(i)
        if group_left[group] == 0:
            ready.extend(waiting.pop(group))
    return sorted(ready)


def add_speculative_counts(totals: dict[str, float], out: Batch) -> None:
    """Add a generation's speculative counts (`speculative.SPECULATIVE_COUNTS`, per row; present when the
    native engine speculated) and its generated tokens to `totals`."""
    if "speculative_forwards" not in out:
        return
    counts = {name: float(out[name].sum()) for name in SPECULATIVE_COUNTS}
    add_counts(totals, {**counts, "generated_tokens": float(out["generation_lengths"].sum())})


def speculative_metrics(totals: dict[str, float]) -> dict[str, float]:
    """`speculative/acceptance_rate` (drafted tokens the policy kept) and `speculative/tokens_per_forward`
    (generated tokens per policy forward, prefill included: 1.0 without speculation) of summed counts."""
    if not totals.get("speculative_forwards"):
        return {}
    drafted = totals["speculative_draft_tokens"]
    return {
        "speculative/acceptance_rate": totals["speculative_accepted_tokens"] / drafted if drafted else 0.0,
        "speculative/tokens_per_forward": totals["generated_tokens"] / totals["speculative_forwards"],
    }


def add_counts(totals: dict[str, float], metrics: Optional[dict[str, float]]) -> None:
    for key, value in (metrics or {}).items():
        totals[key] = totals.get(key, 0.0) + value


def per_episode_components(env_counts: dict[str, float], samples: list[Sample]) -> dict[str, float]:
    """Environments' counts (`<task>/<key>`, summed over the rollout) with reward components
    (`<task>/reward/<name>`, summed over episodes) turned into their mean per episode of the task,
    so they read on the scale of `train/reward`."""
    episodes = Counter(s.task_name for s in samples)
    out = dict(env_counts)
    for key in env_counts:
        task = next((t for t in episodes if key.startswith(f"{t}/reward/")), None)
        if task is not None:
            out[key] = env_counts[key] / episodes[task]
    return out
