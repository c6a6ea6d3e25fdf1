"""`critic`: PPO's value model and how its values become advantages (`posttrain ppo`)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from posttrain.config.schema.base import Section
from posttrain.config.schema.policy import OptimizerConfig


class CriticConfig(Section):
    """PPO's critic (`posttrain ppo`): a value model, the policy's architecture with a one-output
    head on every token, trained by a worker group of its own beside the policy; its values turn
    the reward into per-token advantages by GAE (Schulman et al. 2016) with VAPO's separate
    lambdas for the policy and the critic (Yuan et al. 2025). Everything else about the workers
    (precision, batch sizes, packing, the scheduler, FSDP2 options) is the policy's."""

    model_name: Optional[str] = Field(
        None,
        description=(
            "The critic's initial weights: null (default) the policy's (after its SFT warm start) with a new value "
            "head; a reward model (a `posttrain rm` export or step_N checkpoint) keeps its trained head as the value "
            "head; or another HF directory or hub id with the policy's vocabulary."
        ),
    )
    colocated: bool = Field(
        True,
        description=(
            "The critic's workers share the policy's bundles (default true; the policy's num_workers of them); "
            "false: a cluster of its own with critic.num_workers bundles."
        ),
    )
    num_workers: Optional[int] = Field(
        None, ge=1,
        description=(
            "Data-parallel (FSDP2) workers of a critic on its own bundles (critic.colocated=false); default "
            "policy.num_workers. The critic runs data parallel only: the policy's tensor and context parallel "
            "sizes are the policy's."
        ),
    )
    optimizer: Optional[OptimizerConfig] = Field(
        None,
        description=(
            "The critic's optimizer; null (default): policy.optimizer. A section given here is a whole optimizer "
            "(its own defaults, not the policy's, fill the keys it leaves out)."
        ),
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount per token (default 1.0: no discount).")
    lambda_actor: float = Field(
        0.95, ge=0, le=1,
        description="GAE's lambda for the policy's advantages (VAPO's lambda_policy; default 0.95).",
    )
    lambda_critic: float = Field(
        1.0, ge=0, le=1,
        description=(
            "GAE's lambda for the critic's targets, returns = advantages + values (VAPO's lambda_critic; default "
            "1.0: the Monte-Carlo return, unbiased for a sparse end-of-answer reward)."
        ),
    )
    whiten_advantages: bool = Field(
        True,
        description="Scale the policy's advantages to mean 0, std 1 over the step's valid tokens (default true).",
    )
    value_clip: Optional[float] = Field(
        0.2, gt=0,
        description=(
            "Clip of the value loss: a value may move at most this far from the one the advantages were computed "
            "from before its error stops counting (PPO's clipped value loss; default 0.2); null: plain squared error."
        ),
    )
    warmup_steps: int = Field(
        0, ge=0,
        description=(
            "Steps at the start in which only the critic trains (the policy is unchanged, its rollouts still "
            "generated; verl's critic_warmup); default 0."
        ),
    )
    kl_in_reward: bool = Field(
        False,
        description=(
            "The KL to the reference model as a per-token reward, -beta * KL_t on every generated token "
            "(InstructGPT, verl), instead of a loss term (GRPO's); beta is loss_fn.reference_policy_kl_penalty, "
            "the estimator loss_fn.reference_policy_kl_type, of the trainer's logprobs (not the generation engine's) "
            "against the reference's (default false: a loss term)."
        ),
    )
