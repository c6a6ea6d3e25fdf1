"""`posttrain dpo` and `posttrain rm` end to end on the tiny model (real Ray workers, in-process)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.algorithms import dpo, rm
from posttrain.config.loader import load_config
from posttrain.utils.logger import read_metrics_jsonl

pytestmark = pytest.mark.functional

COMMON = [
    "data.num_train=1000",
    "logger.progress_bar=false",
    "logger.report=false",
    "logger.tensorboard_enabled=false",
    "checkpointing.save_period=10",
]


def config(algo: str, tmp_path: Path, *extra: str):
    """20 steps of 32 pairs, validation on 64 pairs at steps 0, 10 and 20, checkpoints at 10 and 20."""
    return load_config(algo, overrides=[
        *COMMON,
        f"{algo}.max_num_steps=20",
        f"{algo}.val_period=10",
        f"{algo}.val_at_start=true",
        f"{algo}.max_val_samples=64",
        f"logger.log_dir={tmp_path}/logs",
        f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        *extra,
    ])


def test_dpo_learns_checkpoints_and_resumes(ray_cluster, tmp_path):
    dpo.run(config("dpo", tmp_path))
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    # Step 0 / step 1: the policy is its reference, every implicit reward is 0 -> loss log 2,
    # accuracy 0.5 (every pair a tie, and a tie counts half).
    assert metrics[0]["validation/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics[0]["validation/accuracy"] == 0.5
    assert metrics[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics[1]["train/reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert metrics[1]["train/num_valid_samples"] == 32  # 64 rows = 32 pairs per step
    # Easy pairs (last digit dropped or repeated): well above chance on unseen problems.
    print(f"DPO validation accuracy at step 20: {metrics[20]['validation/accuracy']:.3f}")
    assert metrics[20]["validation/accuracy"] > 0.65
    assert metrics[20]["validation/loss"] < math.log(2)
    assert metrics[20]["validation/reward_margin"] > 0
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_10", "step_20"]
    assert (tmp_path / "logs" / "config.yaml").exists()

    # Rerun with a longer horizon: resumes from step 20, keeps the logged history.
    dpo.run(config("dpo", tmp_path, "dpo.max_num_steps=22"))
    resumed = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(resumed) == list(range(23))
    assert resumed[20]["validation/accuracy"] == metrics[20]["validation/accuracy"]
    assert "validation/accuracy" in resumed[22] and "train/loss" in resumed[21]


def test_reward_model_learns_and_exports(ray_cluster, tmp_path):
    export = tmp_path / "rm_hf"
    rm.run(config("rm", tmp_path, f"rm.export_dir={export}"))
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    start, end = metrics[0]["validation/accuracy"], metrics[20]["validation/accuracy"]
    print(f"RM validation accuracy {start:.3f} -> {end:.3f}")
    assert end > 0.7 and end > start + 0.1
    assert metrics[20]["validation/loss"] < metrics[0]["validation/loss"]
    assert metrics[20]["validation/num_valid_samples"] == 64
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_10", "step_20"]
    hf_config = json.loads((export / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForSequenceClassification"]
    assert len(hf_config["id2label"]) == 1  # one scalar score
