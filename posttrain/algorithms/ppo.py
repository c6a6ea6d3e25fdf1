"""PPO with a critic (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; for language
models Ouyang et al. 2022, InstructGPT) on the on-policy runtime GRPO runs on, with VAPO's
separate GAE lambdas for the policy and the critic (Yuan et al. 2025).

PPO's step is GRPO's step with values added:
    prompts -> (lazy) refit -> rollout -> rewards, masks             (GRPO's `collect_experience`)
    -> the critic's values of every token, [reference logprobs for the KL in the reward]
    -> GAE (the `gae` advantage estimator): advantages with `critic.lambda_actor` (whitened),
       returns = GAE with `critic.lambda_critic` + values
    -> critic update (clipped value loss) -> after `critic.warmup_steps`, the policy update
       (GRPO's clipped policy-gradient loss on the GAE advantages) -> metrics, validation, checkpoint

The critic is one more worker group beside the policy (`OnPolicyContext.critic`: a `Policy` of
model_type "value", the policy's architecture with a one-output head on every token); the loop
checkpoints and resumes it with the policy (`step_N/critic/`); refit moves the policy only.

The KL to the reference model is either a loss term (GRPO's convention: `loss_fn.
reference_policy_kl_penalty` beta in the policy's loss) or, with `critic.kl_in_reward`, a reward
of -beta * KL_t on every generated token (InstructGPT's and verl's), which GAE then spreads.

Generation may run on workers of its own (`policy.generation.colocated.enabled=false`, as for
GRPO), and with `grpo.async_grpo.enabled` it overlaps training (NeMo-RL's async PPO): async
GRPO's trajectory collector, replay buffer and staleness bound (`async_grpo.async_grpo_train`)
with PPO's update of each step's batch (`async_ppo_train`). A batch is then up to
`grpo.async_grpo.max_trajectory_age_steps` policy steps old:
- GAE uses the critic's values computed when the step trains (by the critic as its previous
  update left it), not values from generation time. The values are a baseline and a bootstrap:
  any function of the state leaves the policy gradient unbiased, so the freshest critic (the
  best estimate) is the right one; they are also the `prev_values` the clipped value loss starts
  from, as in synchronous PPO; and valuing at generation time would need a critic forward beside
  the collector while the critic trains, giving values that are older still.
- The policy's loss corrects the staleness as async GRPO's does: previous logprobs recomputed on
  the current weights and the importance weights exp(logp_prev - logp_generation) (required by
  the config, with the truncations `tis`, `icepop`, `seq-mask-tis`).
- The critic's targets (returns) are those of the generating weights' samples, not importance
  weighted: at most `max_trajectory_age_steps` steps behind, the critic learns the value of a
  policy that close to the current one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.algorithms import advantages as adv
from posttrain.algorithms.async_grpo import async_grpo_train
from posttrain.algorithms.experience import update_policy
from posttrain.algorithms.grpo import collect_experience
from posttrain.algorithms.grpo_run import run_grpo, validate_grpo
from posttrain.algorithms.loop import prefixed
from posttrain.algorithms.loss import build_loss, masked_mean, per_token_kl
from posttrain.algorithms.on_policy import OnPolicyContext, build_on_policy_run, phase_memory_metrics
from posttrain.algorithms.value_loss import explained_variance
from posttrain.config.schema import PolicyConfig, PPOMasterConfig
from posttrain.distributed.batch import Batch
from posttrain.errors import UserError
from posttrain.utils.timer import Timer

# What the critic's training reads of the step's batch.
CRITIC_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "returns", "prev_values")


# ----------------------------------------------------------------------------------- set-up
def critic_config(cfg: Any) -> PolicyConfig:
    """The critic's workers, from the started config: the policy's settings (precision, batch
    sizes, packing, scheduler, FSDP2 options) with the critic's model, optimizer and worker count.
    Data parallel only (no tensor or context parallel, no LoRA: the critic trains all weights)."""
    from posttrain.models.paths import checkpoint_policy_dir
    from posttrain.models.policy.checkpoint import converted_checkpoint

    c, policy = cfg.critic, cfg.policy
    model_name = c.model_name or policy.model_name
    checkpoint = checkpoint_policy_dir(Path(model_name).expanduser())
    if checkpoint is not None:  # a step_N checkpoint (a reward model's, say): its cached HF copy
        model_name = str(converted_checkpoint(checkpoint))
    fields = policy.model_dump()
    fields.update(
        model_name=model_name, tokenizer_name=policy.tokenizer_name or policy.model_name,
        num_workers=policy.num_workers if c.colocated else c.num_workers or policy.num_workers,
        tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False, pipeline_parallel_size=1,
        pipeline_virtual_stages=None, pipeline_layer_split=None,
        lora={**fields["lora"], "enabled": False},
        optimizer=c.optimizer.model_dump() if c.optimizer is not None else fields["optimizer"],
    )
    if policy.tensor_parallel_size > 1 or policy.context_parallel_size > 1 or policy.pipeline_parallel_size > 1:
        print(f"[posttrain] critic: data parallel (FSDP2) over its {fields['num_workers']} workers; the policy's tensor, "
              "context and pipeline parallel sizes are the policy's only", flush=True)
    try:
        return PolicyConfig.model_validate(fields)
    except ValueError as e:
        raise UserError(f"critic (the policy's settings with the critic's model and workers): {e}") from None


def policy_loss(cfg: Any) -> Any:
    """The policy's clipped policy-gradient loss (`loss_fn`); with `critic.kl_in_reward` the KL is
    in the reward, so not in the loss as well."""
    if cfg.critic.kl_in_reward:
        return build_loss(cfg.loss_fn.model_copy(update={"reference_policy_kl_penalty": 0.0}))
    return build_loss(cfg.loss_fn)


def setup(cfg: PPOMasterConfig) -> OnPolicyContext:
    """Start a PPO run: GRPO's on-policy set-up with a critic beside the policy, and a reference
    model when `loss_fn.reference_policy_kl_penalty` > 0 (the KL in the loss or in the reward)."""
    name = cfg.grpo.adv_estimator.name
    try:
        takes_values = adv.takes_values(name)
    except ValueError as e:
        raise UserError(f"grpo.adv_estimator.name: {e}") from None
    if not takes_values:
        raise UserError(f"grpo.adv_estimator.name={name!r} does not take the critic's values; posttrain ppo needs an "
                        "estimator that does: 'gae' (the default), or a function with a `values` argument")
    return build_on_policy_run(cfg, section="grpo", name="PPO", make_loss=policy_loss,
                               reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
                               critic=critic_config, critic_colocated=cfg.critic.colocated)


# --------------------------------------------------------------------------------- the loop
def ppo_train(ctx: OnPolicyContext) -> dict[str, float]:
    """Train from the context's step to its last step (`TrainingLoop` runs the schedule):
    synchronously, or with `grpo.async_grpo.enabled` while the next batches generate
    (`async_ppo_train`)."""
    if ctx.cfg.grpo.async_grpo.enabled:
        return async_ppo_train(ctx)
    return ctx.loop.run(lambda step, timer: ppo_step(ctx, step, timer), lambda: validate_grpo(ctx),
                        recovery=ctx.recovery)


def async_ppo_train(ctx: OnPolicyContext) -> dict[str, float]:
    """Async PPO: async GRPO's loop (collector, replay buffer, staleness bound, refit after each
    step) with PPO's update (`ppo_update`, off-policy) of each step's batch."""
    return async_grpo_train(ctx, update=lambda ctx, train_data, step, timer: ppo_update(
        ctx, train_data, step, timer, off_policy=True))


def ppo_step(ctx: OnPolicyContext, step: int, timer: Timer) -> dict[str, float]:
    """One synchronous PPO step: GRPO's experience, then `ppo_update`."""
    train_data, metrics = collect_experience(ctx, step, timer)
    metrics.update(ppo_update(ctx, train_data, step, timer, off_policy=False))
    if not metrics["train/critic_warmup"]:  # in the warm-up the engine's weights stay current
        ctx.generation_stale = True
    return {**metrics, **phase_memory_metrics(ctx)}


def ppo_update(ctx: OnPolicyContext, train_data: Batch, step: int, timer: Timer, *, off_policy: bool) -> dict[str, float]:
    """PPO's update of a step's batch: the critic's values (its current weights), GAE and the
    critic update, then, after the critic's warm-up, the policy update (`off_policy`: the batch
    comes from older weights, async PPO: previous logprobs recomputed and importance-weighted as
    in async GRPO). Returns the critic's, advantage and policy metrics with their full names."""
    metrics = update_critic(ctx, train_data, timer)
    if step <= ctx.cfg.critic.warmup_steps:  # only the critic learns
        return {**metrics, "train/critic_warmup": 1.0}
    train_metrics = update_policy(ctx, train_data, timer, off_policy=off_policy)
    return {**metrics, "train/critic_warmup": 0.0, **prefixed(train_metrics, "train")}


def update_critic(ctx: OnPolicyContext, train_data: Batch, timer: Timer) -> dict[str, float]:
    """Value the batch's tokens, put GAE advantages (`advantages`) and the critic's targets
    (`returns`, `prev_values`) into `train_data`, and train the critic on them; returns the
    step's critic and advantage metrics."""
    cfg, c = ctx.cfg, ctx.cfg.critic
    with timer.time("values"):
        values = ctx.critic.get_values(train_data)["values"]
    token_rewards, kl_metrics = kl_rewards(ctx, train_data, timer) if c.kl_in_reward else (None, {})
    advantages, returns = gae_targets(cfg, train_data, values, token_rewards)
    mask = train_data["token_mask"] * (train_data["sample_mask"][:, None] > 0)
    train_data["advantages"] = adv.masked_whiten(advantages, mask) if c.whiten_advantages else advantages
    train_data["returns"], train_data["prev_values"] = returns, values
    with timer.time("critic_training"):
        trained = ctx.critic.train(Batch({k: train_data[k] for k in CRITIC_KEYS}), build_loss("value", value_clip=c.value_clip),
                                   global_batch_size=cfg.policy.train_global_batch_size)
    valid = mask > 0
    raw = advantages[valid] if valid.any() else torch.zeros(1)
    return {
        "train/critic/value_loss": trained["loss"],
        "train/critic/value_clip_fraction": trained["value_clip_fraction"],
        "train/critic/grad_norm": trained["grad_norm"],
        "train/critic/lr": trained["lr"],
        # Of the values the advantages were computed from, before this step's update: on fresh samples.
        "train/critic/explained_variance": explained_variance(values, returns, mask),
        "train/critic/values_mean": masked_mean(values, mask).item(),
        "train/critic/returns_mean": masked_mean(returns, mask).item(),
        "train/advantages/mean": raw.mean().item(),  # before whitening (GRPO's are per sample)
        "train/advantages/max": raw.max().item(),
        "train/advantages/min": raw.min().item(),
        **kl_metrics,
    }


def gae_targets(cfg: Any, train_data: Batch, values: torch.Tensor,
                token_rewards: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(advantages, returns)` `[B, S]` of the configured estimator (`grpo.adv_estimator`, `gae`):
    the policy's with `critic.lambda_actor`, the critic's targets with `critic.lambda_critic`
    (VAPO: lambda 1 gives the critic unbiased Monte-Carlo targets while the policy's advantages
    keep a lower variance); one pass when both lambdas agree."""
    c, estimator = cfg.critic, cfg.grpo.adv_estimator
    sample_mask = train_data["sample_mask"]
    group_ids = torch.arange(sample_mask.shape[0]) // cfg.grpo.num_generations_per_prompt

    def estimate(lam: float) -> torch.Tensor:
        return adv.compute_advantages(
            estimator.name, train_data["rewards"], group_ids, sample_mask, values=values,
            token_mask=train_data["token_mask"], token_rewards=token_rewards, gamma=c.gamma, lam=lam, **estimator.kwargs,
        )

    critic_advantages = estimate(c.lambda_critic)
    actor_advantages = critic_advantages if c.lambda_actor == c.lambda_critic else estimate(c.lambda_actor)
    mask = train_data["token_mask"] * (sample_mask[:, None] > 0)
    return actor_advantages, (critic_advantages + values) * mask


def kl_rewards(ctx: OnPolicyContext, train_data: Batch, timer: Timer) -> tuple[torch.Tensor, dict[str, float]]:
    """`critic.kl_in_reward`: the per-token reward -beta * KL_t between the policy and the reference
    model on the sampled tokens (`loss_fn.reference_policy_kl_type`, k1 being InstructGPT's
    log-ratio), and its token mean as `train/reward_kl`.

    Both sides are the trainer's forwards (`get_logprobs`, `get_reference_logprobs`), never the
    generation engine's logprobs: with bfloat16, int8 or fp8 generation, or vLLM, the engine's
    mismatch to the trainer (`train/token_mult_prob_error`) would otherwise be rewarded or
    penalised as if it were a KL to the reference. The policy's logprobs are the batch's
    `prev_logprobs` (its weights do not move before the policy update) and the reference's its
    `reference_policy_logprobs`, so the update computes neither again."""
    loss_cfg, temperature = ctx.cfg.loss_fn, ctx.cfg.policy.generation.temperature
    with timer.time("logprobs"):
        current = ctx.policy.get_logprobs(train_data, temperature)["logprobs"]
        reference = ctx.policy.get_reference_logprobs(train_data, temperature)["logprobs"]
    train_data["prev_logprobs"], train_data["reference_policy_logprobs"] = current, reference
    kl = per_token_kl(current, reference, loss_cfg.reference_policy_kl_type,
                      loss_cfg.kl_input_clamp_value, loss_cfg.kl_output_clamp_value)
    mask = train_data["token_mask"] * (train_data["sample_mask"][:, None] > 0)
    return -loss_cfg.reference_policy_kl_penalty * kl * mask, {"train/reward_kl": masked_mean(kl, mask).item()}


# ------------------------------------------------------------------------------ entry point
def run(cfg: PPOMasterConfig) -> dict[str, Optional[float]]:
    """`posttrain ppo`: optional SFT warm start, then PPO (asynchronous with
    `grpo.async_grpo.enabled`); prints before/after accuracy and returns them (`before`, `after`:
    the first and the last validation accuracy, or None)."""
    return run_grpo(cfg, ppo_train, setup=setup)
