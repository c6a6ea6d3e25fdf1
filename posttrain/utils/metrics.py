"""The metric contract: how training and evaluation count, reduce and split their metrics.

Every rule here has one definition; the losses (`posttrain.algorithms.loss`, `preference_loss`,
`distill_loss`), the policy workers that run them (`posttrain.models.policy.worker`), the
preference trainers' validation (`posttrain.algorithms.preference`), GRPO's experience and
evaluation (`posttrain.evals.eval`) all use them, so a metric means the same wherever it is logged.

- **Valid counts** (`valid_counts`): a loss is divided by the *global* number of valid sequences,
  `sum(sample_mask)`, and of valid tokens, `sum(token_mask[:, 1:] * sample_mask[:, None])` (position
  0 is the first prompt token: nothing predicts it), summed over every micro-batch and
  data-parallel rank of one optimizer step. Each micro-batch's loss and metrics are then its share
  of the full-batch value, and the shares **sum** to it.
- **Reduction** (`reduction`, `accumulate`): a metric whose name ends in `_min` is reduced over
  micro-batches and ranks by `min`, `_max` by `max`, every other one by a sum. Over the optimizer
  steps of one `train` call the sums are averaged and the extremes kept (`average_over_steps`).
- **Per task** (`per_task_means`): a run with several tasks also logs each task's mean and count;
  response lengths (`response_lengths`) are generated tokens, whatever the environment added.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, MutableMapping, Sequence

import torch

Reduction = Literal["min", "max", "sum"]

# The value a reduction starts from: what a rank or micro-batch without the metric contributes.
NEUTRAL: dict[Reduction, float] = {"min": math.inf, "max": -math.inf, "sum": 0.0}


def valid_counts(batch: Mapping[str, Any], tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(valid_seqs, valid_toks)` of the rows of `batch`, as float64 scalars: `sum(sample_mask)` and
    `sum(token_mask[:, 1:] * sample_mask[:, None])`. With `tokens=False` (a loss on one score per
    sequence, which has no per-token mask) or a batch without `token_mask`, `valid_toks` is 0.

    These are one part's counts: a trainer sums them over all the rows of an optimizer step (every
    micro-batch and data-parallel rank) before it hands them to the loss."""
    if "sample_mask" not in batch:
        raise KeyError(f"valid_counts: the batch has no 'sample_mask'; it has {sorted(batch)}")
    sample_mask = torch.as_tensor(batch["sample_mask"]).double()
    if tokens and "token_mask" in batch:
        token_mask = torch.as_tensor(batch["token_mask"])
        if token_mask.ndim != 2 or token_mask.shape[0] != sample_mask.shape[0]:
            raise ValueError(f"valid_counts: token_mask has shape {tuple(token_mask.shape)}, expected "
                             f"[{sample_mask.shape[0]}, S] like sample_mask {tuple(sample_mask.shape)}")
        valid_toks = (token_mask[:, 1:].double() * sample_mask[:, None]).sum()
    else:
        valid_toks = torch.zeros((), dtype=torch.float64)
    return sample_mask.sum(), valid_toks


def reduction(name: str) -> Reduction:
    """How the metric `name` combines over micro-batches, ranks and batches: `_min` -> min,
    `_max` -> max, anything else -> sum."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum"


def combine(name: str, a: float, b: float) -> float:
    """Two values of the metric `name` reduced to one by its `reduction`."""
    op = reduction(name)
    return min(a, b) if op == "min" else max(a, b) if op == "max" else a + b


def accumulate(totals: MutableMapping[str, float], metrics: Mapping[str, Any]) -> MutableMapping[str, float]:
    """Fold one micro-batch's (or batch's) `metrics` into `totals` in place by the reduction rule;
    returns `totals`. Values may be floats or one-element tensors."""
    for name, value in metrics.items():
        value = float(value)
        totals[name] = combine(name, totals[name], value) if name in totals else value
    return totals


def average_over_steps(totals: Mapping[str, float], num_steps: int) -> dict[str, float]:
    """The metrics of one `train` call of `num_steps` optimizer steps: each step's sum averaged over
    the steps, a `_min` / `_max` kept as the extreme over all of them."""
    return {name: value if reduction(name) != "sum" else value / num_steps for name, value in totals.items()}


def response_lengths(samples: Sequence[Any]) -> torch.Tensor:
    """Generated tokens per sample (`posttrain.data.sample.Sample`: all assistant turns, the
    messages with `generation_logprobs`), as floats."""
    return torch.tensor(
        [sum(len(m["token_ids"]) for m in s.message_log if "generation_logprobs" in m) for s in samples],
        dtype=torch.float,
    )


def per_task_means(values: torch.Tensor, task_names: Sequence[str], name: str, tasks: Sequence[str]) -> dict[str, float]:
    """For a run with several `tasks` (environments): `{name}_count/{task}`, the number of samples
    of each task, and `{name}/{task}`, their mean (absent when a batch has none of that task). A
    single-task run has only the overall metric."""
    if len(tasks) < 2:
        return {}
    metrics = {}
    for task in sorted(tasks):
        index = [i for i, t in enumerate(task_names) if t == task]
        metrics[f"{name}_count/{task}"] = float(len(index))
        if index:
            metrics[f"{name}/{task}"] = values[torch.tensor(index)].float().mean().item()
    return metrics
