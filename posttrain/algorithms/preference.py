"""What the preference-pair trainers (DPO, reward models) share: their set-up (pair data, loader,
one policy group) and the validation of a pairwise loss over several batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.job import build_splits, make_cluster, make_policy, start_run, workers_description
from posttrain.utils import startup
from posttrain.utils.metrics import accumulate, valid_counts


@dataclass
class PairRun:
    """What DPO and reward-model training set up alike (see `start_pair_run`)."""

    cfg: Any
    pad_token_id: int
    loader: Any  # ResumableLoader of pair datums, train_global_batch_size / 2 pairs per step
    cluster: Any
    policy: Any
    val_batches: list  # validation pairs as flattened Batches of `val_batch_size` pairs

    def shutdown(self) -> None:
        from posttrain.utils.run_dirs import release_run_dirs

        self.policy.shutdown()
        self.cluster.shutdown()
        release_run_dirs(self.cfg)


def start_pair_run(cfg, section, *, model_type: str = "lm", init_reference_model: bool = False) -> PairRun:
    """Prologue of the preference-pair jobs: Ray, pair data (rows interleave chosen and rejected),
    loader, one policy group. `section` is `cfg.dpo` or `cfg.rm` (seed, steps, validation sizes)."""
    from posttrain.data.dataloader import ResumableLoader
    from posttrain.data.preference import build_preference_example, load_preference_records, pair_batches

    cfg, tokenizer = start_run(cfg, seed=section.seed, max_num_steps=section.max_num_steps)
    pad = tokenizer.pad_token_id
    train, val = build_splits(cfg, build_preference_example, tokenizer, section.max_val_samples,
                              load=load_preference_records)
    loader = ResumableLoader(
        train, cfg.policy.train_global_batch_size // 2, shuffle=cfg.data.shuffle, seed=section.seed
    )
    with startup.phase("workers", workers_description(cfg, reference=init_reference_model)):
        cluster = make_cluster(cfg, cfg.policy.num_workers)
        policy = make_policy(cfg, cluster, init_reference_model=init_reference_model, model_type=model_type)
    return PairRun(cfg, pad, loader, cluster, policy, pair_batches(val, section.val_batch_size, pad))


def reduce_loss_metrics(loss_fn, outputs_and_batches: list[tuple[torch.Tensor, Any]]) -> dict[str, float]:
    """The loss's metrics over several batches, as one training step over all of them would report.

    The loss divides by the global counts it is given, so each batch gets the totals over all
    batches and the per-batch metrics are reduced by the rule the policy workers apply to
    micro-batches (both from `posttrain.utils.metrics`: sums, `_min` / `_max` names min / max).
    """
    tokens = getattr(loss_fn, "input_type", "logprobs") != "scores"  # as `PolicyWorker.train` counts
    counts = [valid_counts(batch, tokens=tokens) for _, batch in outputs_and_batches]
    seqs = sum(float(s) for s, _ in counts)
    toks = sum(float(t) for _, t in counts)
    totals: dict[str, float] = {}
    for outputs, batch in outputs_and_batches:
        _, metrics = loss_fn(outputs, batch, torch.tensor(seqs), torch.tensor(toks))
        accumulate(totals, metrics)
    return totals
