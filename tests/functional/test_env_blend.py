"""A blend of environments in one GRPO run, launched as a user would (`posttrain grpo --config FILE`
in their own directory): math (synthetic arithmetic), multiple choice (a JSONL file) and a
reasoning-gym task, each with its weight; per-task rewards, accuracies and counts reach
metrics.jsonl and TensorBoard. And a row naming an environment nobody configured stops the run
before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.functional
REPO = Path(__file__).resolve().parents[2]

CONFIG = f"""
defaults: {REPO}/examples/configs/grpo_math_tiny.yaml
sft_warmup: null
grpo:
  num_prompts_per_step: 4
  num_generations_per_prompt: 4
  max_num_steps: 2
  val_period: 2
  val_at_start: false
  max_val_samples: 4
policy:
  train_global_batch_size: 16
  train_micro_batch_size: 16
  logprob_batch_size: 16
  max_total_sequence_length: 96
  generation:
    max_new_tokens: 8
data:
  blend:
    - {{name: math, weight: 2, dataset: arithmetic, num_train: 32, num_validation: 4}}
    - {{name: mcqa, weight: 1, dataset: jsonl, train_path: mcqa.jsonl, validation_path: mcqa.jsonl}}
    - name: rg
      weight: 1
      dataset: reasoning_gym
      reasoning_gym:
        - {{name: chain_sum, size: 16, val_size: 12, prompt_template: "{{expression}}=",
            config: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}}}
env:
  math: {{answer_format: last_number}}
  mcqa: {{grading_mode: lenient}}
  reasoning_gym: {{strict: true}}
logger:
  log_dir: logs/blend
  progress_bar: false
checkpointing:
  enabled: false
"""


def run(args, cwd):
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_blend_of_three_environments_logs_per_task_metrics(tmp_path):
    pytest.importorskip("reasoning_gym")
    mcqa = [{"prompt": f"{a}+{a}=? A) {2 * a} B) {2 * a + 1}", "options": [{"A": str(2 * a)}, {"B": str(2 * a + 1)}],
             "answer": "A"} for a in range(8)]
    (tmp_path / "mcqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mcqa))
    (tmp_path / "blend.yaml").write_text(CONFIG)
    result = run(["grpo", "--config", "blend.yaml"], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    rows = [json.loads(line) for line in (tmp_path / "logs/blend/metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/loss" in row]
    assert len(train) == 2
    tasks = ("math", "mcqa", "chain_sum")
    drawn = {task: 0.0 for task in tasks}
    for row in train:
        counts = {task: row.get(f"train/reward_count/{task}", 0.0) for task in tasks}
        assert sum(counts.values()) == 16  # 4 prompts x 4 generations, every one routed to its task
        for task in tasks:
            drawn[task] += counts[task]
            if counts[task]:
                assert 0.0 <= row[f"train/reward/{task}"] <= 1.0
    assert drawn["math"] > 0 and drawn["mcqa"] + drawn["chain_sum"] > 0
    [val] = [row for row in rows if "validation/accuracy_greedy" in row]
    for task in tasks:  # max_val_samples applies per blend component: 4 rows of each
        assert val[f"validation/accuracy_greedy_count/{task}"] == 4
        assert 0.0 <= val[f"validation/accuracy_greedy/{task}"] <= 1.0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs/blend/tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/reward_count/math", "validation/accuracy_greedy/mcqa", "validation/accuracy_greedy/chain_sum"} <= scalars


def test_rows_naming_an_unconfigured_environment_fail_before_workers_start(tmp_path, monkeypatch, capfd):
    """Both commands run in this process (`cli.main`, from the user's directory): they stop on the
    config and the data, before any worker or Ray starts, so a process of their own would only
    add an interpreter's start to the test."""
    from posttrain import cli

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "task_name": "poetry"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = cli.main(["grpo", "sft_warmup=null", "data.dataset=jsonl", "data.train_path=rows.jsonl"])
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-2000:]
    assert "rows.jsonl:2: task_name='poetry'" in stderr and "env.poetry.class_path" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "logs").exists()  # nothing started
    code = cli.main(["grpo", "sft_warmup=null", "env.mcqa.grading_mode=sloppy"])
    stderr = capfd.readouterr().err
    assert code == 2 and "env.mcqa.grading_mode" in stderr


def test_the_nemotron_mini_recipe_runs_two_steps_on_the_tiny_model(tmp_path):
    """The recipe's own files (examples/recipes/nemotron_mini*.yaml: seven environments, generated
    tasks, tool use over several turns) with the tiny model in place of SmolLM2: every task is drawn,
    scored and validated, in the seen and in the held-out wordings, from the user's directory."""
    pytest.importorskip("reasoning_gym")
    recipe = REPO / "examples/recipes/nemotron_mini.yaml"
    result = run(["grpo", "--config", str(recipe), "policy.model_name=tiny", "grpo.max_num_steps=2",
                  "grpo.num_prompts_per_step=14", "grpo.num_generations_per_prompt=2", "grpo.max_val_samples=2",
                  "grpo.val_period=2", "grpo.val_at_start=false", "policy.train_global_batch_size=28",
                  "policy.generation.max_new_tokens=16", "policy.max_total_sequence_length=1024",
                  "logger.log_dir=logs/recipe", "logger.progress_bar=false", "checkpointing.enabled=false"], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs/recipe/metrics.jsonl").read_text().splitlines()]
    assert len([row for row in rows if "train/loss" in row]) == 2
    [val] = [row for row in rows if "validation/accuracy_greedy" in row]
    tasks = ("math", "quiz", "json", "follow", "code", "calc", "basic_arithmetic")
    assert {task: val[f"validation/accuracy_greedy_count/{task}"] for task in tasks} == {task: 2 for task in tasks}
    unseen = {task: val[f"validation_unseen_phrasing/accuracy_greedy_count/{task}"] for task in tasks}
    assert unseen == {task: 2 for task in tasks} and "validation_unseen_phrasing/accuracy_greedy" in val
    drawn = {task for row in rows for task in tasks if row.get(f"train/reward_count/{task}")}
    assert len(drawn) >= 4  # 28 prompts drawn by equal weights from seven tasks
