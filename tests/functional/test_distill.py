"""On-policy distillation end to end: real Ray workers (student policy, student generation, teacher
policy, teacher generation for its accuracy, math environment) and real tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_grpo import read_metrics

from posttrain.config.loader import load_config

pytestmark = pytest.mark.functional


def two_teacher_cfg(tmp_path: Path, teachers: str, *extra: str):
    """The two-teacher tests' run: a 2-task blend of the math environment (`easy`; `hard`, 3 digits),
    each task distilled from its teacher in `teachers`, 2 steps in one process (local backend), no
    checkpoints, validation only at the start (where it is on)."""
    return load_config("distill", overrides=[
        "sft_warmup=null", "teacher_warmup=null", "teacher=null", "policy.model_name=tiny", "cluster.backend=local",
        f"teachers={teachers}",
        "data.blend=[{name: easy, env: math, num_train: 32, num_validation: 2}, "
        "{name: hard, env: math, num_train: 32, num_validation: 2, num_digits: 3}]",
        "distillation.num_prompts_per_step=8", "distillation.num_generations_per_prompt=2",
        "distillation.max_num_steps=2", "distillation.topk_logits_k=8", "distillation.val_period=0",
        "distillation.val_at_end=false", "distillation.val_batch_size=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16",
        "policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6",
        f"logger.log_dir={tmp_path}/logs", "checkpointing.enabled=false", "logger.progress_bar=false",
        "logger.tensorboard_enabled=false", "logger.report=false", *extra,
    ])


def test_distillation_lowers_the_kl_to_the_teacher(ray_cluster, tmp_path, capsys):
    from posttrain.algorithms import distill

    # The teacher: the tiny preset after a short SFT warm start (cached like every warm start),
    # peaked where the fresh student is near uniform.
    cfg = load_config("distill", overrides=[
        "sft_warmup=null", "policy.model_name=tiny", "teacher.model_name=tiny",
        "teacher_warmup.policy.model_name=tiny", "teacher_warmup.sft.max_num_steps=40",
        "teacher_warmup.sft.val_period=0", "teacher_warmup.sft.val_at_end=false",
        "teacher_warmup.data.num_train=2560", "teacher_warmup.logger.progress_bar=false",
        "distillation.num_prompts_per_step=8", "distillation.num_generations_per_prompt=2",
        "distillation.max_num_steps=6", "distillation.topk_logits_k=8",
        "distillation.val_period=0", "distillation.max_val_samples=8", "distillation.val_batch_size=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16",
        "teacher.logprob_batch_size=16", "policy.optimizer.lr=1e-3",
        "policy.max_total_sequence_length=32", "teacher.max_total_sequence_length=32",
        "policy.generation.max_new_tokens=6",
        "data.num_train=64", "data.num_validation=8",
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "checkpointing.save_period=3", "logger.progress_bar=false", "logger.tensorboard_enabled=false",
        "logger.report=false",
    ])
    summary = distill.run(cfg)

    metrics = read_metrics(tmp_path / "logs")
    kls = [metrics[step]["train/loss"] for step in range(1, 7)]
    # The student moves toward the teacher: the KL on its fresh samples falls by more than half
    # (measured: 0.99, 0.47, 0.36, 0.33, 0.22, 0.19).
    assert sum(kls[-2:]) / 2 < 0.5 * sum(kls[:2]) / 2, kls
    assert summary["kl_last"] < summary["kl_first"]
    step = metrics[6]
    # Two micro-batches per step, each divided by the step's global token count: the counts add up.
    assert step["train/num_valid_tokens"] == step["train/global_valid_toks"] > 0
    assert step["train/forward_kl"] == pytest.approx(step["train/loss"], rel=1e-5)  # kl_type: forward
    assert 0.0 < step["train/student_topk_mass"] <= 1.0
    for key in ("train/reward", "timing/train/generation", "timing/train/logprobs", "timing/train/policy_training"):
        assert key in step
    # Validation at the start (with the teacher's accuracy) and at the end; a final summary line.
    assert "validation/accuracy_greedy" in metrics[0] and "validation/teacher_accuracy" in metrics[0]
    assert "validation/accuracy_greedy" in metrics[6]
    assert summary["teacher_accuracy"] == metrics[0]["validation/teacher_accuracy"]
    assert "[posttrain] distillation finished at step 6" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "step_6").is_dir()


def test_a_distillation_blend_samples_its_weights_and_releases_its_locks(ray_cluster, tmp_path):
    """A distillation run of a `data.blend` (0.8 / 0.2 of two equally large arithmetic sources)
    draws its prompts by the weights, logs each task's reward, checkpoints the blend's position and
    leaves no run-directory lock behind (tests/unit/test_on_policy.py checks the proportion)."""
    from posttrain.algorithms import distill
    from posttrain.utils.run_dirs import LOCK_FILE

    cfg = load_config("distill", overrides=[
        "sft_warmup=null", "teacher_warmup=null", "policy.model_name=tiny", "teacher.model_name=tiny",
        "data.blend=[{name: easy, env: math, weight: 0.8, num_train: 32, num_validation: 2}, "
        "{name: hard, env: math, weight: 0.2, num_train: 32, num_validation: 2}]",
        "distillation.num_prompts_per_step=8", "distillation.num_generations_per_prompt=2",
        "distillation.max_num_steps=2", "distillation.topk_logits_k=8", "distillation.val_period=0",
        "distillation.val_at_start=false", "distillation.val_batch_size=8",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16",
        "teacher.logprob_batch_size=16", "policy.max_total_sequence_length=32",
        "teacher.max_total_sequence_length=32", "policy.generation.max_new_tokens=6",
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "checkpointing.save_period=2", "logger.progress_bar=false", "logger.tensorboard_enabled=false",
        "logger.report=false",
    ])
    distill.run(cfg)

    metrics = read_metrics(tmp_path / "logs")
    drawn = {task: sum(metrics[step][f"train/reward_count/{task}"] for step in (1, 2)) for task in ("easy", "hard")}
    # 32 samples (2 steps x 8 prompts x 2); measured 26 easy, 6 hard (a plain loader draws 1:1)
    assert drawn["easy"] + drawn["hard"] == 2 * 8 * 2 and drawn["easy"] > 2 * drawn["hard"], drawn
    assert {"train/reward/easy", "validation/accuracy_greedy/easy", "validation/accuracy_greedy/hard"} <= \
        set(metrics[2])
    loader_state = json.loads((tmp_path / "ckpt" / "step_2" / "dataloader.json").read_text())
    assert set(loader_state["sources"]) == {"easy", "hard"}  # the blend's position, per source
    assert not any((tmp_path / d / LOCK_FILE).exists() for d in ("logs", "ckpt"))


def test_two_teachers_each_teach_their_task(tmp_path):
    """`teachers`: a 2-task blend distils from two different models (`tiny` and `tiny-qwen2`, one
    character vocabulary), in one process (local backend); each task's KL is logged, and each is the
    KL to its own teacher."""
    import math

    from posttrain.algorithms import distill

    cfg = two_teacher_cfg(
        tmp_path,
        "{easy: {model_name: tiny, logprob_batch_size: 16, max_total_sequence_length: 32}, "
        "hard: {model_name: tiny-qwen2, logprob_batch_size: 16, max_total_sequence_length: 32}}",
        "distillation.val_at_start=false",
        "distillation.seed=42",  # the blend's draws below
    )
    distill.run(cfg)

    metrics = read_metrics(tmp_path / "logs")
    # Both tasks in every step: a blend's draw of batch b depends only on (seed, b), and with
    # this seed step 1 draws 2 easy and 6 hard prompts, step 2 4 and 4 (x 2 samples each).
    assert [[metrics[step][f"train/reward_count/{task}"] for task in ("easy", "hard")] for step in (1, 2)] == \
        [[4, 12], [8, 8]]
    for step in (1, 2):
        row = metrics[step]
        easy, hard = row["train/distill_loss/easy"], row["train/distill_loss/hard"]
        # `easy` goes to `tiny`, the student's own weights (KL 0 at step 1, about 0 after), `hard` to
        # qwen2's other weights: rows routed to the wrong teacher would swap the two.
        assert math.isfinite(easy) and abs(easy) < (1e-5 if step == 1 else 0.05), row
        assert math.isfinite(hard) and hard > 0.01, row
        assert math.isfinite(row["train/loss"]) and not any(k.startswith("train/kl_sum_task") for k in row)


def test_teachers_of_other_tokenizers_are_aligned_by_text(tmp_path):
    """Cross-tokenizer distillation with two teachers in one run (local backend): `easy` is taught by
    `tiny-pairs` (digit pairs, ChatML turns: another vocabulary, found by itself), `hard` by `tiny`
    (the student's own weights) read through the text alignment too (`tokenizer_alignment=always`).
    There every span is one shared token and the teacher is the student: its loss (the distribution
    term on every token, the mass gate off) is exactly 0 at step 1, which checks the teacher's prompt rendering, the re-tokenisation, the scoring and the
    placement on the student's tokens end to end. Each teacher's accuracy is measured with its own
    tokenizer."""
    import math

    from posttrain.algorithms import distill

    cfg = two_teacher_cfg(
        tmp_path,
        "{easy: {model_name: tiny-pairs, logprob_batch_size: 16, max_total_sequence_length: 48}, "
        "hard: {model_name: tiny, logprob_batch_size: 16, max_total_sequence_length: 32}}",
        "distillation.tokenizer_alignment=always", "distillation.max_val_samples=2",
        # Untrained teachers spread their mass beyond any top-8: no mass gate, so tokens get the teacher's
        # distribution read through the text (from the student's own weights: a KL of 0).
        "loss_fn.xtok_match_min_mass=0",
    )
    distill.run(cfg)

    metrics = read_metrics(tmp_path / "logs")
    assert 0.0 <= metrics[0]["validation/teacher_accuracy"] <= 1.0  # both teachers answered, each in its tokens
    seen = set()
    for step in (1, 2):
        row = metrics[step]
        assert row["train/xtok/spans"] > 0 and 0 < row["train/xtok/exact_match_spans"] <= row["train/xtok/spans"]
        assert row["train/xtok_aligned_tokens"] == row["train/num_valid_tokens"] > 0  # every generated token
        # Each token gets the teacher's distribution, or its span the span term (where the teacher's
        # top-8 has no token going on from the span's text so far).
        assert 0 < row["train/xtok_match_tokens"] <= row["train/xtok_aligned_tokens"]
        assert row["train/xtok_match_tokens"] + row["train/xtok_span_tokens"] >= row["train/xtok_aligned_tokens"]
        per_task = {task: row[f"train/distill_loss/{task}"] for task in ("easy", "hard")
                    if row.get(f"train/reward_count/{task}")}
        assert all(math.isfinite(v) for v in per_task.values()), row
        if step == 1 and "hard" in per_task:  # the student's own weights: span log-ratios and KL all 0
            assert abs(per_task["hard"]) < 1e-5, row
        if "easy" in per_task:  # another model of another vocabulary
            assert per_task["easy"] > 0.01, row
        seen |= set(per_task)
    assert seen == {"easy", "hard"}
