"""Preference data: synthetic pairs, JSONL loading, pair message logs and interleaved batches."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from posttrain.job import build_datums
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import DataConfig, DPOMasterConfig, PolicyConfig, pair_batching_problems
from posttrain.data.datasets import DataError
from posttrain.data.preference import (
    WRONG_ANSWER_SLIPS,
    arithmetic_preference_pairs,
    build_preference_example,
    flatten_preference_pairs,
    load_preference_records,
    pair_batches,
    wrong_answer,
)
from posttrain.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_wrong_answer_hand_cases():
    rng = random.Random(0)
    for answer in ["46", "7", "0", "10", "100", "-5", "-23", "99"]:
        for _ in range(20):
            wrong = wrong_answer(answer, rng)
            assert wrong != answer and wrong.startswith("-") == answer.startswith("-")
    # The default slips drop or repeat the last digit.
    assert {wrong_answer("46", random.Random(s)) for s in range(30)} == {"4", "466"}
    assert {wrong_answer("46", random.Random(s), tuple(WRONG_ANSWER_SLIPS)) for s in range(60)} == {
        "4", "466", "64", "36", "56"}
    assert wrong_answer("0", random.Random(0)) == "10"  # no default slip applies: lost carry
    with pytest.raises(ValueError, match="integer"):
        wrong_answer("4.5", random.Random(0))


def test_arithmetic_pairs_seeded_and_disjoint():
    train, val = arithmetic_preference_pairs(300, 50, seed=7)
    assert (train, val) == arithmetic_preference_pairs(300, 50, seed=7)
    assert {p["prompt"] for p in train}.isdisjoint({p["prompt"] for p in val})
    for pair in train + val:
        a, b = pair["prompt"].rstrip("=").split("+")
        assert pair["chosen"] == str(int(a) + int(b)) and pair["rejected"] != pair["chosen"]
    cfg = DataConfig(num_train=300, num_validation=50, seed=7)
    assert load_preference_records(cfg, "validation") == val


def test_jsonl_keys_template_and_errors(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"q": "2+2=", "good": 4, "bad": "5"}) + "\n\n" + json.dumps({"q": "1+1=", "good": "2"}) + "\n")
    cfg = DataConfig(dataset="jsonl", train_path=str(path), prompt_key="q", chosen_key="good", rejected_key="bad",
                     prompt_template="Q: {prompt}")
    with pytest.raises(DataError, match=rf"{path}:3: missing key 'bad' \(data.rejected_key\)"):
        load_preference_records(cfg, "train")
    path.write_text(json.dumps({"q": "2+2=", "good": 4, "bad": "5"}) + "\n")
    assert load_preference_records(cfg, "train") == [{"prompt": "Q: 2+2=", "chosen": "4", "rejected": "5"}]
    assert load_preference_records(cfg, "validation") == []
    # A repeated validation pair counts once in validation/accuracy; training keeps both.
    path.write_text("".join(json.dumps(row) + "\n" for row in (
        {"q": "2+2=", "good": 4, "bad": "5"}, {"q": "2+2=", "good": 4, "bad": "3"}, {"q": "2+2=", "good": "4", "bad": "5"})))
    validation = cfg.model_copy(update={"validation_path": str(path)})
    assert [p["rejected"] for p in load_preference_records(validation, "validation")] == ["5", "3"]
    assert len(load_preference_records(validation, "train")) == 3
    path.write_text(json.dumps({"q": "2+2=", "good": ["4"], "bad": "5"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: 'good' must be a string"):
        load_preference_records(cfg, "train")
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=rf"{path}:1: invalid JSON"):
        load_preference_records(cfg, "train")


def test_pair_message_logs_and_interleaved_batch(tokenizer):
    pairs = [{"prompt": "1+2=", "chosen": "3", "rejected": "33"}, {"prompt": "10+20=", "chosen": "30", "rejected": "3"}]
    datums = [build_preference_example(p, tokenizer, 64, idx=i) for i, p in enumerate(pairs)]
    d0 = datums[0]
    assert d0["message_log_chosen"][0]["content"] == "<|user|>1+2=<|end|><|assistant|>"
    assert d0["message_log_chosen"][1]["content"] == "3<|end|>" and d0["message_log_chosen"][1]["loss"]
    assert d0["message_log_rejected"][1]["content"] == "33<|end|>"
    assert torch.equal(d0["message_log_chosen"][0]["token_ids"], d0["message_log_rejected"][0]["token_ids"])
    assert (d0["length_chosen"], d0["length_rejected"], d0["loss_multiplier"]) == (9, 10, 1.0)

    batch = flatten_preference_pairs(datums, tokenizer.pad_token_id)
    # Rows [c0, r0, c1, r1]; prompt "<|user|>" + "1+2=" + "<|end|><|assistant|>" is 7 tokens.
    assert batch["input_lengths"].tolist() == [9, 10, 12, 11]
    texts = [tokenizer.decode(batch["input_ids"][i, : batch["input_lengths"][i]]) for i in range(4)]
    assert [t.split("<|assistant|>")[1] for t in texts] == ["3<|end|>", "33<|end|>", "30<|end|>", "3<|end|>"]
    # Loss only on the response tokens (answer + end of turn).
    assert batch["token_mask"].sum(1).tolist() == [2, 3, 3, 2]
    assert batch["token_mask"][0, :7].sum() == 0 and batch["token_mask"][0, 7:9].tolist() == [1, 1]
    assert batch["sample_mask"].tolist() == [1, 1, 1, 1]
    assert batch["input_ids"][0, 9:].eq(tokenizer.pad_token_id).all()


def test_overlong_pair_masked_as_a_pair(tokenizer):
    # Chosen fits in 12 tokens (7 prompt + answer + end), rejected does not: the whole pair is masked.
    pairs = [{"prompt": "1+2=", "chosen": "3", "rejected": "3333333"}, {"prompt": "1+3=", "chosen": "4", "rejected": "44"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning per pair: the preflight counts them per file
        d0 = build_preference_example(pairs[0], tokenizer, 12, idx=0)
    d1 = build_preference_example(pairs[1], tokenizer, 12, idx=1)
    assert d0["loss_multiplier"] == 0.0 and d1["loss_multiplier"] == 1.0
    batch = flatten_preference_pairs([d0, d1], tokenizer.pad_token_id)
    assert batch["sample_mask"].tolist() == [0, 0, 1, 1]
    assert batch["input_ids"].shape[1] <= 12


def test_split_datums_and_validation_batches(tokenizer, tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "33"}, {"prompt": "10+20=", "chosen": "30", "rejected": "3"},
            {"prompt": "5+5=", "chosen": "10", "rejected": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DPOMasterConfig(data=DataConfig(dataset="jsonl", train_path=str(path), validation_path=str(path),
                                          use_chat_template=False), policy=PolicyConfig(max_total_sequence_length=64))
    datums = build_datums(cfg, build_preference_example, tokenizer, "validation", load=load_preference_records)
    # data.use_chat_template=false reaches the builder: plain prompt, response ending in eos.
    assert [d["idx"] for d in datums] == [0, 1, 2]
    assert [d["message_log_chosen"][0]["content"] for d in datums] == ["1+2=", "10+20=", "5+5="]
    assert [d["message_log_rejected"][1]["content"] for d in datums] == [
        a + tokenizer.eos_token for a in ("33", "3", "1")]

    batches = pair_batches(datums, 2, tokenizer.pad_token_id)  # pairs (0, 1) and (2)
    assert [b.size for b in batches] == [4, 2]
    whole = flatten_preference_pairs(datums, tokenizer.pad_token_id)
    assert batches[1]["input_lengths"].tolist() == whole["input_lengths"][4:].tolist()
    assert batches[0]["input_lengths"].tolist() == whole["input_lengths"][:4].tolist()
    assert pair_batches([], 2, tokenizer.pad_token_id) == []


def test_pair_batching_problems_fail_the_config_before_any_work():
    assert pair_batching_problems(PolicyConfig(train_global_batch_size=8, train_micro_batch_size=4, num_workers=2)) == []
    (problem,) = pair_batching_problems(PolicyConfig(train_global_batch_size=8, train_micro_batch_size=3))
    assert "train_micro_batch_size=3 must be even" in problem
    (problem,) = pair_batching_problems(PolicyConfig(train_global_batch_size=6, train_micro_batch_size=2, num_workers=2))
    assert "(policy.num_workers / policy.tensor_parallel_size) = 4" in problem
    # Tensor-parallel ranks share rows: 4 workers in TP pairs are 2 data-parallel ranks.
    assert pair_batching_problems(PolicyConfig(train_global_batch_size=4, train_micro_batch_size=2, num_workers=4,
                                               tensor_parallel_size=2)) == []
    for algo in ("dpo", "rm"):
        with pytest.raises(ConfigError, match=r"preference training: policy.sequence_packing.enabled must be false"):
            load_config(algo, overrides=["policy.sequence_packing.enabled=true"])
