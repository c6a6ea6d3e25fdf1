"""Mistakes a new user makes, each answered by one clear line (exit 2, no traceback) before any
worker starts. The CLI cases run `posttrain` in a subprocess from a directory outside the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.data.datasets import DataError, load_records
from posttrain.errors import UserError
from posttrain.models.policy.model_loading import reward_head_load_note
from posttrain.preflight import check_model_name, load_split_records

REPO = Path(__file__).resolve().parents[2]


def posttrain(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    # Lines of start-up phases that lasted (`[posttrain] checking ... (preflight)...`) may come first.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[posttrain] ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------- data
def jsonl_cfg(tmp_path: Path, train: str, validation: str | None = None, algo: str = "grpo"):
    (tmp_path / "train.jsonl").write_text(train)
    overrides = ["sft_warmup=null"] if algo == "grpo" else []
    overrides += ["data.dataset=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}"]
    if validation is not None:
        (tmp_path / "val.jsonl").write_text(validation)
        overrides.append(f"data.validation_path={tmp_path / 'val.jsonl'}")
    return load_config(algo, overrides=overrides)


def test_empty_train_file_names_the_file(tmp_path):
    cfg = jsonl_cfg(tmp_path, "\n\n")
    with pytest.raises(DataError, match=r"train.jsonl: the training data \(data.train_path\) has no records"):
        load_split_records(cfg)


def test_missing_or_empty_validation_is_allowed(tmp_path):
    row = json.dumps({"prompt": "1+1=", "answer": 2}) + "\n"
    assert load_split_records(jsonl_cfg(tmp_path, row))["validation"] == []
    assert load_split_records(jsonl_cfg(tmp_path, row, validation=""))["validation"] == []


def test_json_error_column_is_on_the_line(tmp_path):
    cfg = jsonl_cfg(tmp_path, '{"prompt": "1+1=", "answer": 2}\n{"prompt": "x", "answer": 2\n')
    # Truncated object (27 characters): the missing comma is expected at column 28 of line 2, not "column 1".
    with pytest.raises(DataError, match=r"train.jsonl:2: invalid JSON: Expecting ',' delimiter \(column 28\)"):
        load_records(cfg.data, "train")


# -------------------------------------------------------------------------------------- config
def test_unknown_command_line_keys_are_blamed_on_the_command_line():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", overrides=["grpo.foo=1", "policy.bar.baz=2"])
    assert "Unknown config key 'policy.bar' (from command line)" in str(e.value)
    assert "Unknown config key 'grpo.foo' (from command line)." in str(e.value)
    assert "Did you mean 'grpo'?" not in str(e.value)  # never the key's own section
    assert ".yaml" not in str(e.value)


def test_model_name_is_not_silently_replaced_by_the_warm_start():
    with pytest.raises(ConfigError, match=r"policy.model_name='/some/model' would be replaced by the SFT warm start"):
        load_config("grpo", overrides=["policy.model_name=/some/model"])
    cfg = load_config("grpo", overrides=["policy.model_name=small", "sft_warmup.policy.model_name=small"])
    assert cfg.sft_warmup.policy.model_name == cfg.policy.model_name == "small"
    assert load_config("grpo", overrides=["policy.model_name=small", "sft_warmup=null"]).sft_warmup is None


# -------------------------------------------------------------------------------------- models
def test_model_name_checks(tmp_path):
    check_model_name("tiny", "policy.model_name")
    check_model_name("tiny-qwen2", "policy.model_name")
    with pytest.raises(UserError, match=r"policy.model_name='\./nope': no such directory"):
        check_model_name("./nope", "policy.model_name")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_model_name(str(tmp_path / "file.bin"), "policy.model_name")
    with pytest.raises(UserError, match="no config.json"):
        check_model_name(str(tmp_path), "policy.model_name")
    (tmp_path / "run" / "step_3" / "policy" / "model").mkdir(parents=True)
    (tmp_path / "run" / "step_12" / "policy" / "model").mkdir(parents=True)
    (tmp_path / "run" / "step_12" / "policy" / "model" / ".metadata").write_text("")
    with pytest.raises(UserError, match=r"is a run's checkpoint directory; name one step of it, e.g. .*step_12"):
        check_model_name(str(tmp_path / "run"), "policy.model_name")
    check_model_name(str(tmp_path / "run" / "step_12"), "policy.model_name")  # a checkpoint is a model


def test_hub_id_without_cache_fails_fast_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="'nobody/no-such-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE"):
        check_model_name("nobody/no-such-model", "policy.model_name")


def test_hub_id_unreachable_hub_is_one_line(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    with pytest.raises(UserError, match="cannot be reached"):
        check_model_name("nobody/no-such-model", "policy.model_name")


def test_reward_head_note_is_plain():
    note = reward_head_load_note("/m", ["score.weight"], ["lm_head.weight"])
    assert note == "[posttrain] reward model from /m: new score head (score.weight) initialised; the language-model head is not used"
    assert "WARNING" in reward_head_load_note("/m", ["score.weight", "model.norm.weight"], [])


# -------------------------------------------------------------------- the CLI, outside the repo
def test_cli_missing_local_model_is_one_line(tmp_path):
    result = posttrain("sft", "policy.model_name=./no-such-model", cwd=tmp_path)
    one_line_error(result, "posttrain sft: policy.model_name='./no-such-model': no such directory")


def test_cli_empty_train_file_is_one_line_and_relative_to_cwd(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = posttrain("grpo", "sft_warmup=null", "data.dataset=jsonl", "data.train_path=empty.jsonl", cwd=tmp_path)
    one_line_error(result, "posttrain grpo: empty.jsonl: the training data (data.train_path) has no records")


def test_cli_bad_warm_start_data_fails_before_the_warm_start(tmp_path):
    result = posttrain("grpo", "sft_warmup.data.dataset=jsonl", "sft_warmup.data.train_path=missing.jsonl", cwd=tmp_path)
    one_line_error(result, "missing.jsonl: no such JSONL file")
    assert not (tmp_path / "logs").exists()  # nothing started


def test_cli_convert_run_directory_suggests_the_latest_step(tmp_path):
    (tmp_path / "ckpt" / "step_4" / "policy" / "model").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_4" / "policy" / "model" / ".metadata").write_text("")
    result = posttrain("convert", "--checkpoint", "ckpt", "--out", "hf", cwd=tmp_path)
    one_line_error(result, "posttrain convert: ckpt is a run's checkpoint directory", "--checkpoint ckpt/step_4")


def test_cli_wandb_without_wandb_is_refused_at_config_load(tmp_path):
    pytest.importorskip("posttrain")
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    result = posttrain("sft", "logger.wandb.enabled=true", cwd=tmp_path)
    one_line_error(result, "logger.wandb.enabled=true needs the 'wandb' package")


def test_run_sh_first_install_shows_each_phase_and_the_log(tmp_path):
    """run.sh in a copy of the repository, with a stand-in `python3` that only records calls."""
    import shutil
    import stat

    shutil.copy(REPO / "run.sh", tmp_path / "run.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir()
    # `python3 -m venv DIR` creates DIR/bin/python, itself a stand-in that logs its arguments.
    (fake_bin / "python3").write_text(
        '#!/bin/sh\nmkdir -p "$3/bin"\nprintf \'#!/bin/sh\\necho "pip $*" >> "%s/calls"\\n\' "$3" > "$3/bin/python"\n'
        'chmod +x "$3/bin/python"\n'
    )
    (fake_bin / "python3").chmod(stat.S_IRWXU)
    result = subprocess.run(["bash", str(tmp_path / "run.sh"), "true"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert f"full log: {tmp_path}/.venv-install.log" in result.stderr
    for phase in ("creating the virtual environment", "upgrading pip", "installing torch 2.13.0",
                  "installing posttrain and its pinned dependencies", "byte-compiling what a run imports",
                  "environment ready"):
        assert phase in result.stderr, result.stderr
    calls = (tmp_path / ".venv" / "calls").read_text()
    # pip byte-compiles nothing: posttrain and what every run imports have phases of their own.
    assert "install --no-compile torch==2.13.0" in calls and "install --no-compile -e" in calls, calls
    again = subprocess.run(["bash", str(tmp_path / "run.sh"), "true"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert again.stderr == ""  # installed once: later calls print nothing


def test_async_grpo_needs_its_own_generation_workers_and_importance_weights():
    on = ["grpo.async_grpo.enabled=true"]
    with pytest.raises(ConfigError, match="policy.generation.colocated.enabled=false"):
        load_config("grpo", overrides=on + ["loss_fn.use_importance_sampling_correction=true"])
    with pytest.raises(ConfigError, match="set loss_fn.use_importance_sampling_correction=true"):
        load_config("grpo", overrides=on + ["policy.generation.colocated.enabled=false"])
    cfg = load_config("grpo", config_path=str(REPO / "examples/configs/grpo_async_tiny.yaml"))
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1
    assert cfg.loss_fn.truncated_importance_sampling_type == "tis"
