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

Samples come in prompt groups (`group_size` consecutive samples, GRPO's generations of one prompt):
each turn a group's active samples go to their environment together, once the last of them is
generated, so an environment that scores a group as a whole (the pairwise judge) sees all of it
however the generation workers split the batch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from posttrain.data.chat import observation_ids
from posttrain.data.message_log import append_message, flatten_message_logs
from posttrain.data.sample import Sample
from posttrain.distributed.batch import Batch
from posttrain.environments.registry import launch_step


@dataclass
class RolloutResult:
    samples: list[Sample]  # the input samples: message logs extended, `reward` set, in place
    rewards: torch.Tensor  # [B] summed over turns (also each sample's `reward`)
    truncated: torch.Tensor  # [B] bool: stopped by the token limit, not by the environment
    overlong: torch.Tensor  # [B] bool: truncated, or the last turn hit max_new_tokens (DAPO filter)
    answers: list[Optional[str]]  # the answer each environment extracted at the sample's last turn
    metrics: dict[str, float] = field(default_factory=dict)
    env_seconds: float = 0.0  # wall time spent waiting for environments (the "reward" timing)
    # Per-sample progress, in seconds: `env_step_wait` (mean time from a sample's generation coming
    # back to its environment step starting) and `generation_shard_spread` (first to last engine
    # shard back, summed over turns: what early samples would wait without per-shard stepping).
    timings: dict[str, float] = field(default_factory=dict)
    # [B] bool: samples whose environment did not answer before the rollout's deadline (dropped).
    timed_out: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    def add_timings(self, timer, seconds: float) -> None:
        """Split the rollout's `seconds` between `generation` and `reward` (environment time not
        hidden behind generation) on `timer`, so a step's time breakdown adds up, and add the
        per-sample progress timings."""
        timer.add("generation", seconds - self.env_seconds)
        timer.add("reward", self.env_seconds)
        for name, value in self.timings.items():
            timer.add(name, value)


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
    """The turns of `run_multi_turn_rollout`.

    Args:
        generation: a `GenerationInterface` (`generate(batch, greedy) -> Batch`).
        envs: task name -> environment (actor handle or local instance).
        max_seq_len: total token limit of a conversation (prompt + all turns).
        seeds: optional per-sample sampling seeds `[B]`; turn t uses `seeds + t`, so a fixed seed
            reproduces the whole rollout regardless of batching.
        params: per-call sampling overrides passed to `generate` (e.g. `{"temperature": 0.6}` for
            validation at `policy.generation.val_temperature`).
        deadline: `time.monotonic()` after which environment steps are not waited for: samples
            whose environment has not answered end there, flagged in `timed_out` (default None:
            wait for every environment).
        group_size: consecutive samples that form one prompt group, stepped together (module
            docstring; default 1: every sample on its own).
    """
    n = len(samples)
    rewards = torch.zeros(n)
    truncated = torch.zeros(n, dtype=torch.bool)
    active = list(range(n))
    stop_strings: list[Optional[list[str]]] = [s.stop_strings for s in samples]
    turns = torch.zeros(n, dtype=torch.long)
    terminated = torch.zeros(n, dtype=torch.bool)
    gen_tokens = torch.zeros(n, dtype=torch.long)
    env_tokens = torch.zeros(n, dtype=torch.long)
    hit_max_new_tokens = torch.zeros(n, dtype=torch.bool)
    timed_out = torch.zeros(n, dtype=torch.bool)
    env_seconds = 0.0
    answers: list[Optional[str]] = [None] * n
    env_counts: dict[str, float] = {}  # environments' own counts (EnvironmentReturn.metrics), summed
    waits: list[float] = []  # per sample and turn: seconds from its generation's return to its environment step
    generated_at = [0.0] * n  # when each sample's generation of this turn came back
    shard_spread = 0.0  # per turn, first to last engine shard back: what early shards no longer wait for

    for turn in range(max_rollout_turns):
        if not active:
            break
        logs = [samples[i].message_log for i in active]
        batch = flatten_message_logs(logs, pad_token_id=tokenizer.pad_token_id)
        batch = Batch(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
        batch["stop_strings"] = [stop_strings[i] for i in active]
        if seeds is not None:
            batch["seeds"] = seeds[active] + turn * 1_000_003
        # Engines return their shards as they finish: each shard's samples are appended and their
        # environments start stepping at once (with the rest of their group once it is generated),
        # while the other shards still generate.
        pending, ready_at, launch_seconds = [], [], 0.0
        group_left = Counter(i // group_size for i in active)  # each group's samples not generated yet
        waiting: dict[int, list[int]] = {}  # group -> its samples generated, waiting for the rest
        for rows, out in generation.generate_shards(batch, greedy=greedy, params=params):
            ready_at.append(time.perf_counter())
            members = [active[row] for row in rows]
            for k, (row, i) in enumerate(zip(rows, members)):
                start = int(batch["input_lengths"][row])
                length = int(out["generation_lengths"][k])
                token_ids = out["output_ids"][k, start : start + length].clone()
                logprobs = out["logprobs"][k, start : start + length].clone()
                append_message(
                    samples[i].message_log,
                    "assistant",
                    tokenizer.decode(token_ids.tolist(), skip_special_tokens=True),
                    token_ids,
                    generation_logprobs=logprobs,
                    weight_version=weight_version,
                )
                gen_tokens[i] += length
                turns[i] += 1
                hit_max_new_tokens[i] = bool(out["truncated"][k])
                generated_at[i] = ready_at[-1]
            members = _whole_groups(members, group_size, group_left, waiting)
            if not members:
                continue
            t0 = time.perf_counter()
            waits.extend(t0 - generated_at[i] for i in members)
            pending.append((members, launch_step(
                envs,
                [text_only(samples[i].message_log) for i in members],
                [samples[i].extra_env_info or {} for i in members],
                [samples[i].task_name for i in members],
            )))
            launch_seconds += time.perf_counter() - t0  # local environments step right here
        shard_spread += ready_at[-1] - ready_at[0] if ready_at else 0.0

        t0 = time.perf_counter()
        stepped = {}  # sample -> (its shard's environment results, its row there)
        for members, step in pending:
            env_out = step.result(None if deadline is None else deadline - time.monotonic())
            timed_out[[members[row] for row in step.timed_out]] = True
            _add_counts(env_counts, env_out.metrics)
            stepped.update({i: (env_out, row) for row, i in enumerate(members)})
        # Environment time the rollout waited for (beyond what overlapped generation).
        env_seconds += launch_seconds + time.perf_counter() - t0

        still_active = []
        for i in active:
            env_out, row = stepped[i]
            if timed_out[i]:
                continue
            rewards[i] += float(env_out.rewards[row])
            if env_out.answers is not None:
                answers[i] = env_out.answers[row]
            samples[i].extra_env_info = env_out.metadata[row]
            if bool(env_out.terminateds[row]):
                terminated[i] = True
                continue
            total_len = sum(len(m["token_ids"]) for m in samples[i].message_log)
            obs = env_out.observations[row]
            _, obs_ids = observation_ids(tokenizer, obs, samples[i].message_log[-1]["token_ids"].tolist())
            obs_ids = torch.tensor(obs_ids, dtype=torch.long)
            if total_len + len(obs_ids) >= max_seq_len:
                # The observation cannot fit with room left to answer: stop here (truncated).
                truncated[i] = True
                continue
            append_message(samples[i].message_log, obs.get("role", "environment"), obs["content"], obs_ids)
            env_tokens[i] += len(obs_ids)
            stop_strings[i] = env_out.next_stop_strings[row]
            still_active.append(i)
        active = still_active

    max_turns_reached = torch.zeros(n, dtype=torch.bool)
    max_turns_reached[active] = True
    # Episodes stopped before their environment ended them are scored by its `finish`.
    unfinished = [i for i in range(n) if not terminated[i] and not timed_out[i]]
    if unfinished:
        t0 = time.perf_counter()
        step = launch_step(envs, [text_only(samples[i].message_log) for i in unfinished],
                           [samples[i].extra_env_info or {} for i in unfinished],
                           [samples[i].task_name for i in unfinished], method="finish")
        env_out = step.result(None if deadline is None else deadline - time.monotonic())
        timed_out[[unfinished[row] for row in step.timed_out]] = True
        _add_counts(env_counts, env_out.metrics)
        for row, i in enumerate(unfinished):
            if not timed_out[i]:
                rewards[i] += float(env_out.rewards[row])
                answers[i] = env_out.answers[row] if env_out.answers[row] is not None else answers[i]
        env_seconds += time.perf_counter() - t0
    metrics = {
        "mean_gen_tokens_per_sample": gen_tokens.float().mean().item(),
        "mean_env_tokens_per_sample": env_tokens.float().mean().item(),
        "avg_turns_per_sample": turns.float().mean().item(),
        "natural_termination_rate": terminated.float().mean().item(),
        "truncation_rate": truncated.float().mean().item(),
        "max_turns_reached_rate": max_turns_reached.float().mean().item(),
        "max_new_tokens_hit_rate": hit_max_new_tokens.float().mean().item(),
        **{f"env/{key}": value for key, value in per_episode_components(env_counts, samples).items()},
    }
    timings = {"env_step_wait": sum(waits) / len(waits) if waits else 0.0, "generation_shard_spread": shard_spread}
    for sample, reward in zip(samples, rewards.tolist()):
        sample.reward = reward
    return RolloutResult(samples, rewards, truncated, truncated | hit_max_new_tokens, answers, metrics, env_seconds,
                         timings, timed_out)


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


def _add_counts(totals: dict[str, float], metrics: Optional[dict[str, float]]) -> None:
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
