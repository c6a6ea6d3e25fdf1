"""The seeded task generators (`data.dataset=generated`): every generator's rows are scored by the
real environment they are made for (the reference answer, written as a model would, scores 1; a
wrong one 0), are the same for a seed, have the asked sizes and disjoint splits; configs name the
generator and its options in one line; a blend of all of them routes each row to its environment."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.config.loader import ConfigError, load_config
from posttrain.config.schema import DataConfig
from posttrain.config.schema.data import TASK_GENERATORS as SCHEMA_GENERATORS
from posttrain.data.datasets import env_metadata, load_records
from posttrain.data.generators import GENERATOR_ENVS, TASK_GENERATORS
from posttrain.environments.sandbox import mode_problem
from posttrain.errors import DataError
from posttrain.preflight import check_envs

NO_SANDBOX = mode_problem("bwrap") is not None and mode_problem("unshare") is not None


def records(generator: str, num_validation: int = 60, **options) -> list[dict]:
    """Validation records of `data.dataset=generated` through the loader (as a run reads them)."""
    cfg = DataConfig(dataset="generated", generator=generator, num_train=20, num_validation=num_validation,
                     seed=11, generator_options=options)
    return load_records(cfg, "validation")


def rewards(env, rows: list[dict], responses: list[str]) -> list[float]:
    logs = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": text}]
            for r, text in zip(rows, responses, strict=True)]
    return env.step(logs, [env_metadata(r) for r in rows]).rewards.tolist()


def test_the_schema_lists_every_registered_generator_and_each_feeds_a_built_in_environment():
    from posttrain.environments.registry import get_env_class

    assert sorted(SCHEMA_GENERATORS) == sorted(TASK_GENERATORS) == sorted(GENERATOR_ENVS)
    assert {name: get_env_class(env).__name__ for name, env in GENERATOR_ENVS.items()} == {
        "word_problems": "MathEnvironment", "multiple_choice": "MCQAEnvironment", "json_output": "StructuredOutputEnvironment",
        "instructions": "InstructionFollowingEnvironment", "functions": "CodeEnvironment", "calculator": "ToolEnvironment"}


@pytest.mark.parametrize("name", sorted(TASK_GENERATORS))
def test_sizes_determinism_and_disjoint_splits(name):
    fn = TASK_GENERATORS[name]
    train, validation = fn(300, 100, 5)
    assert (len(train), len(validation)) == (300, 100)
    prompts = [r["prompt"] for r in train + validation]
    assert len(set(prompts)) == 400  # distinct, so no validation prompt is a training one
    assert all(isinstance(r["answer"], str) and r["answer"] for r in train + validation)
    assert json.dumps(fn(300, 100, 5)) == json.dumps((train, validation))  # a pure function of its arguments
    other_train, other_validation = fn(300, 100, 6)
    assert len({r["prompt"] for r in other_validation} & {r["prompt"] for r in validation}) < 50
    assert fn(10, 100, 5)[1] == validation and fn(10, 100, 5)[0] == train[:10]  # validation drawn first
    assert fn(0, 3, 5) == ([], validation[:3])


def test_word_problems_are_scored_by_the_math_environment():
    from posttrain.environments.math_env import MathEnvironment

    env = MathEnvironment({})
    try:
        for options in ({}, {"operations": ["mul", "div"], "max_number": 50}, {"steps": 2, "operations": ["add", "sub", "mul", "div"]}):
            rows = records("word_problems", **options)
            assert all(0 <= int(r["answer"]) <= 200 for r in rows)
            assert rewards(env, rows, [f"They have {r['answer']} now. The answer is \\boxed{{{r['answer']}}}." for r in rows]) == [1.0] * 60
            assert rewards(env, rows, [f"\\boxed{{{int(r['answer']) + 1}}}" for r in rows]) == [0.0] * 60
    finally:
        env.shutdown()


def test_multiple_choice_is_scored_by_the_mcqa_environment():
    from posttrain.environments.mcqa_env import MCQAEnvironment

    env = MCQAEnvironment({})
    for options in ({}, {"num_options": 5}, {"num_options": 2, "kinds": ["category", "arithmetic"]}):
        rows = records("multiple_choice", **options)
        letters = [chr(ord("A") + i) for i in range(options.get("num_options", 3))]
        assert {r["answer"] for r in rows} == set(letters)  # the right option moves around
        assert all(MCQAEnvironment.metadata_problem(env_metadata(r)) is None for r in rows)
        assert rewards(env, rows, [f"Answer: {r['answer']}" for r in rows]) == [1.0] * 60
        wrong = [letters[(letters.index(r["answer"]) + 1) % len(letters)] for r in rows]
        assert rewards(env, rows, [f"Answer: {letter}" for letter in wrong]) == [0.0] * 60
    assert all("capital" in r["prompt"].splitlines()[0] for r in records("multiple_choice", kinds="capital"))


def test_json_output_is_scored_by_the_structured_environment():
    from posttrain.environments.structured_env import StructuredOutputEnvironment

    env = StructuredOutputEnvironment({})
    for options in ({}, {"num_fields": 1}, {"num_fields": 3}):
        rows = records("json_output", **options)
        assert rewards(env, rows, [r["answer"] for r in rows]) == [1.0] * 60
        assert rewards(env, rows, [f"```json\n{r['answer']}\n```" for r in rows]) == [1.0] * 60
        changed = [json.dumps({k: (not v if isinstance(v, bool) else v + 1 if isinstance(v, int) else v + "x")
                               for k, v in json.loads(r["answer"]).items()}) for r in rows]
        assert rewards(env, rows, changed) == [0.0] * 60
        assert rewards(env, rows, [r["answer"][:-1] for r in rows]) == [0.0] * 60  # not JSON
    loose = records("json_output", exact_values=False)
    changed = [json.dumps({k: (v + 1 if isinstance(v, int) and not isinstance(v, bool) else v)
                           for k, v in json.loads(r["answer"]).items()}) for r in loose]
    assert rewards(env, loose, changed) == [1.0] * 60  # only keys and types are checked


def violate(row: dict) -> str:
    """The row's reference answer, changed to break its first instruction."""
    answer, kwargs = row["answer"], row["kwargs"][0]
    return {
        "punctuation:no_comma": lambda: answer.replace(" ", ", ", 1),
        "change_case:english_lowercase": lambda: answer + " Hello",
        "change_case:english_capital": lambda: answer + " hello",
        "length_constraints:number_words": lambda: (answer + " word" * kwargs["num_words"]
                                                    if kwargs["relation"] == "less than" else "Too short."),
        "keywords:existence": lambda: re.sub(re.escape(kwargs.get("keywords", [""])[0]), "", answer, flags=re.I),
        "keywords:forbidden_words": lambda: answer + " " + kwargs.get("forbidden_words", [""])[0],
        "startend:end_checker": lambda: answer + " More.",
        "startend:quotation": lambda: answer.strip('"'),
        "detectable_format:title": lambda: re.sub(r"<<[^\n]+>>", "", answer),
        "detectable_content:postscript": lambda: re.sub(r"(?im)^.*p\.s\..*$", "", answer),
        "detectable_format:number_bullet_lists": lambda: answer + "\n* one more",
    }[row["instruction_id_list"][0]]()


def test_instructions_are_scored_by_the_instructions_environment():
    from posttrain.environments.instructions_env import InstructionFollowingEnvironment

    env = InstructionFollowingEnvironment({})
    for n in (1, 2, 3):
        rows = records("instructions", num_validation=300, num_instructions=n)
        assert all(len(r["instruction_id_list"]) == len(r["kwargs"]) == n for r in rows)
        assert all(InstructionFollowingEnvironment.metadata_problem(env_metadata(r)) is None for r in rows)
        assert rewards(env, rows, [r["answer"] for r in rows]) == [1.0] * 300
        assert rewards(env, rows, [violate(r) for r in rows]) == [0.0] * 300
    ids = {i for r in records("instructions", num_validation=300) for i in r["instruction_id_list"]}
    assert len(ids) == 11
    only = records("instructions", instruction_ids=["punctuation:no_comma", "startend:quotation"], num_instructions=2)
    assert {tuple(sorted(r["instruction_id_list"])) for r in only} == {("punctuation:no_comma", "startend:quotation")}


@pytest.mark.skipif(NO_SANDBOX, reason="no sandbox")
def test_functions_are_scored_by_the_code_environment():
    from posttrain.environments.code_env import CodeEnvironment

    rows = records("functions", num_validation=300)
    assert all(len(r["tests"]) == 4 and r["answer"].startswith(f"```python\ndef {r['fn_name']}(") for r in rows)
    kinds = {"x)": "number", "a, b)": "number", "s)": "text", "xs)": "list"}
    assert {kinds[r["answer"].split("(", 1)[1].split(":")[0]] for r in rows} == {"number", "text", "list"}
    env = CodeEnvironment({})
    try:
        few = rows[:24]  # each test runs in a fresh sandbox
        assert rewards(env, few, [f"Here it is:\n{r['answer']}" for r in few]) == [1.0] * 24
        wrong = [f"```python\ndef {r['fn_name']}(*args):\n    return None\n```" for r in few]
        assert rewards(env, few, wrong) == [0.0] * 24
    finally:
        env.shutdown()


def test_calculator_tasks_are_scored_by_the_tools_environment_over_a_tool_call_episode():
    from posttrain.environments.tools.tool_env import ToolEnvironment

    env = ToolEnvironment({})
    try:
        for options in ({}, {"num_operands": 4, "num_digits": 2}, {"operations": ["div"], "num_operands": 3}):
            rows = records("calculator", **options)
            calls = [f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": r["expression"]}})}</tool_call>'
                     for r in rows]
            logs = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": c}] for r, c in zip(rows, calls)]
            first = env.step(logs, [env_metadata(r) for r in rows])
            assert [o["content"] for o in first.observations] == [r["answer"] for r in rows]  # the tool agrees
            assert not first.terminateds.any()
            for final, reward in ((lambda r: f"The result is \\boxed{{{r['answer']}}}.", 1.0),
                                  (lambda r: f"\\boxed{{{int(r['answer']) + 1}}}", 0.0)):
                episodes = [log + [observation, {"role": "assistant", "content": final(r)}]
                            for log, observation, r in zip(logs, first.observations, rows)]
                last = env.step(episodes, first.metadata)
                assert last.rewards.tolist() == [reward] * 60 and last.terminateds.all()
    finally:
        env.shutdown()


def test_generator_config_errors_name_the_key_and_the_closest_valid_name(tmp_path):
    with pytest.raises(ConfigError, match=r"data.generator.*'multple_choice' is not a task generator; did you mean 'multiple_choice'"):
        load_config("grpo", overrides=["data.dataset=generated", "data.generator=multple_choice"])
    with pytest.raises(ConfigError, match=r"data.blend\[0\].generator: 'word_problem' is not .* did you mean 'word_problems'"):
        load_config("grpo", overrides=["data.blend=[{name: a, dataset: generated, generator: word_problem}]"])
    with pytest.raises(ConfigError, match=r"data.dataset=generated needs data.generator"):
        load_config("grpo", overrides=["data.dataset=generated"])
    with pytest.raises(ConfigError, match=r"data.blend\[0\].generator is read only with data.blend\[0\].dataset=generated"):
        load_config("grpo", overrides=["data.blend=[{name: quiz, env: mcqa, generator: multiple_choice}]"])
    with pytest.raises(DataError, match=r"data.generator_options.operation: did you mean 'operations'\? .*takes \['operations'"):
        records("word_problems", operation=["add"])
    with pytest.raises(DataError, match=r"data.generator_options.operations=\['pow'\]: choose one or more of"):
        records("word_problems", operations="pow")
    with pytest.raises(DataError, match=r"data.generator_options.num_options=9: must be an integer from 2 to 5"):
        records("multiple_choice", num_options=9)
    with pytest.raises(DataError, match=r"data.generator='functions': asked for 20 train \+ 100 validation .* only 45"):
        records("functions", num_validation=100, kinds=["list"])
    cfg = load_config("grpo", overrides=["data.blend=[{name: a, dataset: generated, generator: calculator, "
                                         "generator_options: {num_digits: 9}}]"])
    with pytest.raises(DataError, match=r"data.blend\[0\].generator_options.num_digits=9: must be an integer from 2 to 6"):
        load_records(cfg.data, "train")
    # Your own generator, by import path: its rows go to data.env_name.
    (tmp_path / "my_gen.py").write_text(
        "def make(num_train, num_validation, seed, word='hi'):\n"
        "    rows = [{'prompt': f'{word} {i}', 'answer': str(i)} for i in range(num_train + num_validation)]\n"
        "    return rows[:num_train], rows[num_train:]\n")
    own = DataConfig(dataset="generated", generator=f"{tmp_path}/my_gen.py:make", num_train=3, num_validation=2,
                     generator_options={"word": "yo"}, env_name="echo")
    assert [(r["prompt"], r["task_name"], r["env_name"]) for r in load_records(own, "validation")] == [
        ("yo 3", "echo", "echo"), ("yo 4", "echo", "echo")]


def test_a_blend_of_every_generator_routes_rows_to_their_environments_and_passes_preflight():
    components = ", ".join(
        f"{{name: {name}, dataset: generated, generator: {name}, num_train: 40, num_validation: 10}}"
        for name in ("word_problems", "json_output", "instructions", "functions", "calculator"))
    cfg = load_config("grpo", overrides=[
        f"data.blend=[{components}, {{name: quiz, env: mcqa, weight: 2, dataset: generated, generator: multiple_choice, "
        "num_train: 40, num_validation: 10, generator_options: {num_options: 4}}]"])
    train, validation = load_records(cfg.data, "train"), load_records(cfg.data, "validation")
    routes = {(r["source"], r["task_name"], r["env_name"]) for r in train}
    assert routes == {("word_problems", "word_problems", "math"), ("json_output", "json_output", "structured"),
                      ("instructions", "instructions", "instructions"), ("functions", "functions", "code"),
                      ("calculator", "calculator", "tools"), ("quiz", "quiz", "mcqa")}
    assert len(train) == 240 and len(validation) == 60
    assert {r["source"]: r["source_weight"] for r in train}["quiz"] == 2.0
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in validation}
    assert all(len(r["options"]) == 4 for r in train if r["source"] == "quiz")
    check_envs(cfg, train + validation)  # every environment loads and accepts every row
    # One generated source alone: task <generator>, scored by its environment (data.env_name is math here).
    single = load_config("grpo", overrides=["data.dataset=generated", "data.generator=multiple_choice",
                                            "data.num_train=30", "data.num_validation=5"])
    rows = load_records(single.data, "train")
    assert {(r["task_name"], r["env_name"]) for r in rows} == {("multiple_choice", "mcqa")} and len(rows) == 30
    check_envs(single, rows)
