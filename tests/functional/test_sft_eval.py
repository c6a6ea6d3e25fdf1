"""`posttrain sft` and `posttrain eval` with real workers and a real tiny model."""

from __future__ import annotations

import json

import pytest

from posttrain.config.loader import load_config

pytestmark = pytest.mark.functional


def test_sft_learns_checkpoints_exports_and_eval_reads_both(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.algorithms import sft
    from posttrain.evals import eval as evaluation

    common = ["policy.model_name=tiny", "data.num_train=512", "data.num_validation=32",
              "logger.progress_bar=false", "logger.tensorboard_enabled=false"]
    cfg = load_config("sft", overrides=[
        *common, "sft.max_num_steps=40", "sft.val_period=20", "sft.val_at_start=true",
        "policy.train_global_batch_size=32", "policy.train_micro_batch_size=16", "policy.optimizer.lr=1e-3",
        "checkpointing.save_period=20", f"logger.log_dir={tmp_path}/sft_logs",
        f"checkpointing.checkpoint_dir={tmp_path}/sft_ckpt",
    ])
    export = tmp_path / "export"
    sft.run(cfg, export_dir=export)

    rows = [json.loads(line) for line in (tmp_path / "sft_logs" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["validation/loss"] for r in rows if "validation/loss" in r}
    assert sorted(val) == [0, 20, 40]
    assert val[40] < 0.8 * val[0], val  # the answers' NLL drops clearly in 40 steps
    train_loss = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train_loss) == 40 and sum(train_loss[-5:]) < sum(train_loss[:5])
    assert (tmp_path / "sft_ckpt" / "step_40" / "policy").is_dir()
    model = AutoModelForCausalLM.from_pretrained(export)
    assert sum(p.numel() for p in model.parameters()) > 0

    # Evaluate the HF export and the step_40 checkpoint (converted on the fly): same weights,
    # greedy decoding, so the same accuracy.
    results = []
    for name in (str(export), str(tmp_path / "sft_ckpt" / "step_40")):
        eval_cfg = load_config("eval", overrides=[
            *common, f"policy.model_name={name}", "policy.tokenizer_name=tiny", "eval.max_samples=32",
            f"logger.log_dir={tmp_path}/eval_logs", "eval.num_generations_per_prompt=1",
        ])
        results.append(evaluation.run(eval_cfg))
    assert results[0] == results[1]
    assert 0.0 <= results[0]["validation/accuracy_greedy"] <= 1.0
    assert results[0]["validation/avg_length"] > 0
