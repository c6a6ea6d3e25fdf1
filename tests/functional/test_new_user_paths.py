"""The paths a new user takes, run as they would run them: the `posttrain` command in their own
directory (not the repository), relative paths, no validation set, a checkpoint as the model,
SFT with an export, eval of a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]

SMALL_GRPO = [
    "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
    "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
    "policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6",
    "logger.progress_bar=false", "logger.tensorboard_enabled=false", "checkpointing.save_period=1",
    # A 2-step warm start that validates: it must log under <logger.log_dir>/sft_warmup.
    "sft_warmup.sft.max_num_steps=2", "sft_warmup.sft.val_period=1", "sft_warmup.sft.max_val_samples=8",
    "sft_warmup.data.num_train=32", "sft_warmup.data.num_validation=8",
    "sft_warmup.policy.train_global_batch_size=8", "sft_warmup.policy.train_micro_batch_size=8",
    "sft_warmup.policy.max_total_sequence_length=32",
]


def posttrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "POSTTRAIN_CACHE": str(cwd / "cache")},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# `posttrain` in a subprocess that reports, after it returns, which of the libraries a backend or a
# worker needs were imported: none, when the command ended before preflight's slow parts.
REPORT_IMPORTS = """
import sys
from posttrain.cli import main
code = main(sys.argv[1:])
print("imported:", sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules))
sys.exit(code)
"""


def posttrain_reporting_imports(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", REPORT_IMPORTS, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "POSTTRAIN_CACHE": str(cwd / "cache")},
    )


def files_of(*directories: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for d in directories for p in sorted(d.rglob("*"))}


def test_grpo_without_validation_in_the_users_directory_then_checkpoint_as_model(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(6) for b in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = posttrain("grpo", *SMALL_GRPO, "data.dataset=jsonl", "data.train_path=train.jsonl",
                      "logger.log_dir=logs/a", "checkpointing.checkpoint_dir=ckpt/a", cwd=tmp_path)
    assert "running without validation" in first.stdout
    assert "GRPO finished at step 2" in first.stdout and ": no validation;" in first.stdout
    assert not any(k.startswith("validation/") for row in metrics(tmp_path / "logs/a/metrics.jsonl") for k in row)
    assert (tmp_path / "ckpt/a/step_2/training_info.json").is_file()  # relative to the user's directory
    warm = metrics(tmp_path / "logs/a/sft_warmup/metrics.jsonl")  # the warm start follows logger.log_dir
    assert [row["step"] for row in warm if "validation/accuracy_greedy" in row] == [1, 2]

    # A step_N checkpoint is a model for GRPO (and eval) too; arithmetic data has validation.
    second = posttrain("grpo", *SMALL_GRPO, "sft_warmup=null", "policy.model_name=ckpt/a/step_2",
                       "grpo.max_val_samples=8", "data.num_validation=8", "data.num_train=32",
                       "logger.log_dir=logs/b", "checkpointing.enabled=false", cwd=tmp_path)
    assert "policy.model_name: checkpoint ckpt/a/step_2 as Hugging Face model" in second.stdout
    assert "percentage points" in second.stdout

    evaluated = posttrain("eval", "policy.model_name=ckpt/a/step_2", "eval.max_samples=4",
                          "eval.num_generations_per_prompt=1", "logger.log_dir=logs/eval", cwd=tmp_path)
    assert "eval: ckpt/a/step_2, validation split, 4 prompts x 1 samples (greedy)" in evaluated.stdout
    (record,) = metrics(tmp_path / "logs/eval/eval_results.jsonl")
    assert record["model"] == "ckpt/a/step_2" and record["num_prompts"] == 4
    assert not (tmp_path / "logs/eval/metrics.jsonl").exists()


def test_rerun_with_a_changed_config_is_refused_before_anything_starts(tmp_path):
    """A checkpointed run rerun with a config that would corrupt it: one line naming the key, exit 2,
    before the warm start, preflight's slow parts (torch is not even imported), Ray or any worker.
    The same command rerun says the run is complete, as early."""
    run = [o for o in SMALL_GRPO if o != "grpo.max_num_steps=2"] + [
        "grpo.max_num_steps=1", "grpo.max_val_samples=4", "data.num_validation=4", "data.num_train=32",
        "logger.report=false", "sft_warmup.logger.report=false", "logger.log_dir=logs", "checkpointing.checkpoint_dir=ckpt",
    ]
    posttrain("grpo", *run, cwd=tmp_path)
    before = files_of(tmp_path / "logs", tmp_path / "ckpt")
    assert (tmp_path / "ckpt/step_1").is_dir() and (tmp_path / "ckpt/sft_warmup/step_2").is_dir()

    for change, named in (("data.num_digits=3", "data.num_digits: 2 -> 3"),  # the warm start is cached
                          ("sft_warmup=null policy.model_name=tiny-qwen2", "-> 'tiny-qwen2'")):
        result = posttrain_reporting_imports("grpo", *run, *change.split(), cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("posttrain grpo: ckpt holds checkpoints of a run with another config") and named in line
        assert "Traceback" not in result.stderr
        # Nothing started: no warm start ("reusing SFT warm start"), no "started in", nothing imported.
        assert result.stdout == "imported: []\n"
    assert files_of(tmp_path / "logs", tmp_path / "ckpt") == before  # no new log, lock or checkpoint file

    result = posttrain_reporting_imports("grpo", *run, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    done, imported = result.stdout.splitlines()
    assert "the checkpoint is at step 1, the last step (grpo.max_num_steps=1" in done and imported == "imported: []"
    assert files_of(tmp_path / "logs", tmp_path / "ckpt") == before


def test_sft_export_summary_report_and_no_fake_validation(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(6) for b in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["sft.max_num_steps=2", "sft.val_period=1", "policy.train_global_batch_size=8",
              "policy.train_micro_batch_size=8", "logger.progress_bar=false", "checkpointing.enabled=false"]
    result = posttrain("sft", *common, "sft.export_dir=out", "logger.log_dir=logs/sft", cwd=tmp_path)
    assert "[posttrain] SFT finished at step 2" in result.stdout
    assert "validation accuracy (greedy)" in result.stdout and "validation at step 2: loss" in result.stdout
    assert (tmp_path / "out/config.json").is_file() and (tmp_path / "logs/sft/report.png").is_file()
    last = metrics(tmp_path / "logs/sft/metrics.jsonl")[-1]
    assert 0.0 <= last["validation/accuracy_greedy"] <= 1.0 and last["validation/loss"] > 0

    result = posttrain("sft", *common, "data.dataset=jsonl", "data.train_path=train.jsonl",
                       "logger.log_dir=logs/noval", cwd=tmp_path)
    assert ": no validation;" in result.stdout
    assert not any(k.startswith("validation/") for row in metrics(tmp_path / "logs/noval/metrics.jsonl") for k in row)


def test_run_sh_keeps_the_callers_directory(tmp_path):
    out = subprocess.run(["bash", str(REPO / "run.sh"), "pwd"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path)


def test_custom_environment_loss_and_estimator_from_the_users_directory(tmp_path):
    """examples/custom (the README's example, docs/extending.md), run from a copy in the user's own directory."""
    import shutil

    shutil.copy(REPO / "examples/custom/my_task.py", tmp_path / "my_task.py")
    config = (REPO / "examples/custom/grpo_custom.yaml").read_text()
    config = config.replace("defaults: ../configs/grpo_math_tiny.yaml", f"defaults: {REPO}/examples/configs/grpo_math_tiny.yaml")
    (tmp_path / "my.yaml").write_text(config)
    small = [o for o in SMALL_GRPO if not o.startswith("sft_warmup")] + [
        "sft_warmup=null", "grpo.val_at_start=false", "grpo.val_period=0", "grpo.max_val_samples=8",
        "data.num_train=32", "data.num_validation=8", "checkpointing.enabled=false",
        "grpo.adv_estimator.kwargs={shift: 0.25}", "loss_fn.kwargs={scale: 2.0}",
    ]
    # Rows route themselves: half name the user's environment, half the built-in math one.
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b, "task_name": "parity" if a % 2 else "math"}
            for a in range(4) for b in range(4)]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    posttrain("grpo", "--config", "my.yaml", *small, "data.dataset=jsonl", "data.train_path=mixed.jsonl", cwd=tmp_path)
    rows = metrics(tmp_path / "logs/grpo_custom/metrics.jsonl")
    train = [row for row in rows if "train/loss" in row]
    assert len(train) == 2
    for row in train:
        assert row["train/loss_scale"] == 2.0  # the custom loss ran in the policy workers
        assert abs(row["train/advantages/mean"] - 0.25) < 1e-6  # the custom estimator's shift
        assert 0.0 <= row["train/reward"] <= 1.0
        assert row["train/reward_count/parity"] + row["train/reward_count/math"] == 8  # 2 prompts x 4
        for task in ("parity", "math"):
            assert 0.0 <= row.get(f"train/reward/{task}", 0.0) <= 1.0
    # A typo in the environment's own config is named before any worker starts.
    result = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "my.yaml", *small,
                             "env.parity.partial_credt=0.5"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "env.parity.partial_credt" in result.stderr and "Traceback" not in result.stderr
