"""Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290): `posttrain dpo`.

The policy learns from preference pairs directly, with a frozen copy of its initial weights as
the reference: per pair, `-log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))` with
`beta = dpo.reference_policy_kl_penalty` (`DPOLoss`; optional RPO-style NLL on the chosen
response with `dpo.sft_loss_weight`).

Batch size: each step trains on `policy.train_global_batch_size` **rows**, i.e. half as many
preference pairs (rows interleave chosen and rejected, `[c0, r0, c1, r1, ...]`).

Metrics: `train/loss`, `train/preference_loss`, `train/sft_loss`, `train/accuracy` (implicit
reward of chosen > rejected; a tie counts half), `train/reward_margin`, `train/rewards_chosen_mean`,
`train/rewards_rejected_mean` (log-ratio sums, no beta), and the same under `validation/`,
computed with the same loss on validation pairs without a training step. At step 0 the policy
is the reference, so every implicit reward is 0: the loss is log 2 and the accuracy 0.5 (all ties).
"""

from __future__ import annotations

import logging

from posttrain.algorithms.loop import train_offline
from posttrain.algorithms.loss import build_loss
from posttrain.algorithms.preference import reduce_loss_metrics, start_pair_run
from posttrain.config.schema import DPOMasterConfig
from posttrain.distributed.batch import Batch
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.dpo")


def run(cfg: DPOMasterConfig) -> dict[str, float]:
    """Train with DPO for `dpo.max_num_steps` steps; returns the last step's metrics."""
    from posttrain.data.preference import flatten_preference_pairs

    d = cfg.dpo
    job = start_pair_run(cfg, d, init_reference_model=True)
    cfg, policy, pad = job.cfg, job.policy, job.pad_token_id
    loss_fn = build_loss(
        "dpo", beta=d.reference_policy_kl_penalty, preference_average_log_probs=d.preference_average_log_probs,
        sft_loss_weight=d.sft_loss_weight, preference_loss_weight=d.preference_loss_weight,
    )

    def with_reference(batch: Batch) -> Batch:
        batch["reference_policy_logprobs"] = policy.get_reference_logprobs(batch)["logprobs"]
        return batch

    # The reference never changes: score the validation pairs with it once.
    val_batches = [with_reference(b) for b in job.val_batches]

    def train_step(datums: list[dict], timer: Timer) -> dict[str, float]:
        batch = flatten_preference_pairs(datums, pad)
        with timer.time("logprobs"):
            with_reference(batch)
        with timer.time("policy_training"):
            return policy.train(batch, loss_fn)

    def validate() -> dict[str, float]:
        if not val_batches:
            return {}
        scored = [(policy.get_logprobs(b)["logprobs"], b) for b in val_batches]
        return {f"validation/{k}": v for k, v in reduce_loss_metrics(loss_fn, scored).items()}

    try:
        return train_offline(cfg, d, name="DPO", section="dpo", policy=policy, loader=job.loader,
                             train_step=train_step, validate=validate)
    finally:
        job.shutdown()

