"""GRPO's experience, shared by the synchronous loop (`grpo.py`) and the asynchronous one
(`async_grpo.py`): prompt groups rolled out and scored (rewards, shaping, advantages) and groups
turned into a training batch with the step's metrics. GRPO's set-up, validation and run are in
`grpo_run.py`.

`ctx` is the run's `OnPolicyContext`: the functions read its `cfg`, `policy`, `generation`,
`tokenizer`, `envs`, `refit_metadata` and `step`.
This module imports neither loop, so neither loop imports the other (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from posttrain.algorithms import adaptive_entropy
from posttrain.algorithms import advantages as adv
from posttrain.algorithms.format_reward import format_flags, format_metrics
from posttrain.algorithms.loop import SIGNAL_METRIC
from posttrain.data.message_log import flatten_message_logs
from posttrain.data.sample import Sample
from posttrain.distributed.batch import Batch
from posttrain.rollouts import run_multi_turn_rollout, sample_seeds
from posttrain.utils.metrics import per_task_means, response_lengths
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.grpo")

SHAPING_COMPONENT = "shaping"  # GDPO's component for what reward shaping (the format reward too) adds to the rewards


@dataclass
class PromptGroup:
    """One prompt's `num_generations_per_prompt` rolled-out samples (each with its reward,
    advantage and sample mask): the unit that the replay buffer of async GRPO holds and that
    dynamic sampling keeps or drops."""

    samples: list[Sample]
    has_signal: bool  # rewards differ within the group (DAPO's dynamic sampling keeps only these)
    weight_version: int  # policy step of the generation weights the rollout started from
    timed_out: bool = False  # an environment did not answer before the rollout's deadline
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # of the rollout batch it came from

    @property
    def rewards(self) -> torch.Tensor:
        """[n] environment rewards before shaping (logged as train/reward)."""
        return torch.tensor([s.reward for s in self.samples])


def roll_out_groups(
    ctx: Any, prompts: list[Sample], seed_key: int, timer: Timer, *, generation: Any = None,
    weight_version: Optional[int] = None, deadline: Optional[float] = None,
) -> tuple[list[PromptGroup], dict[str, float]]:
    """Roll out `num_generations_per_prompt` samples of each prompt and score them: one group per
    prompt, and the rollout's metrics.

    `seed_key` fixes the samples' seeds (sync GRPO: step x 1000 + generation batch). `generation`
    defaults to `ctx.generation`; `weight_version` (default `ctx.step`) tags the groups;
    `deadline` (a `time.monotonic()`) ends environment waits (see `run_multi_turn_rollout`).
    """
    cfg, g = ctx.cfg, ctx.cfg.grpo
    n_gen = g.num_generations_per_prompt
    version = ctx.step if weight_version is None else weight_version
    samples = [prompt.fresh_copy() for prompt in prompts for _ in range(n_gen)]

    t0 = time.perf_counter()
    result = run_multi_turn_rollout(
        generation or ctx.generation, samples, ctx.tokenizer, ctx.envs,
        max_seq_len=cfg.policy.max_total_sequence_length, max_rollout_turns=g.max_rollout_turns,
        seeds=sample_seeds(g.seed, seed_key, len(samples)), weight_version=version, deadline=deadline,
        group_size=n_gen,
    )
    result.add_timings(timer, time.perf_counter() - t0)
    return score_groups(ctx, result, len(prompts), version), result.metrics


def score_groups(ctx: Any, result: Any, num_groups: int, version: int) -> list[PromptGroup]:
    """A rollout's samples (`result`, a `RolloutResult` of `num_groups` consecutive groups of
    `num_generations_per_prompt`) scored: reward shaping, advantages and sample masks set on the
    samples, one `PromptGroup` per prompt, tagged with weight version `version`."""
    cfg, g = ctx.cfg, ctx.cfg.grpo
    n_gen = g.num_generations_per_prompt
    samples = result.samples
    group_ids = torch.arange(num_groups).repeat_interleave(n_gen)
    rewards = shaped_rewards(cfg, result.rewards, samples)
    sample_mask = torch.tensor([s.loss_multiplier for s in samples])
    if g.overlong_filtering:
        sample_mask = sample_mask * (~result.overlong).float()
    lp = cfg.reward_shaping.length_penalty
    if lp.enabled and ctx.step >= lp.warmup_steps:  # Kimi k1.5: correctness from the environment's reward
        rewards = rewards + lp.weight * adv.length_reward(result.rewards, response_lengths(samples), group_ids,
                                                          sample_mask, correct_reward=lp.correct_reward)
    fr = cfg.reward_shaping.format_reward
    in_format = format_flags(fr, samples) if fr.weight > 0 else None
    if in_format is not None:  # R1-Zero: a small reward for the answer format, beside correctness
        rewards = rewards + fr.weight * in_format
    if adv.takes_values(g.adv_estimator.name):  # a critic's (PPO): per token, once the critic has valued the batch
        advantages = torch.zeros_like(rewards)
    else:
        advantages = adv.compute_advantages(
            g.adv_estimator.name, rewards, group_ids, sample_mask,
            **advantage_options(g, samples, shaping=rewards - result.rewards),
        )
    # DAPO: a group whose (unshaped) rewards all agree teaches nothing; under GDPO, nor do its components.
    signal = adv.filter_zero_variance_groups(result.rewards, group_ids, num_groups=num_groups)
    if in_format is not None:  # a group of wrong answers teaches the format where only some are in it
        signal = signal | adv.filter_zero_variance_groups(in_format, group_ids, num_groups=num_groups)
    names = reward_component_names(samples) if g.adv_estimator.name == "gdpo" else []
    for column in component_matrix(samples, names).T if names else []:
        applies = ~torch.isnan(column)
        signal = signal | adv.filter_zero_variance_groups(column.nan_to_num(0.0), group_ids, num_groups=num_groups,
                                                          sample_mask=applies.float())
    for sample, reward, advantage, mask in zip(samples, rewards.tolist(), advantages.tolist(), sample_mask.tolist()):
        sample.shaped_reward, sample.advantage, sample.sample_mask = reward, advantage, mask
    return [
        PromptGroup(samples[p * n_gen:(p + 1) * n_gen], bool(signal[p]), version,
                    bool(result.timed_out[p * n_gen:(p + 1) * n_gen].any()))
        for p in range(num_groups)
    ]


def shaped_rewards(cfg: Any, rewards: torch.Tensor, samples: list[Sample]) -> torch.Tensor:
    """The samples' environment `rewards` after reward shaping (DAPO's overlong penalty when
    `reward_shaping.enabled`): what the advantages are computed from."""
    if not cfg.reward_shaping.enabled:
        return rewards
    rs = cfg.reward_shaping
    return adv.apply_overlong_penalty(
        rewards, response_lengths(samples),
        max_response_length=rs.max_response_length or cfg.policy.generation.max_new_tokens,
        buffer_length=rs.overlong_buffer_length, penalty=rs.overlong_buffer_penalty,
    )


def advantage_options(g, samples: list[Sample], shaping: Optional[torch.Tensor] = None) -> dict[str, Any]:
    """Keyword options of the configured estimator: the `grpo.*` keys of the built-in ones, plus
    `grpo.adv_estimator.kwargs`. GDPO's also carry the samples' reward components and their weights,
    with the reward shaping's share of each reward (`shaping`, [B], default None: none) as one more
    component, `shaping` (weight `reward_component_weights.shaping`, default 1), when it is not all 0
    (DAPO's overlong penalty, Kimi's length penalty)."""
    options: dict[str, Any] = {}
    if g.adv_estimator.name in ("grpo", "gdpo"):
        options = dict(normalize_rewards=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline,
                       group_std=g.group_std)
    if g.adv_estimator.name == "gdpo":
        names = reward_component_names(samples)
        if names:  # else the (shaped) reward itself is the one component
            matrix = component_matrix(samples, names)
            weights = component_weights(samples, names, g.adv_estimator.reward_component_weights)
            if shaping is not None and bool((shaping != 0).any()):
                matrix = torch.cat([matrix, shaping.to(matrix.dtype)[:, None]], dim=1)
                weights = [*weights, g.adv_estimator.reward_component_weights.get(SHAPING_COMPONENT, 1.0)]
            options["reward_components"], options["component_weights"] = matrix, weights
        options["batch_normalize"] = g.adv_estimator.batch_normalize
    return {**options, **g.adv_estimator.kwargs}


def reward_component_names(samples: list[Sample]) -> list[str]:
    """The reward components any of the samples has, sorted by name."""
    return sorted({name for sample in samples for name in sample.reward_components})


def component_matrix(samples: list[Sample], names: list[str]) -> torch.Tensor:
    """``[B, K]`` the samples' reward components `names`; NaN where a sample lacks one."""
    return torch.tensor([[s.reward_components.get(name, math.nan) for name in names] for s in samples],
                        dtype=torch.float32)


def component_weights(samples: list[Sample], names: list[str], configured: dict[str, float]) -> list[float]:
    """The weight of each component: the configured one, else the environment's, else 1.0."""
    declared: dict[str, float] = {}
    for sample in samples:
        declared.update(sample.reward_component_weights)
    unknown = sorted(set(configured) - set(names) - {SHAPING_COMPONENT})
    if unknown:  # a typo, or a task this step did not sample: said, not fatal
        log.warning("grpo.adv_estimator.reward_component_weights names %s, which no sample of this step has as "
                    "a reward component (they have %s)", unknown, names)
    return [configured.get(name, declared.get(name, 1.0)) for name in names]


def training_batch(
    ctx: Any, kept: list[PromptGroup], generated: list[PromptGroup], rollout_metrics: list[dict[str, float]],
) -> tuple[Batch, dict[str, float]]:
    """The training batch of the `kept` groups (advantages broadcast to tokens, sample masks) and
    the step's metrics over every `generated` group (`rollout_metrics`: one dict per rollout)."""
    rows = [sample for group in kept for sample in group.samples]
    if not rows:  # every group was filtered: train on a fully masked batch rather than crash
        rows = [replace(sample, advantage=0.0, sample_mask=0.0) for sample in generated[-1].samples]
    while len(rows) % ctx.cfg.policy.train_global_batch_size:  # whole optimizer steps (a short dynamic-sampling batch)
        rows.append(replace(rows[-1], advantage=0.0, sample_mask=0.0))

    seq_adv = torch.tensor([s.advantage for s in rows], dtype=torch.float32)
    train_data = flatten_message_logs([s.message_log for s in rows], pad_token_id=ctx.tokenizer.pad_token_id)
    train_data["sample_mask"] = torch.tensor([s.sample_mask for s in rows], dtype=torch.float32)
    # [B] the rewards the advantages were computed from (every shaping, the group's length reward
    # included): a critic's estimator (PPO's GAE) places them on each row's last generated token.
    train_data["rewards"] = torch.tensor([s.shaped_reward for s in rows], dtype=torch.float32)
    train_data["advantages"] = adv.broadcast_to_tokens(seq_adv, train_data["token_mask"])

    valid = train_data["sample_mask"] > 0
    stats = seq_adv[valid] if valid.any() else torch.zeros(1)
    all_rewards = torch.cat([group.rewards for group in generated])
    metrics = {
        "train/reward": all_rewards.mean().item(),
        **per_task_means(all_rewards, [s.task_name for group in generated for s in group.samples], "train/reward",
                         list(ctx.envs)),
        SIGNAL_METRIC: sum(group.has_signal for group in generated) / max(len(generated), 1),
        "train/advantages/mean": stats.mean().item(),
        "train/advantages/max": stats.max().item(),
        "train/advantages/min": stats.min().item(),
        "train/num_samples": float(train_data.size),
        "train/mean_prompt_length": sum(s.prompt_length for s in rows) / len(rows),
    }
    generated_samples = [s for group in generated for s in group.samples]
    if ctx.cfg.reward_shaping.format_reward.weight > 0:
        metrics.update(format_metrics(format_flags(ctx.cfg.reward_shaping.format_reward, generated_samples),
                                      [s.task_name for s in generated_samples], list(ctx.envs)))
    for name in reward_component_names(generated_samples):  # each reward component's mean where it applies
        values = [s.reward_components[name] for s in generated_samples if name in s.reward_components]
        metrics[f"train/reward_components/{name}"] = sum(values) / len(values)
    for key in {key for m in rollout_metrics for key in m}:  # environments' counts may differ per rollout
        metrics[f"train/{key}"] = sum(m.get(key, 0.0) for m in rollout_metrics) / len(rollout_metrics)
    return train_data, metrics


def update_policy(ctx: Any, train_data: Batch, timer: Timer, *, off_policy: bool) -> dict[str, float]:
    """Previous and reference logprobs, then the policy update, on `train_data`; returns the
    training metrics. `off_policy`: the generating weights are older than the policy's (async
    GRPO), so the previous logprobs are always recomputed on the current weights; on-policy they
    are needed only when the batch spans several optimizer steps (later steps need the old
    policy's), else the loss takes the training forward's own detached logprobs."""
    cfg = ctx.cfg
    temperature = cfg.policy.generation.temperature  # compared with the generation's processed logprobs
    gbs = cfg.policy.train_global_batch_size
    with timer.time("logprobs"):
        # (PPO's KL in the reward computed them on these weights already.)
        if (off_policy or train_data.size > gbs) and "prev_logprobs" not in train_data:
            train_data["prev_logprobs"] = ctx.policy.get_logprobs(train_data, temperature)["logprobs"]
        if cfg.loss_fn.reference_policy_kl_penalty > 0 and "reference_policy_logprobs" not in train_data:
            ref = ctx.policy.get_reference_logprobs(train_data, temperature)  # (PPO's KL in the reward has them)
            train_data["reference_policy_logprobs"] = ref["logprobs"]
    with timer.time("policy_training"):
        # The entropy bonus's coefficient (fixed, or adaptive with its state in the loop's checkpointed state).
        return adaptive_entropy.train_with_entropy_bonus(
            cfg.loss_fn, ctx.loop.state, ctx.loss_fn,
            lambda: ctx.policy.train(train_data, ctx.loss_fn, global_batch_size=gbs, temperature=temperature),
        )
