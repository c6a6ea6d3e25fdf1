"""Synthetic arithmetic, dataset loading and processors (prompt and SFT datums)."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Iterable

import pytest

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import generate_arithmetic
from posttrain.data.datasets import DataError, load_jsonl, load_records
from posttrain.data.message_log import flatten_message_logs
from posttrain.data.processors import PROCESSORS, build_prompt_message_log, build_sft_example
from posttrain.models.tiny import build_tokenizer


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write one JSON object per line (parent directories are created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


PROBLEM = re.compile(r"^(\d+)([+*-])(\d+)=$")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# ------------------------------------------------------------------------------- arithmetic
def test_arithmetic_answers_are_correct():
    train, val = generate_arithmetic(300, 100, operations=("add", "sub", "mul"), num_digits=3, seed=0)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    seen_symbols = set()
    for record in train + val:
        a, symbol, b = PROBLEM.match(record["prompt"]).groups()
        assert int(a) < 1000 and int(b) < 1000
        assert record["answer"] == str(ops[symbol](int(a), int(b)))
        seen_symbols.add(symbol)
    assert seen_symbols == {"+", "-", "*"}
    assert any(r["answer"].startswith("-") for r in train + val)  # negatives allowed for sub
    record = generate_arithmetic(1, 0)[0][0]
    assert record.keys() == {"prompt", "answer", "a", "b", "op"}
    assert record["prompt"] == f"{record['a']}{record['op']}{record['b']}=" and record["answer"] == str(record["a"] + record["b"])


def test_arithmetic_is_disjoint_distinct_and_deterministic():
    train, val = generate_arithmetic(90, 10, num_digits=1, seed=7)  # all 100 one-digit additions
    prompts = [r["prompt"] for r in train + val]
    assert len(set(prompts)) == 100 and not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert generate_arithmetic(90, 10, num_digits=1, seed=7) == (train, val)
    assert generate_arithmetic(90, 10, num_digits=1, seed=8) != (train, val)
    big_train, _ = generate_arithmetic(50, 5, num_digits=12, seed=7)  # 10**24 problems: sparse path
    assert len({r["prompt"] for r in big_train}) == 50
    assert big_train == generate_arithmetic(50, 5, num_digits=12, seed=7)[0]


def test_arithmetic_rejects_impossible_requests():
    with pytest.raises(ValueError, match="only 100"):
        generate_arithmetic(95, 10, num_digits=1)
    with pytest.raises(ValueError, match="div"):
        generate_arithmetic(1, 1, operations=("div",))


# ------------------------------------------------------------------------------ loading
def test_load_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4,}\n')
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:3: invalid JSON"):
        load_jsonl(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"question": "2+2=", "answer": "4"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:3: missing key 'prompt'"):
        load_jsonl(path, required_keys=("prompt",))
    with pytest.raises(DataError, match=r"data.jsonl:3: missing key 'prompt' \(data.prompt_key\)"):
        load_records(DataConfig(dataset="jsonl", train_path=str(path)), "train")
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match="data.jsonl:1: expected a JSON object"):
        load_jsonl(path)
    with pytest.raises(DataError, match="no such JSONL file"):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}: is a directory, not a JSONL file$"):
        load_jsonl(tmp_path)


def test_a_byte_order_mark_is_accepted_and_a_null_answer_is_refused_at_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'.encode("utf-8-sig"))
    assert [r["answer"] for r in load_records(DataConfig(dataset="jsonl", train_path=str(path)), "train")] == ["2", "4"]
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: 'answer' \(data.answer_key\) is null"):
        load_records(DataConfig(dataset="jsonl", train_path=str(path)), "train")


def test_load_records_jsonl_maps_keys_and_applies_template(tmp_path):
    path = write_jsonl([{"q": "1+1=", "a": 2, "level": "easy"}, {"q": "5+5=", "a": "10", "level": "hard"}],
                       tmp_path / "sub" / "train.jsonl")
    cfg = DataConfig(dataset="jsonl", train_path=str(path), prompt_key="q", answer_key="a",
                     prompt_template="[{level}] {prompt}", env_name="arith")
    records = load_records(cfg, "train")
    assert [(r["prompt"], r["answer"], r["task_name"]) for r in records] == [
        ("[easy] 1+1=", "2", "arith"), ("[hard] 5+5=", "10", "arith")]
    assert load_records(cfg, "validation") == []  # no validation_path
    bad = cfg.model_copy(update={"prompt_template": "{prompt} {missing}"})
    with pytest.raises(DataError, match=r"train.jsonl:1: data.prompt_template .* KeyError: 'missing'"):
        load_records(bad, "train")
    with pytest.raises(DataError, match="data.train_path is required"):
        load_records(DataConfig(dataset="jsonl"), "train")


def test_load_records_arithmetic_splits():
    cfg = DataConfig(num_train=40, num_validation=8, seed=3)
    train, val = load_records(cfg, "train"), load_records(cfg, "validation")
    expected_train, expected_val = generate_arithmetic(40, 8, ["add"], 2, 3)
    assert [r["prompt"] for r in train] == [r["prompt"] for r in expected_train]
    assert [r["answer"] for r in val] == [r["answer"] for r in expected_val]
    assert {r["task_name"] for r in train + val} == {"math"}


def test_load_records_hf_local_json_file(tmp_path):
    path = write_jsonl([{"question": "3+4=", "solution": 7}], tmp_path / "hf.jsonl")
    cfg = DataConfig(dataset="hf", train_path=str(path), prompt_key="question", answer_key="solution")
    assert [(r["prompt"], r["answer"]) for r in load_records(cfg, "train")] == [("3+4=", "7")]


def test_repeated_validation_problems_are_scored_once_training_repeats_kept(tmp_path, capsys):
    rows = [
        {"prompt": "1+1=", "answer": 2},
        {"prompt": "2+2=", "answer": 4},
        {"prompt": "1+1=", "answer": "2", "id": 7},  # a repeat (the answer as text, another id)
        {"prompt": "1+1=", "answer": 3},  # same prompt, another answer: another problem
        {"prompt": "1+1=", "answer": 2, "task_name": "mcqa"},  # another task
        {"prompt": "3+3=", "answer": 6},
        {"prompt": "2+2=", "answer": 4},  # a repeat
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}], "answer": 2},
        {"prompt": "Guess the word.", "answer": None, "task_name": "game", "game_seed": 1},
        {"prompt": "Guess the word.", "answer": None, "task_name": "game", "game_seed": 2},  # no answer: its seed tells
        {"prompt": "Guess the word.", "answer": None, "task_name": "game", "game_seed": 1},  # a repeat
    ]
    write_jsonl(rows, tmp_path / "rows.jsonl")
    cfg = DataConfig(dataset="jsonl", train_path=str(tmp_path / "rows.jsonl"), validation_path=str(tmp_path / "rows.jsonl"))
    val = load_records(cfg, "validation")
    # The first of each problem, in order (the row's origin names its line).
    assert [r["origin"].rsplit(":", 1)[1] for r in val] == ["1", "2", "4", "5", "6", "8", "9", "10"]
    assert len(load_records(cfg, "train")) == len(rows)
    load_records(cfg, "validation")  # loaded again (preflight, then the job's set-up): said once
    assert capsys.readouterr().out == "[posttrain] validation: 3 repeated problems dropped (11 rows, 8 distinct)\n"


# --------------------------------------------------------------------------- processors
def test_prompt_datum_with_chat_template(tokenizer):
    record = {"prompt": "12+34=", "answer": "46", "task_name": "math"}
    datum = build_prompt_message_log(record, tokenizer, max_seq_length=64, system_prompt="Add.", idx=5)
    (message,) = datum.message_log
    assert message["role"] == "user" and message["content"] == "<|system|>Add.<|end|><|user|>12+34=<|end|><|assistant|>"
    assert message["token_ids"].tolist() == tokenizer(message["content"], add_special_tokens=False)["input_ids"]
    assert message["token_ids"].tolist()[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert datum.prompt_length == 1 + 4 + 1 + 1 + 6 + 1 + 1 and datum.prompt == message["content"]
    assert (datum.extra_env_info, datum.loss_multiplier, datum.idx, datum.task_name, datum.env_name) == (
        {"ground_truth": "46"}, 1.0, 5, "math", "math")
    assert (datum.reward, datum.advantage, datum.sample_mask) == (0.0, 0.0, 1.0)  # set by rollout and GRPO
    assert PROCESSORS["math"] is build_prompt_message_log


def test_prompt_datum_without_chat_template(tokenizer):
    datum = build_prompt_message_log({"prompt": "1+2=", "answer": "3"}, tokenizer, 64, use_chat_template=False)
    assert datum.message_log[0]["content"] == "1+2=" and datum.prompt_length == 4


def test_over_long_prompt_is_truncated_and_masked_without_a_warning_per_row(tokenizer):
    record = {"prompt": "1+" * 50 + "1=", "answer": "51"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preflight counts such rows per file (data/row_lengths.py)
        datum = build_prompt_message_log(record, tokenizer, max_seq_length=32, idx=17)
    assert datum.loss_multiplier == 0.0 and datum.prompt_length == 4
    assert datum.message_log[0]["token_ids"].tolist() == [5, 25, 19, 25]  # <|user|>1+1
    assert datum.message_log[0]["content"] == "<|user|>1+1"


def test_sft_example_trains_on_answer_and_end_token(tokenizer):
    datum = build_sft_example({"prompt": "12+34=", "answer": "46"}, tokenizer, max_seq_length=64, idx=2)
    user, assistant = datum["message_log"]
    assert user["content"] == "<|user|>12+34=<|end|><|assistant|>" and not user.get("loss")
    assert assistant["content"] == "46<|end|>" and assistant["loss"] is True
    assert assistant["token_ids"].tolist() == [28, 30, 3]
    assert datum["length"] == 9 + 3 and datum["loss_multiplier"] == 1.0
    flat = flatten_message_logs([datum["message_log"]], tokenizer.pad_token_id)
    assert flat["token_mask"][0].tolist() == [0.0] * 9 + [1.0] * 3

    plain = build_sft_example({"prompt": "1+2=", "answer": 3}, tokenizer, 64, use_chat_template=False)
    assert plain["message_log"][1]["token_ids"].tolist() == [27, tokenizer.eos_token_id]


def test_over_long_sft_example_is_masked(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning per row: the preflight counts them per file
        datum = build_sft_example({"prompt": "9" * 30, "answer": "1" * 30}, tokenizer, max_seq_length=20, idx=4)
    assert datum["loss_multiplier"] == 0.0
    assert [m["token_ids"].numel() for m in datum["message_log"]] == [10, 10] and datum["length"] == 20


def test_missing_record_field_names_sample(tokenizer):
    with pytest.raises(DataError, match="sample idx 9: record has no 'answer'"):
        build_prompt_message_log({"prompt": "1+1="}, tokenizer, 64, idx=9)


def test_records_survive_json_round_trip(tmp_path):
    train, _ = generate_arithmetic(5, 0, seed=1)
    path = write_jsonl(train, tmp_path / "a.jsonl")
    assert load_jsonl(path) == train
    assert [json.loads(line) for line in path.read_text().splitlines()] == train
