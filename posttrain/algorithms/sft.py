"""Supervised fine-tuning: next-token NLL on the assistant turns of prompt/answer data.

Also the warm start of the embedded GRPO default (`posttrain grpo` with no arguments).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from posttrain.algorithms.common import (
    make_cluster,
    prefixed,
    prepare_run_dirs,
    restore_training_state,
    save_training_state,
    set_seed,
    start_ray,
    with_schedule_horizon,
)
from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import SFTMasterConfig
from posttrain.data.dataloader import ResumableLoader
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.logger import Logger, ProgressBar
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
    from posttrain.data.datasets import load_records
    from posttrain.data.processors import build_sft_example
    from posttrain.models.hf import load_tokenizer
    from posttrain.models.policy.policy import Policy

    s = cfg.sft
    set_seed(s.seed)
    cfg = with_schedule_horizon(cfg, s.max_num_steps)
    prepare_run_dirs(cfg)
    start_ray(cfg)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    max_len = cfg.policy.max_total_sequence_length

    def to_datums(records):
        return [
            build_sft_example(r, tokenizer, max_len, use_chat_template=cfg.data.use_chat_template,
                              system_prompt=cfg.data.system_prompt, idx=i)
            for i, r in enumerate(records)
        ]

    train = to_datums(load_records(cfg.data, "train"))
    val = to_datums(load_records(cfg.data, "validation"))[: s.max_val_samples]
    loader = ResumableLoader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=s.seed)
    cluster = make_cluster(cfg, cfg.policy.num_workers)
    policy = Policy(cluster, cfg.policy, init_reference_model=False)
    logger = Logger(cfg.logger)
    checkpointer = CheckpointManager(cfg.checkpointing)
    loss_fn = NLLLoss()
    pad = tokenizer.pad_token_id

    try:
        step = 0
        if cfg.checkpointing.enabled:
            info = restore_training_state(checkpointer, policy, loader, logger)
            step = int(info["step"]) if info else 0
        if step == 0 and s.val_at_start:
            logger.log_metrics({"validation/loss": validation_loss(policy, val, pad, s.val_batch_size)}, 0)

        bar = ProgressBar(total=s.max_num_steps, initial=step, enabled=cfg.logger.progress_bar, desc="SFT")
        metrics: dict[str, float] = {}
        while step < s.max_num_steps:
            step += 1
            timer = Timer()
            with timer.time("total_step_time"):
                batch = to_train_batch(loader.next_batch(), pad)
                with timer.time("policy_training"):
                    train_metrics = policy.train(batch, loss_fn)
            metrics = prefixed(train_metrics, "train")
            metrics.update(prefixed(timer.get_timing_metrics(), "timing/train"))
            if (s.val_period > 0 and step % s.val_period == 0) or (s.val_at_end and step == s.max_num_steps):
                metrics["validation/loss"] = validation_loss(policy, val, pad, s.val_batch_size)
            logger.log_metrics(metrics, step)
            ck = cfg.checkpointing
            if ck.enabled and (step % ck.save_period == 0 or step == s.max_num_steps):
                ranking = {k: v for k, v in metrics.items() if k == "validation/loss"}
                save_training_state(checkpointer, policy, loader, step, ranking)
            bar.update(metrics)
        bar.close()
        if export_dir is not None:
            export_dir = Path(export_dir)
            tmp = export_dir.with_name(export_dir.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
            policy.export_hf(tmp)
            tmp.rename(export_dir)  # atomic: a half-written export is never reused
        return metrics
    finally:
        policy.shutdown()
        cluster.shutdown()
        logger.close()
