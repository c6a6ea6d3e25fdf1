"""Per-phase memory in GRPO's step metrics, and `policy.offload_during_generation` on CPU (a
documented no-op: the policy already lives in host memory), with the local backend and the tiny
model for three steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.loader import load_config

pytestmark = pytest.mark.functional

SMALL = [
    "sft_warmup=null", "cluster.backend=local",
    "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=3",
    "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.max_val_samples=8",
    "policy.model_name=tiny", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=8", "policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6",
    "loss_fn.reference_policy_kl_penalty=0.01",  # a logprobs phase (reference logprobs) every step
    "data.num_train=64", "data.num_validation=8", "checkpointing.enabled=false",
    "logger.progress_bar=false", "logger.report=false", "logger.tensorboard_enabled=false",
]
PHASES = ("generation", "refit", "logprobs", "training")


def run_grpo(log_dir: Path, *extra: str) -> dict[int, dict]:
    from posttrain.algorithms import grpo

    ctx = grpo.setup(load_config("grpo", overrides=[*SMALL, f"logger.log_dir={log_dir}", *extra]))
    try:
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    steps: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    return steps


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return run_grpo(tmp_path_factory.mktemp("default"))


def test_each_phase_logs_its_peak_resident_set_on_cpu(default_run):
    assert sorted(default_run) == [1, 2, 3]
    for step, row in default_run.items():
        # Step 1 has no refit: generation and policy both start from policy.model_name.
        phases = PHASES if step > 1 else tuple(p for p in PHASES if p != "refit")
        for phase in phases:
            assert row[f"memory/{phase}/peak_rss_gb"] > 0, (step, phase)
        assert not [k for k in row if k.endswith(("allocated_gb", "reserved_gb"))]  # CUDA only
        assert "memory/offload/moved_gb" not in row  # nothing offloaded on CPU


def test_offload_during_generation_is_a_noted_no_op_on_cpu(default_run, tmp_path, capfd):
    offloaded = run_grpo(tmp_path, "policy.offload_during_generation=true")
    out = capfd.readouterr().out
    assert "policy.offload_during_generation=true: nothing to move" in out
    for step in default_run:
        train = {k: v for k, v in default_run[step].items() if k.startswith("train/")}
        assert train == {k: v for k, v in offloaded[step].items() if k.startswith("train/")}, step
        assert "memory/offload/moved_gb" not in offloaded[step]
