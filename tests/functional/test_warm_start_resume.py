"""Nothing thrown away: an SFT warm start interrupted by Ctrl-C resumes from its last checkpoint
on the next run (no step trained or logged twice), like any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.algorithms import on_policy, sft
from posttrain.config.loader import load_config

pytestmark = pytest.mark.functional

WARM = [
    "sft_warmup.sft.max_num_steps=4", "sft_warmup.sft.val_period=2", "sft_warmup.sft.max_val_samples=8",
    "sft_warmup.data.num_train=64", "sft_warmup.data.num_validation=8",
    "sft_warmup.policy.train_global_batch_size=8", "sft_warmup.policy.train_micro_batch_size=8",
    "sft_warmup.policy.max_total_sequence_length=32", "sft_warmup.checkpointing.save_period=2",
    "sft_warmup.logger.progress_bar=false", "sft_warmup.logger.tensorboard_enabled=false",
    "sft_warmup.logger.report=false",
]


def test_an_interrupted_warm_start_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = load_config("grpo", overrides=[*WARM, f"logger.log_dir={tmp_path}/logs",
                                         f"checkpointing.checkpoint_dir={tmp_path}/ckpt"])
    trained = []
    train_offline = sft.train_offline

    def ctrl_c_in_step_3(*args, train_step, **kwargs):
        def step(datums, timer):
            if len(trained) == 2 and not getattr(ctrl_c_in_step_3, "done", False):
                ctrl_c_in_step_3.done = True
                raise KeyboardInterrupt
            trained.append(len(trained) + 1)
            return train_step(datums, timer)

        return train_offline(*args, train_step=step, **kwargs)

    monkeypatch.setattr(sft, "train_offline", ctrl_c_in_step_3)
    with pytest.raises(KeyboardInterrupt) as info:
        on_policy.apply_warm_starts(cfg)
    checkpoints = tmp_path / "ckpt" / "sft_warmup"
    assert info.value.args == (f"SFT stopped after step 2; a rerun of the same command resumes from step 2 "
                               f"({checkpoints / 'step_2'})",)
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]

    capsys.readouterr()
    warmed = on_policy.apply_warm_starts(cfg)  # the rerun
    assert f"resumed from {checkpoints / 'step_2'} (step 2)" in capsys.readouterr().out
    assert trained == [1, 2, 3, 4]  # steps 1 and 2 were not trained again
    rows = [json.loads(line) for line in (tmp_path / "logs/sft_warmup/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2, 3, 4]  # no duplicates
    assert [row["step"] for row in rows if "validation/accuracy_greedy" in row] == [2, 4]
    assert (Path(warmed.policy.model_name) / "config.json").is_file()  # exported to the cache
