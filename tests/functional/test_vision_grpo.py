"""The tiny vision-language preset (`examples/configs/grpo_vl_tiny.yaml`, shrunk by overrides)
trains end to end with the native engine: its SFT warm start on the images, GRPO steps whose
rollouts the engine generates from the images, a checkpoint, and a rerun that reloads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.loader import load_config
from posttrain.utils.logger import read_metrics_jsonl

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "examples" / "configs" / "grpo_vl_tiny.yaml"


def test_the_vision_preset_warm_starts_trains_checkpoints_and_resumes(tmp_path, capfd):
    from posttrain.algorithms import grpo

    def run(steps: int) -> None:
        # One worker per group and the native engine: the local backend (one process).
        cfg = load_config("grpo", str(PRESET), [
            "sft_warmup.sft.max_num_steps=8", "sft_warmup.sft.val_period=0", "sft_warmup.sft.val_at_end=false",
            "sft_warmup.sft.max_val_samples=8", "sft_warmup.sft.val_batch_size=8",
            "sft_warmup.policy.train_global_batch_size=8", "sft_warmup.policy.train_micro_batch_size=8",
            "sft_warmup.policy.logprob_batch_size=8", "sft_warmup.data.num_train=64", "sft_warmup.data.num_validation=8",
            "sft_warmup.logger.progress_bar=false", "sft_warmup.logger.report=false",
            "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", f"grpo.max_num_steps={steps}",
            "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.max_val_samples=8",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
            "policy.generation.batch_size=16", "data.num_train=32", "data.num_validation=8",
            "checkpointing.save_period=2", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
            f"logger.log_dir={tmp_path}/logs", "logger.progress_bar=false", "logger.report=false",
            "logger.tensorboard_enabled=false",
        ])
        grpo.run(cfg)

    run(2)
    warm = read_metrics_jsonl(tmp_path / "logs" / "sft_warmup" / "metrics.jsonl")
    losses = [warm[step]["train/loss"] for step in range(1, 9)]
    print("SFT warm start losses", [round(loss, 3) for loss in losses])
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses  # the answers' NLL on image prompts falls
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        # The engine generated from the images with the trainer's weights (the warm start's, then
        # step 1's refit): its logprobs of the samples are the trainer's.
        assert 1.0 <= row["train/token_mult_prob_error"] < 1.001, row["train/token_mult_prob_error"]
        assert row["train/num_samples"] == 16 and 0.0 <= row["train/reward"] <= 1.0
    assert (tmp_path / "ckpt" / "step_2" / "policy").is_dir()
    capfd.readouterr()

    run(3)  # the same run, one step longer: reloads step 2 (the warm start comes from the cache)
    out = capfd.readouterr().out
    assert f"resumed from {tmp_path}/ckpt/step_2 (step 2)" in out, out
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(metrics) == [1, 2, 3]
    # The engine was refit from the reloaded weights: still the trainer's distribution.
    assert 1.0 <= metrics[3]["train/token_mult_prob_error"] < 1.001, metrics[3]
