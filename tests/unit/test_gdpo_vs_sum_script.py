"""`benchmarks/gdpo_vs_sum.py`: how it summarises seeds and pairs each variant with summed rewards."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gdpo_vs_sum_script", REPO / "benchmarks" / "gdpo_vs_sum.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gdpo_vs_sum_script"] = module
    spec.loader.exec_module(module)
    return module


def test_summary_is_mean_sample_sd_min_max(bench):
    assert bench.summary([0.5, 0.25, 0.0]) == "0.250 +- 0.250 [0.000, 0.500]"
    assert bench.summary([0.125]) == "0.125 +- 0.000 [0.125, 0.125]"


def test_table_pairs_each_variant_with_grpo_by_seed(bench):
    results = {
        "grpo": [{"first_digit after": 0.5}, {"first_digit after": 0.0}],
        "gdpo": [{"first_digit after": 0.25}, {"first_digit after": 0.5}],
    }
    # differences by seed: -0.25 and +0.5 (not the difference of the means' spreads)
    assert bench.table(results) == [("first_digit after", [
        "0.250 +- 0.354 [0.000, 0.500]", "0.375 +- 0.177 [0.250, 0.500]", "0.125 +- 0.530 [-0.250, 0.500]"])]


def test_table_without_grpo_has_no_differences(bench):
    assert bench.table({"gdpo": [{"exact after": 1.0}]}) == [("exact after", ["1.000 +- 0.000 [1.000, 1.000]"])]


def test_the_rare_tasks_rewards(bench):
    # correct: the completion's last number, as the math environment's last_number format reads it.
    assert bench.correct(["12+34="] * 4, ["46", "so 45, no: 46", "46 or 45", ""], ["46"] * 4) == [1.0, 1.0, 0.0, 0.0]
    # judge: 0 or 1, the same for the same text, blind to correctness (about half of 400 texts score 1).
    prompts, completions = [f"{a}+1=" for a in range(400)], [str(a + 1) for a in range(400)]
    scores = bench.judge(prompts, completions)
    assert set(scores) == {0.0, 1.0} and scores == bench.judge(prompts, completions)
    assert 150 < sum(scores) < 250
    assert bench.VARIANTS["grpo-correct-only"] == ({"grpo.adv_estimator.name": "grpo"}, 0.0)
