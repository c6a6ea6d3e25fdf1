"""Supervised fine-tuning: next-token NLL on the assistant turns of prompt/answer data.

Also the warm start of the embedded GRPO default (`posttrain grpo` with no arguments).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

import torch

from posttrain.algorithms.loop import train_offline
from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import SFTMasterConfig
from posttrain.data.dataloader import make_loader
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.job import build_splits, make_cluster, make_policy, start_run, workers_description
from posttrain.utils import startup
from posttrain.utils.metric_names import ACCURACY_GREEDY
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.sft")


def to_train_batch(datums: list[dict], pad_token_id: int) -> Batch:
    """Flatten SFT datums; only the assistant (answer) tokens carry loss."""
    batch = flatten_message_logs([d["message_log"] for d in datums], pad_token_id=pad_token_id)
    batch["sample_mask"] = torch.tensor([float(d.get("loss_multiplier", 1.0)) for d in datums])
    return batch


def validation_metrics(policy, datums: list[dict], pad_token_id: int, batch_size: int) -> dict[str, float]:
    """Token-mean NLL of the answers (`validation/loss`) and the fraction answered exactly by
    greedy decoding (`validation/accuracy_greedy`).

    Accuracy needs no generation: greedy decoding reproduces an answer exactly iff every answer
    token is the argmax given the true prefix (by induction over the answer's tokens). The
    logprobs at a near-zero temperature show that: the argmax token gets probability ~1, any
    other token ~0, so "log p > log 1/2 at every answer token" is the greedy exact-match test.
    Empty dict without validation data.
    """
    if not datums:
        return {}
    nll, tokens, exact = 0.0, 0.0, 0.0
    for start in range(0, len(datums), batch_size):
        batch = to_train_batch(datums[start : start + batch_size], pad_token_id)
        mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        logprobs = policy.get_logprobs(batch)["logprobs"][:, 1:]
        nll += -(logprobs * mask).sum().item()
        tokens += mask.sum().item()
        near_greedy = policy.get_logprobs(batch, temperature=GREEDY_TEMPERATURE)["logprobs"][:, 1:]
        missed = ((near_greedy <= -math.log(2)).float() * mask).sum(dim=-1)
        exact += ((missed == 0) & (mask.sum(dim=-1) > 0)).sum().item()
    return {"validation/loss": nll / max(tokens, 1.0), ACCURACY_GREEDY: exact / len(datums)}


# Dividing logits by this makes the argmax token's probability ~1 unless another logit is within
# ~1e-4 * log(vocab) of it (float32 logits up to ~1e4 / 1e-4 = 1e8 are still finite).
GREEDY_TEMPERATURE = 1e-4


def run(cfg: SFTMasterConfig, export_dir: Optional[Path] = None) -> dict[str, float]:
    """Train with NLL for `sft.max_num_steps` steps; export HF weights to `export_dir` (default
    `sft.export_dir`) at the end when set; print a summary and write report.png. Returns the
    last step's metrics."""
    from posttrain.data.processors import build_sft_example

    s = cfg.sft
    export_dir = export_dir if export_dir is not None else s.export_dir
    cfg, tokenizer = start_run(cfg, seed=s.seed, max_num_steps=s.max_num_steps)
    train, val = build_splits(cfg, build_sft_example, tokenizer, s.max_val_samples)
    loader = make_loader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=s.seed)
    with startup.phase("workers", workers_description(cfg)):
        cluster = make_cluster(cfg, cfg.policy.num_workers)
        policy = make_policy(cfg, cluster)
    loss_fn = NLLLoss()
    pad = tokenizer.pad_token_id

    def train_step(datums: list[dict], timer: Timer) -> dict[str, float]:
        batch = to_train_batch(datums, pad)
        with timer.time("policy_training"):
            return policy.train(batch, loss_fn)

    def validate() -> dict[str, float]:
        return validation_metrics(policy, val, pad, s.val_batch_size)

    try:
        metrics = train_offline(cfg, s, name="SFT", section="sft", policy=policy, loader=loader,
                                train_step=train_step, validate=validate)
        if export_dir is not None:
            with startup.doing(f"exporting the model to {export_dir}"):
                policy.export_hf(export_dir)
            print(f"[posttrain] SFT model exported to {export_dir}", flush=True)
    finally:
        from posttrain.utils.run_dirs import release_run_dirs

        policy.shutdown()
        cluster.shutdown()
        release_run_dirs(cfg)
    return metrics
