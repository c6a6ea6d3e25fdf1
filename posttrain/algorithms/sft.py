"""Supervised fine-tuning: next-token NLL on the assistant turns of prompt/answer data.

Also the warm start of the embedded GRPO default (`posttrain grpo` with no arguments).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from posttrain.algorithms.common import build_datums, export_hf_atomic, make_cluster, start_run, train_offline
from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import SFTMasterConfig
from posttrain.data.dataloader import ResumableLoader
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.sft")


def to_train_batch(datums: list[dict], pad_token_id: int) -> Batch:
    """Flatten SFT datums; only the assistant (answer) tokens carry loss."""
    batch = flatten_message_logs([d["message_log"] for d in datums], pad_token_id=pad_token_id)
    batch["sample_mask"] = torch.tensor([float(d.get("loss_multiplier", 1.0)) for d in datums])
    return batch


def validation_loss(policy, datums: list[dict], pad_token_id: int, batch_size: int) -> float:
    """Token-mean NLL of the answers, from the policy's logprobs (no training step)."""
    total, count = 0.0, 0.0
    for start in range(0, len(datums), batch_size):
        batch = to_train_batch(datums[start : start + batch_size], pad_token_id)
        logprobs = policy.get_logprobs(batch)["logprobs"]
        mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        total += -(logprobs[:, 1:] * mask).sum().item()
        count += mask.sum().item()
    return total / max(count, 1.0)


def run(cfg: SFTMasterConfig, export_dir: Optional[Path] = None) -> dict[str, float]:
    """Train with NLL for `sft.max_num_steps` steps; optionally export HF weights at the end."""
    from posttrain.data.processors import build_sft_example
    from posttrain.models.policy.policy import Policy

    s = cfg.sft
    cfg, tokenizer = start_run(cfg, seed=s.seed, max_num_steps=s.max_num_steps)
    train = build_datums(cfg, build_sft_example, tokenizer, "train")
    val = build_datums(cfg, build_sft_example, tokenizer, "validation", s.max_val_samples)
    loader = ResumableLoader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=s.seed)
    cluster = make_cluster(cfg, cfg.policy.num_workers)
    policy = Policy(cluster, cfg.policy, init_reference_model=False)
    loss_fn = NLLLoss()
    pad = tokenizer.pad_token_id

    def train_step(datums: list[dict], timer: Timer) -> dict[str, float]:
        batch = to_train_batch(datums, pad)
        with timer.time("policy_training"):
            return policy.train(batch, loss_fn)

    def validate() -> dict[str, float]:
        return {"validation/loss": validation_loss(policy, val, pad, s.val_batch_size)}

    try:
        metrics = train_offline(cfg, s, policy, loader, train_step, validate, desc="SFT")
        if export_dir is not None:
            export_hf_atomic(policy, export_dir)
        return metrics
    finally:
        policy.shutdown()
        cluster.shutdown()
