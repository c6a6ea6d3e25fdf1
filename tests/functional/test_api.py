"""The Python API (`from posttrain import GRPO`): reward functions train the tiny model, as the CLI's job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from posttrain import GRPO
from posttrain.errors import UserError

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).with_name("api_example.py")


def accuracy(metrics: dict) -> float:
    """The validation accuracy of a step (whatever its decoding suffix: validation/accuracy[_greedy])."""
    (value,) = [v for k, v in metrics.items() if k.startswith("validation/accuracy") and "/" not in k[len("validation/"):]]
    return value


def test_the_readme_example_learns_from_a_reward_function_in_main(tmp_path):
    """The README's script: a reward function defined in `__main__`, rows as a list of dicts."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO), "POSTTRAIN_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    history = {int(step): metrics for step, metrics in json.loads(result.stdout.splitlines()[-1]).items()}
    validations = {step: accuracy(m) for step, m in history.items() if m}
    assert sorted(validations) == [0, 5, 10, 15, 20]
    assert validations[0] <= 0.1 and validations[20] >= validations[0] + 0.3, validations
    # A few completions at each validation, by default (logger.num_val_samples_to_print: 3).
    assert result.stdout.count("[posttrain] validation/samples at step") == 5
    assert "  reward 0.00 | '83+21=' -> " in result.stdout
    saved = (tmp_path / "logs/api_example/config.yaml").read_text()
    assert "__main__:first_digit" in saved and "data/train-" in saved  # the job the CLI would run


def test_a_lambda_trains_locally_and_evaluate_scores_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": "easy"} for a in range(10, 30) for b in (11, 47)]
    seen_columns, steps = set(), []

    def record(prompts, completions, **columns):
        seen_columns.update(columns)
        return [0.0] * len(completions)

    trainer = GRPO(
        model="tiny", reward_funcs=[lambda prompts, completions, **_: [float(c[:1].isdigit()) for c in completions], record],
        reward_weights=[1.0, 0.5], train_dataset=rows[:32], eval_dataset=rows[32:],
        config={"sft_warmup": None, "grpo.max_num_steps": 4, "grpo.val_period": 2, "grpo.num_prompts_per_step": 4,
                "grpo.num_generations_per_prompt": 4, "policy.train_global_batch_size": 16,
                "policy.optimizer.lr": 1e-3, "policy.generation.max_new_tokens": 3,
                "logger.log_dir": "logs", "checkpointing.checkpoint_dir": "ckpt", "logger.progress_bar": False},
        callbacks=[lambda step, metrics: steps.append((step, "train/reward" in metrics))],  # GRPO's steps only
    )
    assert trainer.config.cluster.backend == "auto" and trainer.config.env.section("rewards")["weights"] == [1.0, 0.5]
    result = trainer.train()
    assert result.checkpoint == Path("ckpt/step_4") and result.log_dir == Path("logs")
    assert seen_columns == {"answer", "level"} and steps == [(1, True), (2, True), (3, True), (4, True)]
    assert sorted(s for s, m in result.history.items() if any(k.startswith("validation/") for k in m)) == [0, 2, 4]
    metrics = trainer.evaluate()  # greedy on the same rows with the step-4 checkpoint: the last validation's score
    assert abs(accuracy(metrics) - accuracy(result.history[4])) <= 1 / 8
    assert (tmp_path / "logs/eval/eval_results.jsonl").exists()


def test_an_unpicklable_reward_on_ray_is_one_line_before_ray_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock = threading.Lock()

    def locked(prompts, completions, **_):
        with lock:
            return [0.0] * len(completions)

    trainer = GRPO(model="tiny", reward_funcs=locked, train_dataset=[{"prompt": "1+1="}],
                   config={"sft_warmup": None, "cluster.backend": "ray", "logger.log_dir": "logs"})
    with pytest.raises(UserError) as error:
        trainer.train()
    message = str(error.value)
    assert "\n" not in message and message.startswith("env.rewards: reward function ")
    assert "locked cannot be sent to a Ray worker" in message and "cluster.backend=local" in message
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()  # refused before the job started


def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^train dataset row 1: expected a dict of columns, got str$"):
        GRPO(reward_funcs=len, train_dataset=[{"prompt": "a"}, "b"])
    with pytest.raises(UserError, match=r"^train dataset row 0, column 'when': not JSON-serialisable"):
        GRPO(reward_funcs=len, train_dataset=[{"prompt": "a", "when": object()}])
    with pytest.raises(UserError, match=r"Unknown config key 'grpo.max_num_stepz'.*Did you mean 'grpo.max_num_steps'"):
        GRPO(config={"grpo": {"max_num_stepz": 3}})
