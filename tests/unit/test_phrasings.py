"""Phrasings of the generated tasks (`data.phrasings`) and named validation sets
(`data.validation_sets`): every shipped generator words its prompts from at least five seen and two
held-out templates per part, drawn by the seed on a stream of their own (the problems stay the
same); the held-out split shares no template with training; the environment scores a reply that
follows each answer instruction as correct; the nemotron_mini recipe validates on both wordings of
the same held-out problems, disjoint from training."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from posttrain.config.loader import ConfigError, load_config
from posttrain.config.schema import DataConfig, validation_set
from posttrain.data.datasets import env_metadata, load_records
from posttrain.data.generators import TASK_GENERATORS, base
from posttrain.data.generators import calculator, functions, instructions, json_output, multiple_choice, word_problems
from posttrain.environments.sandbox import mode_problem
from posttrain.errors import DataError
from posttrain.evals.task_table import format_task_table
from posttrain.utils.metric_names import in_validation_set

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples/recipes/nemotron_mini.yaml"
NO_SANDBOX = mode_problem("bwrap") is not None and mode_problem("unshare") is not None
MODULES = {"word_problems": word_problems, "multiple_choice": multiple_choice, "json_output": json_output,
           "instructions": instructions, "functions": functions, "calculator": calculator}
# Options under which a generator uses every one of its phrasing lists (two-step word problems have
# a question list of their own; every constraint is drawn).
WIDE = {"word_problems": [{"operations": ["add", "sub", "mul", "div"]}, {"steps": 2}],
        "instructions": [{}, {"num_instructions": 3}]}


def phrasings_of(module) -> dict[str, base.Phrasings]:
    """Every `Phrasings` a generator module defines, by name (`TEMPLATES[add]`, `INSTRUCTIONS`)."""
    found = {}
    for name, value in vars(module).items():
        if isinstance(value, base.Phrasings):
            found[name] = value
        elif isinstance(value, dict):
            found.update({f"{name}[{k}]": v for k, v in value.items() if isinstance(v, base.Phrasings)})
    return found


def drawn(monkeypatch, name: str, phrasings: str, seeds=range(4), num: int = 150) -> tuple[dict[int, set], list[dict]]:
    """(templates drawn per `Phrasings` (by id), every row) of generator `name` over `seeds`."""
    seen: dict[int, set] = defaultdict(set)
    call = base.Phraser.__call__

    def record(self, options):
        template = call(self, options)
        seen[id(options)].add(template)
        return template

    monkeypatch.setattr(base.Phraser, "__call__", record)
    rows = []
    for seed in seeds:
        for options in WIDE.get(name, [{}]):
            train, validation = TASK_GENERATORS[name](num, 40, seed, phrasings=phrasings, **options)
            rows += train + validation
    monkeypatch.setattr(base.Phraser, "__call__", call)
    return seen, rows


@pytest.mark.parametrize("name", sorted(TASK_GENERATORS))
def test_every_generator_draws_five_seen_and_two_unseen_templates_of_each_part(monkeypatch, name):
    lists = phrasings_of(MODULES[name])
    assert "INSTRUCTIONS" in lists or "CONSTRAINTS[punctuation:no_comma]" in lists  # how to answer
    for key, options in lists.items():
        assert len(set(options.seen)) >= 5 and len(set(options.unseen)) >= 2, key
        assert not set(options.seen) & set(options.unseen), key
    seen, _ = drawn(monkeypatch, name, "seen")
    unseen, _ = drawn(monkeypatch, name, "unseen")
    for key, options in lists.items():  # the rows really use every template, each in its split only
        assert seen[id(options)] == set(options.seen), key
        assert unseen[id(options)] == set(options.unseen), key
        assert len(seen[id(options)]) >= 5, key


@pytest.mark.parametrize("name", sorted(TASK_GENERATORS))
def test_seen_and_unseen_phrasings_give_the_same_problems_in_other_words(name):
    fn = TASK_GENERATORS[name]
    for options in WIDE.get(name, [{}]):
        seen, unseen, every = (fn(200, 50, 3, phrasings=p, **options) for p in ("seen", "unseen", "all"))
        for a, b, c in zip(seen, unseen, every):  # train, then validation: row for row, all but the prompt
            strip = lambda rows: [{k: v for k, v in r.items() if k != "prompt"} for r in rows]  # noqa: E731
            assert strip(a) == strip(b) == strip(c)
            assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b))
    with pytest.raises(base.OptionError, match=r"phrasings='some': choose one of \['all', 'seen', 'unseen'\]"):
        fn(1, 1, 0, phrasings="some")


def test_distinct_rows_keeps_a_problem_out_of_both_splits_in_any_wording():
    def make_row(rng, phrase):  # ten problems, each in up to seven wordings
        problem = rng.randrange(10)
        return problem, {"prompt": f"{phrase(word_problems.FINAL_QUESTIONS)} #{problem}", "problem": problem}

    train, validation = base.distinct_rows(6, 4, 0, make_row, "toy")
    assert sorted(r["problem"] for r in train + validation) == list(range(10))
    with pytest.raises(ValueError, match=r"asked for 7 train \+ 4 validation distinct tasks, but toy makes only about 10"):
        base.distinct_rows(7, 4, 0, make_row, "toy")


def reply_of(module, row: dict) -> tuple[base.Reply, str]:
    """The answer instruction a row's prompt ends with, and a reply that follows it."""
    [instruction] = [i for i in module.INSTRUCTIONS.seen + module.INSTRUCTIONS.unseen if row["prompt"].endswith(i.text)]
    if module is functions:
        return instruction, instruction.reply.format(code=row["answer"].removeprefix("```python\n").removesuffix("```"))
    return instruction, instruction.reply.format(answer=row["answer"])


def one_row_per_instruction(module, rows: list[dict]) -> list[tuple[dict, str]]:
    """(a row, the reply its instruction asks for) for the first row of each answer instruction;
    every instruction of the module is among them."""
    first = {}
    for row in rows:
        instruction, reply = reply_of(module, row)
        first.setdefault(instruction, (row, reply))
    assert set(first) == set(module.INSTRUCTIONS.seen + module.INSTRUCTIONS.unseen)
    return list(first.values())


def scores(env, pairs: list[tuple[dict, str]]) -> list[float]:
    logs = [[{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": reply}] for row, reply in pairs]
    return env.step(logs, [env_metadata(row) for row, _ in pairs]).rewards.tolist()


def test_the_math_environment_scores_a_reply_in_every_phrasing_of_the_instruction_as_correct():
    from posttrain.environments.math_env import MathEnvironment

    rows = word_problems.word_problems(300, 0, 1, operations=["add", "sub", "mul", "div"])[0]
    pairs = one_row_per_instruction(word_problems, rows)
    for answer_format in ("auto", "last_number"):  # the default, and the nemotron_mini recipe's
        env = MathEnvironment({"answer_format": answer_format})
        try:
            assert scores(env, pairs) == [1.0] * 7
            wrong = [(row, reply_of(word_problems, dict(row, answer=str(int(row["answer"]) + 1)))[1]) for row, _ in pairs]
            assert scores(env, wrong) == [0.0] * 7  # the number the reply gives is what counts
        finally:
            env.shutdown()


def test_the_mcqa_environment_scores_a_reply_in_every_phrasing_of_the_instruction_as_correct():
    from posttrain.environments.mcqa_env import MCQAEnvironment

    pairs = one_row_per_instruction(multiple_choice, multiple_choice.multiple_choice(300, 0, 1, num_options=4)[0])
    env = MCQAEnvironment({})  # strict grading
    assert scores(env, pairs) == [1.0] * 7
    other = {"A": "B", "B": "C", "C": "D", "D": "A"}
    assert scores(env, [(dict(row, answer=other[row["answer"]]), reply) for row, reply in pairs]) == [0.0] * 7


def test_the_structured_environment_scores_a_reply_in_every_phrasing_of_the_instruction_as_correct():
    from posttrain.environments.structured_env import StructuredOutputEnvironment

    pairs = one_row_per_instruction(json_output, json_output.json_output(300, 0, 1)[0])
    env = StructuredOutputEnvironment({})
    assert scores(env, pairs) == [1.0] * 7
    assert sum("```json" in reply for _, reply in pairs) == 2  # the fenced replies are among them
    assert scores(env, [(row, reply.replace("}", ', "extra": 1}')) for row, reply in pairs]) == [0.0] * 7


@pytest.mark.skipif(NO_SANDBOX, reason="no sandbox")
def test_the_code_environment_scores_a_reply_in_every_phrasing_of_the_instruction_as_correct():
    from posttrain.environments.code_env import CodeEnvironment

    pairs = one_row_per_instruction(functions, functions.functions(300, 0, 1)[0])
    assert {reply.split("\n")[0] for _, reply in pairs} >= {"```python", "<code>", "Here it is:"}
    env = CodeEnvironment({})
    try:
        assert scores(env, pairs) == [1.0] * 7
    finally:
        env.shutdown()


def test_the_tools_environment_scores_a_final_answer_in_every_phrasing_of_the_instruction_as_correct():
    from posttrain.environments.tools.tool_env import ToolEnvironment

    pairs = one_row_per_instruction(calculator, calculator.calculator(300, 0, 1, num_digits=2)[0])
    env = ToolEnvironment({"math": {"answer_format": "auto"}})
    try:
        for right in (True, False):
            logs, metadata = [], []
            for row, reply in pairs:
                call = json.dumps({"name": "calculator", "arguments": {"expression": row["expression"]}})
                log = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}]
                first = env.step([log], [env_metadata(row)])
                assert first.observations[0]["content"] == row["answer"]  # the tool's result
                final = reply if right else reply_of(calculator, dict(row, answer=str(int(row["answer"]) + 1)))[1]
                logs.append(log + [first.observations[0], {"role": "assistant", "content": final}])
                metadata.append(first.metadata[0])
            assert env.step(logs, metadata).rewards.tolist() == [float(right)] * 7
    finally:
        env.shutdown()


def test_the_instructions_environment_scores_the_reference_in_every_phrasing_of_every_constraint(monkeypatch):
    from posttrain.environments.instructions_env import InstructionFollowingEnvironment

    seen, rows = drawn(monkeypatch, "instructions", "all", seeds=[0], num=700)
    for key, options in phrasings_of(instructions).items():
        assert seen[id(options)] == set(options.seen + options.unseen), key  # every wording was drawn
    env = InstructionFollowingEnvironment({})
    responses = [r["answer"] for r in rows]
    logs = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": a}] for r, a in zip(rows, responses)]
    assert env.step(logs, [env_metadata(r) for r in rows]).rewards.tolist() == [1.0] * len(rows)


# ----------------------------------------------------------------------------- the recipe's data
def recipe_records(config) -> dict[str, list[dict]]:
    return {"train": load_records(config.data, "train"), "validation": load_records(config.data, "validation"),
            "unseen": load_records(validation_set(config.data, "unseen_phrasing"), "validation")}


def test_the_recipe_validates_on_the_same_held_out_problems_in_seen_and_unseen_wordings():
    pytest.importorskip("reasoning_gym")
    config = load_config("grpo", RECIPE)
    assert config.data.phrasings == "seen" and config.data.validation_sets == {"unseen_phrasing": {"phrasings": "unseen"}}
    splits = recipe_records(config)
    tasks = {"math", "quiz", "json", "follow", "code", "calc", "basic_arithmetic"}
    for split, records in splits.items():
        assert {r["task_name"] for r in records} == tasks, split
    # The two validation sets: the same problems (answers, tests, schemas ...), none in another's wording.
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k not in ("prompt", "origin")}, sort_keys=True)  # noqa: E731
    assert [strip(r) for r in splits["validation"]] == [strip(r) for r in splits["unseen"]]
    assert not {r["prompt"] for r in splits["unseen"]} & {r["prompt"] for r in splits["train"] + splits["validation"]}
    # Disjoint from training in problems, whatever the wording (what tells each task's problems apart).
    identity = {"calc": "expression", "code": "fn_name", "json": "schema_str"}
    for task, field in identity.items():
        train = {r[field] for r in splits["train"] if r["task_name"] == task}
        assert not train & {r[field] for r in splits["unseen"] if r["task_name"] == task}, task
    follow = lambda r: json.dumps([r["instruction_id_list"], r["kwargs"], r["answer"]])  # noqa: E731
    assert not {follow(r) for r in splits["train"] if r["task_name"] == "follow"} & \
        {follow(r) for r in splits["unseen"] if r["task_name"] == "follow"}
    question = lambda r: re.search(r"\d+ \+ \d+", r["prompt"]).group(0)  # noqa: E731
    assert not {question(r) for r in splits["train"] if r["task_name"] == "basic_arithmetic"} & \
        {question(r) for r in splits["unseen"] if r["task_name"] == "basic_arithmetic"}


def test_the_recipes_arithmetic_templates_are_five_seen_two_unseen_and_all_scored():
    pytest.importorskip("reasoning_gym")
    from posttrain.environments.reasoning_gym_env import ReasoningGymEnvironment

    config = load_config("grpo", RECIPE)
    [task] = next(c for c in config.data.blend if c["name"] == "arith")["reasoning_gym"]
    seen, unseen = task["prompt_template"], task["unseen_prompt_template"]
    assert len(set(seen)) == 5 and len(set(unseen)) == 2 and not set(seen) & set(unseen)
    pattern = {t: re.compile(re.escape(t).replace(r"\{question\}", "Calculate .+").replace(r"\{expression\}", r"\d+ \+ \d+"))
               for t in seen + unseen}
    arith = config.data.model_copy(update={"phrasings": "all"})
    rows = [r for r in load_records(arith, "validation") if r["task_name"] == "basic_arithmetic"]
    used = {t for r in rows for t, p in pattern.items() if p.fullmatch(r["prompt"])}
    assert used == set(seen + unseen)
    train_unseen = [r for r in load_records(config.data.model_copy(update={"phrasings": "seen"}), "train")
                    if r["task_name"] == "basic_arithmetic" and any(pattern[t].fullmatch(r["prompt"]) for t in unseen)]
    assert not train_unseen
    env = ReasoningGymEnvironment(config.env.section("reasoning_gym"))  # strict, last number
    logs = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": f"{question} = {r['answer']}"}]
            for r in rows for question in [re.search(r"\d+ \+ \d+", r["prompt"]).group(0)]]
    assert env.step(logs, [env_metadata(r) for r in rows]).rewards.tolist() == [1.0] * len(rows)


# ------------------------------------------------------------------------------ config and metrics
def test_validation_sets_and_phrasings_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.validation_sets.unseen.phrasings: Input should be 'all', 'seen' or 'unseen'"):
        load_config("grpo", overrides=["data.validation_sets={unseen: {phrasings: none}}"])
    with pytest.raises(ConfigError, match=r"data.validation_sets.bad-name: a validation set's name is letters"):
        load_config("grpo", overrides=["data.validation_sets={bad-name: {}}"])
    with pytest.raises(ConfigError, match=r"data.validation_sets.a.validation_sets: validation sets do not nest"):
        load_config("grpo", overrides=["data.validation_sets={a: {validation_sets: {b: {}}}}"])
    with pytest.raises(ConfigError, match=r"data.validation_sets.a.blend\[0\].reasoning_gym\[0\].unseen_prompt_template is "
                                          r"needed with data.validation_sets.a.blend\[0\].phrasings=unseen"):
        load_config("grpo", overrides=["data.blend=[{name: rg, dataset: reasoning_gym, reasoning_gym: [{name: chain_sum}]}]",
                                       "data.validation_sets={a: {phrasings: unseen}}"])
    with pytest.raises(DataError, match=r"data.generator_options.phrasings: set data.phrasings instead"):
        load_records(DataConfig(dataset="generated", generator="calculator", generator_options={"phrasings": "seen"}), "train")
    (tmp_path / "my_gen.py").write_text("def make(num_train, num_validation, seed):\n"
                                        "    return [{'prompt': 'p', 'answer': '1'}] * num_train, []\n")
    own = DataConfig(dataset="generated", generator=f"{tmp_path}/my_gen.py:make", phrasings="seen", env_name="math")
    with pytest.raises(DataError, match=r"data.phrasings='seen': the generator .* takes no 'phrasings' argument"):
        load_records(own, "train")
    # A set's keys replace the section's, and a blend's components inherit them.
    cfg = load_config("grpo", overrides=["data.dataset=generated", "data.generator=calculator", "data.num_validation=5",
                                         "data.phrasings=seen", "data.validation_sets={other: {phrasings: unseen, seed: 3}}"])
    other = validation_set(cfg.data, "other")
    assert (other.phrasings, other.seed, other.validation_sets) == ("unseen", 3, {})
    assert len(load_records(other, "validation")) == 5


def test_a_validation_sets_metrics_are_a_family_and_a_column_of_their_own():
    metrics = {"validation/accuracy_greedy": 0.5, "validation/accuracy_greedy/a": 0.25,
               "validation/accuracy_greedy_count/a": 4.0, "validation/accuracy_greedy/b": 0.75,
               "validation/accuracy_greedy_count/b": 4.0}
    unseen = in_validation_set({k: v / 2 for k, v in metrics.items() if "_count" not in k} |
                               {k: v for k, v in metrics.items() if "_count" in k}, "unseen_phrasing")
    assert unseen["validation_unseen_phrasing/accuracy_greedy/a"] == 0.125
    table = format_task_table(metrics | unseen).splitlines()
    assert table[0].split() == ["task", "n", "accuracy_greedy", "unseen_phrasing/accuracy_greedy"]
    assert table[1].split() == ["a", "4", "0.250", "0.125"] and table[-1].split() == ["all", "8", "0.500", "0.250"]
