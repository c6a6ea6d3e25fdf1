"""Unit tests of the verifiable environments on hand-written responses: each must fail on a wrong
reward (a right answer scored 0 or a wrong one scored 1)."""

from __future__ import annotations

import json

import pytest

from posttrain.environments.code_env import CodeEnvConfig, extract_code, grade, parse_tests
from posttrain.environments.instructions_env import (
    InstructionFollowingEnvironment,
    InstructionsEnvConfig,
    check_instruction,
)
from posttrain.environments.mcqa_env import MCQAEnvConfig, MCQAEnvironment, extract_choice, option_map
from posttrain.environments.reasoning_gym_env import ReasoningGymEnvironment, extract_rg_answer
from posttrain.environments.sandbox import mode_problem
from posttrain.environments.structured_env import StructuredOutputEnvironment, strictify


def rewards(env, responses, metadata):
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]
    return env.step(logs, metadata if isinstance(metadata, list) else [metadata] * len(responses)).rewards.tolist()


# ------------------------------------------------------------------------------ multiple choice
OPTIONS = [{"A": "Paris"}, {"B": "London"}, {"C": "Rome"}, {"D": "Berlin"}]


def test_mcqa_strict_and_lenient_forms():
    letters = option_map(OPTIONS)
    assert option_map({"a": "x", "B": "y"}) == {"A": "x", "B": "y"} and option_map(["x", "y"]) == {"A": "x", "B": "y"}
    strict = {
        "so \\boxed{C}": "C", "\\boxed{(B)}": "B", "\\boxed{B) London}": "B", "Answer: D": "D",
        "The answer is (A).": "A", "<answer>C</answer>": "C", "\\boxed{Rome}": "C",
        "\\boxed{A or B}": None, "\\boxed{E}": None, "I think (B)": None, "B": None, "\\boxed{B) Paris}": None,
    }
    for text, letter in strict.items():
        assert extract_choice(text, letters, "strict") == letter, text
    lenient = {"I think (B)": "B", "B": "B", "Let me see...\nRome": "C", "(A) or (B)": None, "no idea": None}
    for text, letter in lenient.items():
        assert extract_choice(text, letters, "lenient") == letter, text
    assert extract_choice("Final: [[C]]", letters, regex=r"\[\[([A-D])\]\]") == "C"


def test_mcqa_rewards_and_bad_rows():
    env = MCQAEnvironment(MCQAEnvConfig())
    meta = {"options": OPTIONS, "ground_truth": "C"}
    assert rewards(env, ["\\boxed{C}", "\\boxed{B}", "Answer: C", "C", "Rome"], meta) == [1.0, 0.0, 1.0, 0.0, 0.0]
    nemo_gym = {"options": OPTIONS, "ground_truth": None, "expected_answer": "B",
                "template_metadata": {"output_regex": r"Final answer: ([A-D])"}}
    assert rewards(env, ["Final answer: B", "\\boxed{B}"], nemo_gym) == [1.0, 0.0]
    lenient = MCQAEnvironment({"grading_mode": "lenient"})
    assert rewards(lenient, ["C", "(C)", "(B)"], meta) == [1.0, 1.0, 0.0]
    assert MCQAEnvironment.metadata_problem({"options": OPTIONS, "ground_truth": "Z"}).startswith("the correct answer")
    assert MCQAEnvironment.metadata_problem({"ground_truth": "A"}).startswith("mcqa rows need")


# ------------------------------------------------------------------------------ structured output
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name"]}


def test_structured_output_strict_and_lenient():
    strict = StructuredOutputEnvironment({})
    meta = {"schema_str": json.dumps(SCHEMA)}
    responses = ['{"name": "Ada", "age": 36}', '```json\n{"name": "Ada", "age": 36}\n```', '{"name": "Ada"}',
                 '{"name": "Ada", "age": 36, "x": 1}', '{"name": "Ada", "age": -1}', "Sure! {\"name\": \"Ada\"}",
                 '{"name": "Ada", "age": "36"}']
    assert rewards(strict, responses, meta) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    loose = StructuredOutputEnvironment({"strict": False, "allow_code_fence": False})
    assert rewards(loose, responses, {"schema": SCHEMA}) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert strictify(SCHEMA)["required"] == ["age", "name"] and SCHEMA["required"] == ["name"]
    assert "invalid JSON Schema" in StructuredOutputEnvironment.metadata_problem({"schema": {"type": "nonsense"}})
    assert StructuredOutputEnvironment.metadata_problem({"schema_str": "{", "x": 1}).startswith("invalid JSON Schema")


# ------------------------------------------------------------------------------ instructions
@pytest.mark.parametrize("instruction,kwargs,good,bad", [
    ("keywords:existence", {"keywords": ["apple", "pie"]}, "Apple pie is great", "apple only"),
    ("keywords:frequency", {"keyword": "la", "frequency": 3, "relation": "at least"}, "la la la", "la la"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "a badge", "this is bad"),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "less than"}, "zoo", "zigzag"),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"}, "One. Two!", "A. B. C."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "one\n***\ntwo", "one\n***\n\n***\ntwo"),
    ("length_constraints:number_words", {"num_words": 4, "relation": "at least"}, "one two three four", "one two three"),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
     "first\n\n\"Then, more", "first\n\nnow then"),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name] at [address]", "Dear [name]"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n- c"),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* only"),
    ("detectable_format:multiple_sections", {"section_spliter": "SECTION", "num_sections": 2},
     "SECTION 1\na\nSECTION 2\nb", "SECTION 1 only"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("detectable_format:title", {}, "<<My Title>>\ntext", "My Title"),
    ("combination:two_responses", {}, "one******two", "one******one"),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi"}, "say hi. Hi!", "Hi! Say hi"),
    ("startend:end_checker", {"end_phrase": "Is there anything else?"}, "Done. Is there anything else?", "Is there anything else? Done."),
    ("startend:quotation", {}, '"quoted"', 'not "quoted"'),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"}, "GO NOW", "GO now"),
    ("change_case:english_capital", {}, "ALL CAPS", "Not caps"),
    ("change_case:english_lowercase", {}, "all lower", "Not lower"),
    ("punctuation:no_comma", {}, "no commas here", "one, two"),
])
def test_ifeval_checkers(instruction, kwargs, good, bad):
    assert check_instruction(instruction, good, kwargs) is True
    assert check_instruction(instruction, bad, kwargs) is False


def test_instruction_rewards_all_fraction_loose_and_bad_rows():
    meta = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
            "kwargs": [{}, {"num_words": 3, "relation": "at least", "unused": None}]}
    nemo_gym = {"verifier_metadata": meta}
    assert rewards(InstructionFollowingEnvironment({}), ["one two three", "one, two three", "one"], meta) == [1.0, 0.0, 0.0]
    assert rewards(InstructionFollowingEnvironment({"reward": "fraction"}), ["one, two three", "one, two"], nemo_gym) == [0.5, 0.0]
    lower = {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}
    assert rewards(InstructionFollowingEnvironment({}), ["Sure:\nall lower"], lower) == [0.0]
    assert rewards(InstructionFollowingEnvironment(InstructionsEnvConfig(loose=True)), ["Sure:\nall lower"], lower) == [1.0]
    problem = InstructionFollowingEnvironment.metadata_problem(
        {"instruction_id_list": ["language:response_language"], "kwargs": [{"language": "en"}]})
    assert "unsupported instruction" in problem
    assert "bad arguments" in InstructionFollowingEnvironment.metadata_problem(
        {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"oops": 1}]})


# ------------------------------------------------------------------------------ reasoning-gym
def test_reasoning_gym_extraction_strict_and_scorer_errors():
    pytest.importorskip("reasoning_gym")
    assert extract_rg_answer("think <answer> 7 </answer>") == "7"
    assert extract_rg_answer("so \\boxed{12}") == "12" and extract_rg_answer("  42 ") == "42"
    assert extract_rg_answer("42", "answer_tag") is None and extract_rg_answer("", "auto") is None
    # last_number: a number task answered in a sentence (the nemotron_mini recipe's letter counting)
    assert extract_rg_answer('The letter "l" appears 3 times in the text.', "last_number") == "3"
    assert extract_rg_answer("none", "last_number") is None
    spec = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "seed": 4, "size": 3, "index": 1}
    env = ReasoningGymEnvironment({})
    entry, _ = env._entry_and_scorer({"reasoning_gym": spec})
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert rewards(env, [f"<answer>{right}</answer>", f"\\boxed{{{right}}}", right, wrong, ""],
                   {"reasoning_gym": spec}) == [1.0, 1.0, 1.0, 0.0, 0.0]
    # NeMo-Gym's shape; strict mode refuses the scorer's partial credit (gold "1", answer "11")
    row = {"question": "GCD?", "ground_truth": "1", "metadata": {"source_dataset": "gcd"}}
    partial = ReasoningGymEnvironment({"strict": False})
    assert rewards(env, ["1", "11"], row) == [1.0, 0.0]
    assert 0.0 < rewards(partial, ["11"], row)[0] < 1.0

    def broken(answer, entry):
        raise RuntimeError("scorer bug")

    env._entry_and_scorer = lambda meta: (entry, broken)
    assert rewards(env, [right], {"reasoning_gym": spec}) == [0.0] and env.scorer_errors == 1


def test_reasoning_gym_records_have_disjoint_splits():
    pytest.importorskip("reasoning_gym")
    from posttrain.config.schema import DataConfig
    from posttrain.data.datasets import load_records

    cfg = DataConfig(dataset="reasoning_gym", seed=3, reasoning_gym=[
        {"name": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 4}, "size": 40, "val_size": 20,
         "prompt_template": "{word}"},
        {"name": "chain_sum", "size": 10, "val_size": 5, "weight": 3}])
    train, val = load_records(cfg, "train"), load_records(cfg, "validation")
    assert len(train) == 50 and {r["task_name"] for r in train} == {"spell_backward", "chain_sum"}
    assert {r["env_name"] for r in train} == {"reasoning_gym"}
    spell = [r for r in train if r["task_name"] == "spell_backward"]
    assert all(r["prompt"][::-1] == r["answer"] for r in spell)  # the template used the entry's word
    assert {r["reasoning_gym"]["seed"] for r in train} == {3} and {r["reasoning_gym"]["seed"] for r in val} == {3 + 10**7}
    questions = {(r["task_name"], r["prompt"]) for r in train}
    assert 15 < len(val) <= 25 and not any((r["task_name"], r["prompt"]) in questions for r in val)
    assert {r["source"]: r["source_weight"] for r in train} == {"spell_backward": 1.0, "chain_sum": 3.0}


# ------------------------------------------------------------------------------ code
def test_code_extraction_and_test_parsing():
    text = "Here:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n" and extract_code("<code>x=1</code>") == "x=1"
    assert extract_code("no code") is None and extract_code("print(3)", "raw") == "print(3)"
    assert parse_tests({"tests": [{"input": "1", "output": "2"}]}) == (["1"], ["2"], None)
    lcb = {"verifier_metadata": {"unit_tests": {"inputs": ["[1, 2]\n3"], "outputs": ["[4, 5]"], "fn_name": "add"}}}
    assert parse_tests(lcb) == ([[[1, 2], 3]], [[4, 5]], "add")


@pytest.mark.skipif(mode_problem("bwrap") is not None and mode_problem("unshare") is not None, reason="no sandbox")
def test_code_grading_styles_and_rewards():
    cfg = CodeEnvConfig(timeout_s=60.0)  # only correct-or-wrong programs here: no limit is meant to fire
    mode = "bwrap" if mode_problem("bwrap") is None else "unshare"
    inputs, outputs = ["1 2", "5 5", "0 3"], ["3", "10", "3"]
    assert grade("a, b = map(int, input().split())\nprint(a + b)", inputs, outputs, None, cfg, mode) == (3, 3, "")
    assert grade("a, b = map(int, input().split())\nprint(a * b)", inputs, outputs, None, cfg, mode) == (0, 3, "wrong_answer")
    assert grade("print(int(input().split()[0]) + 2)", inputs, outputs, None, cfg, mode)[0] == 1
    fn = "def add(xs, k):\n    return [x + k for x in xs]"
    assert grade(fn, [[[1, 2], 3], {"xs": [0], "k": 1}], [[4, 5], [1]], "add", cfg, mode) == (2, 2, "")
    assert grade(fn, [[[1, 2], 3]], [[4, 6]], "add", cfg, mode) == (0, 1, "wrong_answer")
    assert grade("def other(): pass", [[1]], [1], "add", cfg, mode)[2] == "load_error"
    assert grade("def add(x):\n    return True", [[1]], [1], "add", cfg, mode)[0] == 0  # True is not 1


@pytest.mark.skipif(mode_problem("bwrap") is not None and mode_problem("unshare") is not None, reason="no sandbox")
def test_shipped_code_tasks_reference_solutions_pass_and_wrong_ones_fail():
    from pathlib import Path

    from posttrain.data.datasets import env_metadata, load_jsonl
    from posttrain.environments.code_env import CodeEnvironment

    rows = load_jsonl(Path(__file__).resolve().parents[2] / "examples/data/code_tasks.jsonl")
    assert len(rows) >= 10 and any("fn_name" in r for r in rows) and any("fn_name" not in r for r in rows)
    env = CodeEnvironment({"timeout_s": 60.0})  # right and wrong programs, none meant to run out of time
    try:
        metadata = [env_metadata(r) for r in rows]
        assert rewards(env, [r["answer"] for r in rows], metadata) == [1.0] * len(rows)
        assert rewards(env, ["```python\nprint(0)\ndef f(*a): return 0\n```"] * len(rows), metadata) == [0.0] * len(rows)
    finally:
        env.shutdown()


# ------------------------------------------------------------------------------ NeMo-Gym rows
def test_nemo_gym_rows_load_directly(tmp_path, tokenizer):
    from posttrain.config.schema import DataConfig
    from posttrain.data.datasets import env_metadata, load_records
    from posttrain.data.processors import build_prompt_message_log

    def row(text, **fields):
        return {"responses_create_params": {"input": [{"role": "developer", "content": "Be brief."},
                                                     {"role": "user", "content": text}]},
                "agent_ref": {"type": "responses_api_agents", "name": "x"}, **fields}

    rows = [
        row("2+2?", question="2+2?", expected_answer="4"),
        row("Capital of Italy?", options=OPTIONS, expected_answer="C", grading_mode="strict"),
        row("Say hi", verifier_metadata={"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}),
        row("JSON please", schema_str=json.dumps(SCHEMA), schema_type="json"),
        row("Add", verifier_metadata={"unit_tests": {"inputs": ["1 2"], "outputs": ["3"]}}),
        row("GCD?", question="GCD?", answer="1", metadata={"source_dataset": "gcd"}),
        row("Mine", task_name="custom", expected_answer="x"),
    ]
    path = tmp_path / "gym.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_records(DataConfig(dataset="jsonl", train_path=str(path)), "train")
    assert [r["task_name"] for r in records] == ["math", "mcqa", "instructions", "structured", "code", "reasoning_gym", "custom"]
    assert [r["answer"] for r in records][:2] == ["4", "C"] and records[0]["prompt"] == "2+2?"
    meta = env_metadata(records[1])
    assert meta["ground_truth"] == "C" and meta["options"] == OPTIONS and "responses_create_params" not in meta
    datum = build_prompt_message_log(records[0], tokenizer, 128)
    assert datum.prompt == "<|system|>Be brief.<|end|><|user|>2+2?<|end|><|assistant|>"
    env = MCQAEnvironment({})
    assert rewards(env, ["\\boxed{C}", "\\boxed{A}"], meta) == [1.0, 0.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"responses_create_params": {"input": [{"role": "tool"}]}}) + "\n")
    from posttrain.data.datasets import DataError

    with pytest.raises(DataError, match="bad.jsonl:1: responses_create_params.input"):
        load_records(DataConfig(dataset="jsonl", train_path=str(bad)), "train")


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.models.tiny import build_tokenizer

    return build_tokenizer()
