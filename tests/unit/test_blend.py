"""Data blends: weighted, resumable sampling over sources; blend configs and their errors; the
checks that run before workers start (environments of every task, their configs, row metadata)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from posttrain.config.loader import ConfigError, load_config
from posttrain.data.dataloader import BlendedLoader, ResumableLoader, make_loader
from posttrain.data.datasets import load_records
from posttrain.errors import UserError
from posttrain.preflight import check_envs


def test_blended_loader_follows_weights_and_resumes():
    items = [{"source": "a", "source_weight": 3.0, "i": i} for i in range(10)] + \
            [{"source": "b", "source_weight": 1.0, "i": i} for i in range(5)]
    loader = make_loader(items, 8, seed=1)
    assert isinstance(loader, BlendedLoader)
    drawn = Counter(item["source"] for _ in range(100) for item in loader.next_batch())
    assert 0.7 < drawn["a"] / 800 < 0.8  # 3:1
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(3)]
    resumed = make_loader(items, 8, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [resumed.next_batch() for _ in range(3)] == expected
    # every item of a source comes once per epoch of that source
    fresh = make_loader(items, 5, seed=2)
    b_items = [item["i"] for _ in range(40) for item in fresh.next_batch() if item["source"] == "b"]
    assert sorted(b_items[:5]) == list(range(5))
    assert isinstance(make_loader([{"x": 1}], 1), ResumableLoader)


def test_blend_config_records_and_errors(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"prompt": "p", "options": ["x", "y"], "answer": "A"}) + "\n" +
                    json.dumps({"prompt": "q", "answer": "1", "task_name": "math"}) + "\n")
    cfg = load_config("grpo", overrides=[
        f"data.blend=[{{name: arith, env: math, weight: 3, num_train: 6, num_validation: 2}}, "
        f"{{name: mc, env: mcqa, dataset: jsonl, train_path: {path}}}]"])
    train = load_records(cfg.data, "train")
    assert [(r["task_name"], r["env_name"], r["source"]) for r in train[-2:]] == [
        ("mc", "mcqa", "mc"), ("math", "math", "mc")]  # a row's own task_name wins (and picks its env)
    assert {r["source_weight"] for r in train if r["source"] == "arith"} == {3.0} and len(train) == 8
    assert [r["task_name"] for r in load_records(cfg.data, "validation")] == ["arith", "arith"]
    check_envs(cfg, train)  # math and mcqa serve everything; rows suit them
    with pytest.raises(ConfigError, match=r"data.blend\[1\].weight must be a number > 0"):
        load_config("grpo", overrides=["data.blend=[{name: a}, {name: b, weight: -1}]"])
    with pytest.raises(ConfigError, match=r"data.blend\[0\].num_digts: Extra inputs"):
        load_config("grpo", overrides=["data.blend=[{name: a, num_digts: 2}]"])
    with pytest.raises(ConfigError, match=r"data.blend\[1\].name='a' is used twice"):
        load_config("grpo", overrides=["data.blend=[{name: a}, {name: a}]"])


def test_preflight_names_environment_problems(tmp_path):
    cfg = load_config("grpo")
    with pytest.raises(UserError, match="a row's task_name='nope': no environment serves it.*env.nope.class_path"):
        check_envs(cfg, [{"task_name": "nope", "prompt": "p"}])
    # A row that names its own task is named by its file and line.
    with pytest.raises(UserError, match="^rows.jsonl:7: task_name='nope': no environment serves it"):
        check_envs(cfg, [{"task_name": "nope", "prompt": "p", "origin": "rows.jsonl:7"}])
    # A blend component's env is named by its key, with the closest environment.
    blend = load_config("grpo", overrides=["sft_warmup=null", "data.blend=[{name: a}, {name: quiz, env: mcq}]"])
    with pytest.raises(UserError, match=r"^data.blend\[1\].env='mcq': no environment serves it: did you mean 'mcqa'"):
        check_envs(blend, [{"task_name": "quiz", "env_name": "mcq", "prompt": "p"}])
    with pytest.raises(UserError, match="env.mcqa.grading_mode"):
        check_envs(load_config("grpo", overrides=["env.mcqa.grading_mode=sloppy"]), [])
    with pytest.raises(UserError, match="env.mcqq: no built-in or registered environment.*did you mean|env.mcqq: no built-in"):
        check_envs(load_config("grpo", overrides=["env.mcqq.grading_mode=strict"]), [])
    with pytest.raises(UserError, match=r"task 'mcqa' \(env.mcqa\), row 0 .*mcqa rows need 'options'"):
        check_envs(cfg, [{"task_name": "mcqa", "env_name": "mcqa", "prompt": "p", "answer": "A"}])
    with pytest.raises(UserError, match="unsupported instruction 'language:response_language'"):
        check_envs(cfg, [{"task_name": "instructions", "prompt": "p", "instruction_id_list": ["language:response_language"],
                          "kwargs": [{"language": "de"}]}])


def test_code_rows_without_tests_are_refused_before_training():
    cfg = load_config("grpo")
    with pytest.raises(UserError, match=r"task 'code' \(env.code\), row 0 .*code rows need tests"):
        check_envs(cfg, [{"task_name": "code", "prompt": "p", "answer": None}])
