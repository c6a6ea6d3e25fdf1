"""`posttrain.GRPO`'s config: its forms, the model and warm start, data sets as JSONL, the reward section."""

from __future__ import annotations

import json

import pytest

from posttrain import GRPO
from posttrain.api import dataset_jsonl
from posttrain.config import load_config, save_config
from posttrain.errors import UserError


def reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_config_forms_and_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = GRPO().config
    assert default == load_config("grpo")  # no arguments: the embedded default, as `posttrain grpo`
    as_dict = GRPO(config={"grpo": {"max_num_steps": 7}, "policy.optimizer.lr": 3e-4}).config
    assert (as_dict.grpo.max_num_steps, as_dict.policy.optimizer.lr, as_dict.grpo.num_prompts_per_step) == (7, 3e-4, 16)
    save_config(as_dict, tmp_path / "my.yaml")
    assert GRPO(config=str(tmp_path / "my.yaml")).config == as_dict
    assert GRPO(config=as_dict).config == as_dict
    # A given model replaces policy.model_name; the warm start stays only when it trains that model.
    assert GRPO(model="tiny").config.sft_warmup is not None
    small = GRPO(model="small").config
    assert small.policy.model_name == "small" and small.sft_warmup is None


def test_rows_become_the_jobs_jsonl_data_and_reward_functions_its_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]
    cfg = GRPO(reward_funcs=[reward, "posttrain.environments.reward_fn_env:columns"], reward_weights=[1, 0.5],
               train_dataset=rows, eval_dataset=rows[:1], config={"logger.log_dir": "run"}).config
    assert (cfg.data.dataset, cfg.data.env_name, cfg.data.blend) == ("jsonl", "rewards", [])
    assert cfg.data.train_path.startswith("run/data/train-") and cfg.data.validation_path.startswith("run/data/validation-")
    assert [json.loads(line) for line in open(cfg.data.train_path)] == rows
    assert cfg.env.section("rewards") == {"reward_fn": ["test_api_config:reward", "posttrain.environments.reward_fn_env:columns"],
                                          "weights": [1.0, 0.5]}
    assert GRPO(train_dataset=rows, config={"logger.log_dir": "run"}).config.data.train_path == cfg.data.train_path


def test_hf_datasets_and_jsonl_paths(tmp_path):
    import datasets

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "3+4=", "answer": "7"}]
    written = dataset_jsonl(datasets.Dataset.from_list(rows), tmp_path, "train")
    assert [json.loads(line) for line in written.read_text().splitlines()] == rows
    assert dataset_jsonl(rows, tmp_path, "train") == written  # same rows, same file
    assert dataset_jsonl(str(written), tmp_path / "elsewhere", "train") == written  # a path is used as it is
    with pytest.raises(UserError, match=r"^validation dataset '.*nope.jsonl': no such JSONL file$"):
        dataset_jsonl(str(tmp_path / "nope.jsonl"), tmp_path, "validation")
    with pytest.raises(UserError, match=r"^train dataset has no rows$"):
        dataset_jsonl([], tmp_path, "train")
