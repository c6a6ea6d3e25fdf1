"""The metric contract (`posttrain.utils.metrics`): valid counts, the reduction rule, and that every
part of posttrain uses this one definition (issue 27, item 3); the validation seed offset likewise."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.utils.metrics import (
    accumulate,
    average_over_steps,
    combine,
    per_task_means,
    reduction,
    valid_counts,
)

ROOT = Path(posttrain.__file__).parent


# ------------------------------------------------------------------------------- valid counts
def test_valid_counts_skip_position_zero_and_masked_samples():
    batch = {
        "token_mask": torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]]),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
    }
    seqs, toks = valid_counts(batch)
    # Row 0: positions 1, 2 (position 0 predicts nothing); row 1: 1, 2, 3; row 2 is masked out.
    assert (seqs.item(), toks.item()) == (2.0, 5.0)
    assert seqs.dtype == toks.dtype == torch.float64


def test_valid_counts_weight_by_a_fractional_sample_mask():
    batch = {"token_mask": torch.ones(2, 3), "sample_mask": torch.tensor([0.5, 1.0])}
    seqs, toks = valid_counts(batch)
    assert (seqs.item(), toks.item()) == (1.5, 3.0)


def test_valid_counts_of_scores_have_no_tokens():
    batch = {"token_mask": torch.ones(2, 3), "sample_mask": torch.ones(2)}
    assert [c.item() for c in valid_counts(batch, tokens=False)] == [2.0, 0.0]
    assert [c.item() for c in valid_counts({"sample_mask": torch.ones(4)})] == [4.0, 0.0]


def test_valid_counts_refuse_a_batch_they_cannot_count():
    with pytest.raises(KeyError, match="sample_mask"):
        valid_counts({"token_mask": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="token_mask has shape"):
        valid_counts({"token_mask": torch.ones(3, 3), "sample_mask": torch.ones(2)})


def test_micro_batch_counts_sum_to_the_batch_counts():
    generator = torch.Generator().manual_seed(0)
    batch = {"token_mask": (torch.rand(8, 6, generator=generator) > 0.3).float(),
             "sample_mask": (torch.rand(8, generator=generator) > 0.2).float()}
    whole = valid_counts(batch)
    parts = [valid_counts({k: v[rows] for k, v in batch.items()}) for rows in (slice(0, 3), slice(3, 8))]
    assert [sum(p[i].item() for p in parts) for i in range(2)] == [whole[0].item(), whole[1].item()]


# ------------------------------------------------------------------------------ the reduction
def test_reduction_of_min_max_and_other_names():
    assert reduction("probs_ratio_min") == "min"
    assert reduction("probs_ratio_max") == "max"
    assert reduction("loss") == reduction("num_valid_tokens") == "sum"
    assert reduction("min_length") == reduction("maximum") == "sum"  # only the suffix counts
    assert combine("x_min", 2.0, -1.0) == -1.0 and combine("x_max", 2.0, -1.0) == 2.0 and combine("x", 2.0, -1.0) == 1.0


def test_accumulate_and_average_over_steps():
    totals: dict[str, float] = {}
    accumulate(totals, {"loss": 0.25, "ratio_min": 0.9, "ratio_max": 1.1})
    accumulate(totals, {"loss": torch.tensor(0.5), "ratio_min": 0.8, "ratio_max": 1.05, "new": 3.0})
    assert totals == {"loss": 0.75, "ratio_min": 0.8, "ratio_max": 1.1, "new": 3.0}
    # A micro-batch with no valid token reports (inf, -inf) extremes: they leave the result alone.
    accumulate(totals, {"ratio_min": math.inf, "ratio_max": -math.inf})
    assert (totals["ratio_min"], totals["ratio_max"]) == (0.8, 1.1)
    assert average_over_steps(totals, 2) == {"loss": 0.375, "ratio_min": 0.8, "ratio_max": 1.1, "new": 1.5}


def test_per_task_means():
    values = torch.tensor([1.0, 0.0, 0.5, 1.0])
    assert per_task_means(values, ["a", "b", "a", "b"], "r", ["b", "a"]) == {
        "r_count/a": 2.0, "r/a": 0.75, "r_count/b": 2.0, "r/b": 0.5}
    assert per_task_means(values, ["a"] * 4, "r", ["a"]) == {}


def test_preference_validation_reduces_like_a_training_step():
    """`reduce_loss_metrics` over split batches equals the loss on the whole batch: the same counts
    and the same reduction as `PolicyWorker.train`; a reward model's counts have no tokens."""
    from posttrain.algorithms.loss import build_loss
    from posttrain.algorithms.preference import reduce_loss_metrics

    generator = torch.Generator().manual_seed(1)
    rows, width = 8, 5
    batch = {
        "token_mask": (torch.rand(rows, width, generator=generator) > 0.3).float(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
        "reference_policy_logprobs": -torch.rand(rows, width, generator=generator),
    }
    logprobs = -torch.rand(rows, width, generator=generator)
    for loss_fn, outputs in ((build_loss("dpo", beta=0.5, sft_loss_weight=0.3), logprobs),
                             (build_loss("preference"), torch.randn(rows, generator=generator))):
        seqs, toks = valid_counts(batch, tokens=loss_fn.input_type != "scores")
        _, whole = loss_fn(outputs, batch, seqs, toks)
        split = [(outputs[rows_], {k: v[rows_] for k, v in batch.items()}) for rows_ in (slice(0, 2), slice(2, 8))]
        reduced = reduce_loss_metrics(loss_fn, split)
        assert reduced.keys() == whole.keys()
        for name, value in whole.items():
            assert reduced[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


# --------------------------------------------------------------------- one definition of each
def package_sources():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT.parent).as_posix(), path.read_text()


def test_the_reduction_rule_is_written_once():
    """Only `posttrain/utils/metrics.py` decides how a `_min` / `_max` metric reduces."""
    pattern = re.compile(r"""endswith\(\s*["']_(min|max)["']""")
    elsewhere = [name for name, text in package_sources() if pattern.search(text) and name != "posttrain/utils/metrics.py"]
    assert not elsewhere, f"these files reduce _min/_max metrics themselves; use posttrain.utils.metrics: {elsewhere}"


def test_the_valid_count_formula_is_written_once():
    """Only `valid_counts` sums `token_mask[:, 1:] * sample_mask[:, None]` into a count."""
    pattern = re.compile(r"""token_mask["']\]\[:,\s*1:\][^\n]*sample_mask[^\n]*\)\.sum\(\)""")
    elsewhere = [name for name, text in package_sources() if pattern.search(text) and name != "posttrain/utils/metrics.py"]
    assert not elsewhere, f"these files count valid tokens themselves; use posttrain.utils.metrics.valid_counts: {elsewhere}"


def test_one_loss_builder():
    """`loss.build_loss` is the only function that builds a loss by name; no `make_loss` is left."""
    defined = [(name, node.name) for name, text in package_sources() for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.FunctionDef) and node.name in ("make_loss", "build_loss")]
    assert defined == [("posttrain/algorithms/loss.py", "build_loss")]


# --------------------------------------------------------------------- validation seed offset
def test_validation_seed_offset_is_defined_once():
    assigned = [name for name, text in package_sources() for node in ast.walk(ast.parse(text))
                if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "VALIDATION_SEED_OFFSET" for t in node.targets)]
    assert assigned == ["posttrain/config/schema/data.py"]


def test_validation_rows_from_the_environment_and_reasoning_gym_share_the_offset(monkeypatch):
    from posttrain.config.schema import VALIDATION_SEED_OFFSET, DataConfig, split_seed
    from posttrain.data import reasoning_gym
    from posttrain.environments import registry

    assert split_seed(5, "train") == 5 and split_seed(5, "validation") == 5 + VALIDATION_SEED_OFFSET
    with pytest.raises(ValueError, match="split"):
        split_seed(5, "test")

    env_seeds = []

    class Rows:
        @staticmethod
        def make_rows(cfg, count, seed):
            env_seeds.append(seed)
            return [{"prompt": "p", "answer": "a"}] * count

    monkeypatch.setattr(registry, "resolve_env", lambda name, section: (Rows, None))
    data_cfg = DataConfig(dataset="env", env_name="anything", seed=7, num_train=2, num_validation=1)
    env_rows = registry.env_rows_maker(None)
    env_rows(data_cfg, "train")
    env_rows(data_cfg, "validation")

    gym_seeds = []

    class Entries:
        def __init__(self, size):
            self.size = size

        def __getitem__(self, i):
            return {"question": f"q{i}", "answer": "1", "metadata": {}}

    def make_dataset(name, config, seed, size, key="data.reasoning_gym"):
        gym_seeds.append(seed)
        return Entries(size)

    monkeypatch.setattr(reasoning_gym, "make_dataset", make_dataset)
    gym_cfg = DataConfig(dataset="reasoning_gym", seed=7, reasoning_gym=[{"name": "chain_sum", "size": 2, "val_size": 1}])
    reasoning_gym.load_reasoning_gym(gym_cfg, "validation")  # validation, then train to drop repeats
    assert env_seeds == [7, 7 + VALIDATION_SEED_OFFSET]
    assert gym_seeds == [7 + VALIDATION_SEED_OFFSET, 7]
