"""`posttrain distill`'s config: its keys, the checks made when it loads, and the vocabulary check
made before any worker starts (one line naming both keys and sizes, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.config.schema import DistillMasterConfig
from posttrain.errors import UserError
from posttrain.models.paths import model_vocab_size
from posttrain.preflight import check_distill_vocabularies

TINY_VOCAB = 103  # the character-level tokenizer of every built-in preset


def test_embedded_default_distils_a_larger_warm_started_model():
    cfg = load_config("distill")
    assert isinstance(cfg, DistillMasterConfig)
    assert (cfg.policy.model_name, cfg.teacher.model_name) == ("tiny", "small")
    assert cfg.sft_warmup.policy.model_name == "tiny" and cfg.teacher_warmup.policy.model_name == "small"
    assert cfg.loss_fn.kl_type == "forward" and cfg.distillation.topk_logits_k <= TINY_VOCAB
    # The student's warm start is that of the examples built on GRPO's default (grpo_math_tiny_v1.yaml:
    # the same config, so one cached export serves both).
    v1 = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_v1.yaml"
    assert cfg.sft_warmup == load_config("grpo", v1).sft_warmup


@pytest.mark.parametrize("override,fragment", [
    ("loss_fn.kl_type=js", "loss_fn.kl_type"),
    ("loss_fn.mixed_kl_weight=1.5", "loss_fn.mixed_kl_weight"),
    ("distillation.topk_logits_k=0", "distillation.topk_logits_k"),
    ("loss_fn.topk=4", "loss_fn.topk"),
    ("teacher.model_name=tiny", "teacher_warmup=null"),  # would be replaced by the teacher's warm start
    ("distillation.num_prompts_per_step=3", "policy.train_global_batch_size=64 must divide"),
])
def test_bad_keys_fail_when_the_config_loads(override, fragment):
    with pytest.raises(ConfigError, match=None) as error:
        load_config("distill", overrides=[override])
    assert fragment in str(error.value)


def hf_dir(path: Path, vocab_size: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    return path


def test_vocabulary_sizes_from_presets_directories_and_the_hub_cache(tmp_path):
    assert model_vocab_size("tiny") == model_vocab_size("small-qwen2") == TINY_VOCAB
    assert model_vocab_size(str(hf_dir(tmp_path / "m", 50257))) == 50257
    assert model_vocab_size("nobody-has/this-model-xyz") is None  # not cached: known only once loaded


def test_vocabulary_mismatch_names_both_keys_and_sizes(tmp_path):
    teacher = hf_dir(tmp_path / "teacher", 50257)
    cfg = load_config("distill", overrides=["teacher_warmup=null", f"teacher.model_name={teacher}",
                                            "distillation.tokenizer_alignment=never"])
    with pytest.raises(UserError) as error:
        check_distill_vocabularies(cfg)
    assert str(error.value) == (
        f"teacher.model_name={str(teacher)!r} has a vocabulary of 50257 tokens but sft_warmup.policy.model_name="
        "'tiny' has 103: distillation compares the two models token by token, so they need the same vocabulary "
        "with distillation.tokenizer_alignment=never (auto, the default, aligns them by text: docs/algorithms.md)"
    )
    check_distill_vocabularies(load_config("distill"))  # tiny and small share the vocabulary
    # By default (tokenizer_alignment=auto) a teacher of another vocabulary is aligned by text instead.
    default = load_config("distill", overrides=["teacher_warmup=null", f"teacher.model_name={teacher}"])
    assert default.distillation.tokenizer_alignment == "auto"
    check_distill_vocabularies(default)


def test_cli_refuses_a_teacher_of_another_vocabulary_before_any_worker_starts(tmp_path):
    teacher = hf_dir(tmp_path / "teacher", 32000)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "distill", "teacher_warmup=null", f"teacher.model_name={teacher}",
         "sft_warmup=null", "distillation.tokenizer_alignment=never"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    # Lines of start-up phases that lasted (`[posttrain] checking ... (preflight)...`) may come first.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[posttrain] ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "has a vocabulary of 32000 tokens but policy.model_name='tiny' has 103" in lines[0]
    assert not (tmp_path / "logs").exists()  # refused before the run started


def test_a_teacher_below_its_student_is_warned_about(monkeypatch, capsys):
    """At step 0 the student's validation and the teacher's accuracy are compared: a teacher that
    scores lower (e.g. 1.2% against 43.8%) gets a warning naming both."""
    from types import SimpleNamespace

    from posttrain.algorithms import distill

    monkeypatch.setattr(distill, "validate", lambda ctx: {"validation/accuracy_greedy": 0.438})
    ctx = SimpleNamespace(val_samples=[object()], step=0, generation=None, teacher_accuracy=0.012)
    metrics = distill.validate_student(ctx)
    assert metrics == {"validation/accuracy_greedy": 0.438, "validation/teacher_accuracy": 0.012}
    out = capsys.readouterr().out
    assert "WARNING: the teacher's validation accuracy 1.2% is below the student's 43.8%" in out
    ctx.teacher_accuracy = 0.9
    distill.validate_student(ctx)
    assert "WARNING" not in capsys.readouterr().out
