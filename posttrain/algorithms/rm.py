"""Reward-model training with the Bradley-Terry pairwise loss: `posttrain rm`.

A sequence classifier with one output (the policy's `model_type="reward"`: the language model's
body plus a fresh scalar head, scored at each row's last token) learns
`-log sigmoid(s_chosen - s_rejected)` on preference pairs (Bradley & Terry 1952; Ouyang et al.
2022, "Training language models to follow instructions with human feedback", arXiv:2203.02155,
step 2). The trained model can be exported to Hugging Face format (`rm.export_dir`) for use as
a learned reward.

Batch size: each step trains on `policy.train_global_batch_size` **rows**, i.e. half as many
preference pairs (rows interleave chosen and rejected, `[c0, r0, c1, r1, ...]`).

Metrics: `train/loss`, `train/accuracy` (s_chosen > s_rejected, a tie counting half), `train/reward_margin`,
`train/rewards_chosen_mean`, `train/rewards_rejected_mean`, and the same under `validation/`
(scores from `get_scores` on the validation pairs, no training step).
"""

from __future__ import annotations

import logging

from posttrain.algorithms.loop import train_offline
from posttrain.algorithms.loss import build_loss
from posttrain.algorithms.preference import reduce_loss_metrics, start_pair_run
from posttrain.config.schema import RMMasterConfig
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.rm")


def run(cfg: RMMasterConfig) -> dict[str, float]:
    """Train a reward model for `rm.max_num_steps` steps; export it to `rm.export_dir` when set."""
    from posttrain.data.preference import flatten_preference_pairs

    r = cfg.rm
    job = start_pair_run(cfg, r, model_type="reward")
    cfg, policy, pad, val_batches = job.cfg, job.policy, job.pad_token_id, job.val_batches
    loss_fn = build_loss("preference")

    def train_step(datums: list[dict], timer: Timer) -> dict[str, float]:
        batch = flatten_preference_pairs(datums, pad)
        with timer.time("policy_training"):
            return policy.train(batch, loss_fn)

    def validate() -> dict[str, float]:
        if not val_batches:
            return {}
        scored = [(policy.get_scores(b)["scores"], b) for b in val_batches]
        return {f"validation/{k}": v for k, v in reduce_loss_metrics(loss_fn, scored).items()}

    try:
        metrics = train_offline(cfg, r, name="RM", section="rm", policy=policy, loader=job.loader,
                                train_step=train_step, validate=validate)
        if r.export_dir is not None:
            policy.export_hf(r.export_dir)
            print(f"[posttrain] reward model exported to {r.export_dir}", flush=True)
        return metrics
    finally:
        job.shutdown()
