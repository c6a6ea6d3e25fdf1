"""The names of the validation accuracies, in one place.

A generated answer's accuracy depends on how it was decoded, so the name says which:
`validation/accuracy_greedy` (greedy decoding: GRPO's and distillation's validation with one
sample per prompt and no `policy.generation.val_temperature`, `posttrain eval` likewise, SFT's
teacher-forced exact match, which is what greedy decoding would produce) and
`validation/accuracy_sampled` (the mean reward of every sample drawn at the validation
temperature, i.e. pass@1, when several samples per prompt or a `val_temperature` are asked for).
`validation/accuracy` is DPO's and RM's preference accuracy (chosen scored above rejected, ties
count half); as a `checkpointing.metric_name` it also stands for the run's accuracy, whichever
of the names above the run logs. A named validation set (`data.validation_sets`) logs the same
metrics under `validation_<name>/` (`validation_unseen_phrasing/accuracy_greedy/<task>`).
"""

from __future__ import annotations

from typing import Mapping, Optional

ACCURACY_GREEDY = "validation/accuracy_greedy"
ACCURACY_SAMPLED = "validation/accuracy_sampled"
ACCURACY = "validation/accuracy"  # DPO/RM preference accuracy; the alias of the two above
ACCURACY_NAMES = (ACCURACY_GREEDY, ACCURACY_SAMPLED, ACCURACY)


def accuracy_name(greedy: bool) -> str:
    """The name of a generation accuracy measured greedily or by sampling."""
    return ACCURACY_GREEDY if greedy else ACCURACY_SAMPLED


def find_accuracy(metrics: Mapping[str, float]) -> Optional[str]:
    """The accuracy among `metrics` (the first of `ACCURACY_NAMES` present), or None."""
    return next((name for name in ACCURACY_NAMES if name in metrics), None)


def metric_value(metrics: Mapping[str, float], name: str) -> Optional[float]:
    """`metrics[name]`; for `validation/accuracy`, absent, whichever accuracy `metrics` has."""
    if name in metrics:
        return metrics[name]
    if name == ACCURACY:
        found = find_accuracy(metrics)
        return metrics[found] if found is not None else None
    return None


def in_validation_set(metrics: Mapping[str, float], name: str) -> dict[str, float]:
    """`metrics` of the validation set `name` (`data.validation_sets`): `validation/...` becomes
    `validation_<name>/...`."""
    return {f"validation_{name}/{key.removeprefix('validation/')}": value for key, value in metrics.items()}
