"""The Python API's other trainers (`SFT`, `DPO`, `RewardModel`, `Distill`, `evaluate`): their
configs, TRL's columns turned into posttrain's, and one-line errors (no job runs here)."""

from __future__ import annotations

import json

import pytest

from posttrain import DPO, SFT, Distill, RewardModel
from posttrain.api.common import evaluate_config
from posttrain.config import load_config, save_config
from posttrain.errors import UserError


def rows_of(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_sft_takes_trl_prompt_completion_and_messages_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [
        {"prompt": "1+1=", "completion": "2", "level": 1},
        {"prompt": [{"role": "user", "content": "2+2="}], "completion": [{"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+3="},
                      {"role": "assistant", "content": "6"}]},
        {"prompt": "4+4=", "answer": 8},
    ]
    cfg = SFT(model="small", train_dataset=rows, eval_dataset=rows[:1],
              config={"sft": {"max_num_steps": 7}, "logger.log_dir": "run"}).config
    assert (cfg.policy.model_name, cfg.sft.max_num_steps, cfg.data.dataset) == ("small", 7, "jsonl")
    assert rows_of(cfg.data.train_path) == [
        {"level": 1, "prompt": "1+1=", "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},
        {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+3="}], "answer": "6"},
        {"prompt": "4+4=", "answer": "8"},
    ]
    assert rows_of(cfg.data.validation_path) == [{"level": 1, "prompt": "1+1=", "answer": "2"}]
    # A JSONL path of TRL rows is read and rewritten the same way; no eval_dataset: no validation.
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    cfg = SFT(train_dataset=str(tmp_path / "mine.jsonl"), config={"logger.log_dir": "run"}).config
    assert rows_of(cfg.data.train_path)[1]["answer"] == "4" and cfg.data.validation_path is None


def test_preference_trainers_take_trl_pairs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
             {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "assistant", "content": "4"}],
              "rejected": [{"role": "assistant", "content": "5"}]}]
    for trainer in (DPO, RewardModel):
        cfg = trainer(model="tiny", train_dataset=pairs, eval_dataset=pairs, config={"logger.log_dir": "run"}).config
        assert rows_of(cfg.data.train_path) == [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                                {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    assert DPO(config={"dpo.reference_policy_kl_penalty": 0.2}).config.dpo.reference_policy_kl_penalty == 0.2
    save_config(load_config("rm", overrides=["rm.max_num_steps=3"]), tmp_path / "rm.yaml")
    assert RewardModel(config=str(tmp_path / "rm.yaml")).config.rm.max_num_steps == 3


@pytest.mark.parametrize("make, message", [
    (lambda: SFT(train_dataset=[{"prompt": "a"}]),
     r"^train dataset row 0: needs 'prompt' and 'completion' \(or 'answer'\), or 'messages'; it has \['prompt'\]$"),
    (lambda: SFT(train_dataset=[{"messages": [{"role": "user", "content": "a"}]}]),
     r"^train dataset row 0, column 'messages': expected a conversation whose last message is the assistant's"),
    (lambda: SFT(train_dataset=[{"prompt": "a", "completion": {"x": 1}}]),
     r"^train dataset row 0, column 'completion': expected text or a list of messages"),
    (lambda: DPO(train_dataset=[{"prompt": "a", "chosen": "b"}]), r"^train dataset row 0: needs 'prompt', 'chosen' "
     r"and 'rejected'; it lacks \['rejected'\]"),
    (lambda: DPO(eval_dataset=[{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                "chosen": "b", "rejected": "c"}]),
     r"^validation dataset row 0, column 'prompt': a preference prompt is text or one user message"),
    (lambda: SFT(train_dataset="nowhere.jsonl"), r"^train dataset 'nowhere.jsonl': no such JSONL file$"),
    (lambda: SFT(config=load_config("dpo")), r"^config is a DPOMasterConfig; sft needs a SFTMasterConfig$"),
    (lambda: SFT(callbacks=[42]), r"^callbacks: 42 is neither a function nor an object with on_step_end"),
    (lambda: SFT(model=object()), r"^model must be a name or a path"),
    (lambda: SFT().model, r"^SFT.model and .tokenizer are the trained model: call train\(\) first$"),
    (lambda: RewardModel().evaluate(), r"^RewardModel.evaluate: a reward model does not generate"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch, make, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message):
        make()


def test_distill_sets_both_models_and_drops_warm_starts_of_other_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = Distill().config
    assert default.sft_warmup is not None and default.teacher_warmup is not None
    cfg = Distill(model="tiny-qwen2", teacher_model="small", reward_funcs=lambda prompts, completions, **_: [0.0],
                  train_dataset=[{"prompt": "1+1="}], config={"logger.log_dir": "run"}).config
    assert (cfg.policy.model_name, cfg.teacher.model_name) == ("tiny-qwen2", "small")
    assert cfg.sft_warmup is None and cfg.teacher_warmup is not None  # the teacher's warm start trains "small"
    assert cfg.data.env_name == "rewards" and cfg.env.section("rewards")["reward_fn"][0].endswith("<lambda>")


def test_evaluate_config_of_a_run(tmp_path, monkeypatch):
    """What `trainer.evaluate()` runs: the run's policy with the latest checkpoint, its data or the
    given rows, its environments or the given reward functions; logs under <log_dir>/eval."""
    monkeypatch.chdir(tmp_path)
    sft = SFT(train_dataset=[{"prompt": "1+1=", "completion": "2"}], config={"logger.log_dir": "run"}).config
    cfg = evaluate_config(sft, model="ckpt/step_3", dataset=[{"prompt": "2+2=", "answer": "4"}],
                          reward_funcs="posttrain.environments.reward_fn_env:columns", max_samples=9)
    assert cfg.policy.model_name == "ckpt/step_3" and cfg.logger.log_dir == "run/eval"
    assert rows_of(cfg.data.validation_path) == [{"prompt": "2+2=", "answer": "4"}]
    assert cfg.data.env_name == "rewards" and cfg.eval.max_samples == 9 and not cfg.checkpointing.enabled
