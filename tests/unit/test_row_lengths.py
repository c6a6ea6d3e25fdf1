"""Rows over `policy.max_total_sequence_length`: one preflight line per data file (how many, the
longest, the key to raise), and a refused run when most of a file's rows would be masked out."""

from __future__ import annotations

import json
import sys

import pytest

from posttrain.config import load_config
from posttrain.data import row_lengths
from posttrain.data.processors import build_sft_example
from posttrain.errors import UserError
from posttrain.models.hf import load_tokenizer
from posttrain import preflight
from posttrain.preflight import load_split_records


def sft_config(tmp_path, prompts: list[str], limit: int = 32):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in prompts))
    return load_config("sft", overrides=["data.dataset=jsonl", f"data.train_path={train}",
                                         f"policy.max_total_sequence_length={limit}"]), train


def test_one_line_per_file_names_the_count_the_longest_and_the_key(tmp_path, capsys):
    prompts = ["1+2="] * 7 + ["1+" * 20 + "1=", "9" * 30, "1+" * 14 + "1="]
    cfg, train = sft_config(tmp_path, prompts)
    tokenizer = load_tokenizer(cfg.policy.model_name, cfg.policy.tiny_arch)
    lengths = [build_sft_example({"prompt": p, "answer": "7"}, tokenizer, sys.maxsize)["length"] for p in prompts]
    over = [n for n in lengths if n > 32]
    assert len(over) == 3  # the test's premise: three rows of ten are too long
    preflight.check_row_lengths(cfg, load_split_records(cfg))
    assert capsys.readouterr().out.splitlines() == [
        f"[posttrain] data: 3 of 10 rows of {train} exceed policy.max_total_sequence_length=32 (longest {max(over)} "
        f"tokens): they are masked out of the loss (raise policy.max_total_sequence_length to {max(over)} to keep them)"]
    preflight.check_row_lengths(cfg.model_copy(update={"policy": cfg.policy.model_copy(
        update={"max_total_sequence_length": max(over)})}), load_split_records(cfg))
    assert capsys.readouterr().out == ""  # nothing over the limit: nothing said


def test_a_file_mostly_over_the_limit_refuses_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    from posttrain import cli

    monkeypatch.chdir(tmp_path)
    _, train = sft_config(tmp_path, ["1+2="] * 4 + ["1+" * 20 + "1="] * 6)
    code = cli.main(["sft", "data.dataset=jsonl", f"data.train_path={train}", "policy.max_total_sequence_length=32"])
    assert code == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"posttrain sft: 6 of 10 rows of {train} exceed "
                                               "policy.max_total_sequence_length=32 (longest ")
    assert err[0].endswith("more than half would be masked out of the loss; raise policy.max_total_sequence_length "
                           f"to {err[0].split('(longest ')[1].split(' ')[0]}, or shorten the rows")


def test_a_large_file_is_sampled_and_its_longest_row_still_found(monkeypatch):
    """2,000 rows: 250 evenly spaced ones and the 32 longest in characters are built; the count is
    estimated from the evenly spaced ones, the longest comes from the longest ones."""
    rows = [{"prompt": "x" * (50 if i % 3 == 0 else 10), "origin": f"big.jsonl:{i + 1}"} for i in range(2000)]
    rows[1001]["prompt"] = "x" * 90  # one outlier the evenly spaced rows (every 8th) miss
    built = []

    def length_of(record):
        built.append(record)
        return len(record["prompt"])

    [found] = row_lengths.file_lengths(rows, length_of, 40, "fallback")
    assert len(built) == found.checked < 300
    assert (found.source, found.rows, found.longest) == ("big.jsonl", 2000, 90)
    spaced_long = sum(1 for i in range(0, 2000, 8) if i % 3 == 0)  # every 3rd row is long
    assert found.share == pytest.approx(spaced_long / 250)
    assert found.line("policy.max_total_sequence_length", 40).startswith(
        f"about {round(spaced_long / 250 * 2000):,} of 2,000 rows (")
    assert row_lengths.file_lengths(rows, length_of, 100, "fallback") == []
    assert row_lengths.source_of({"origin": "data.generator=shape_count train row 3"}, "f") == \
        "data.generator=shape_count train"
    assert row_lengths.source_of({}, "the train rows") == "the train rows"


def test_a_warm_starts_key_is_named_with_its_section(tmp_path, capsys):
    cfg, train = sft_config(tmp_path, ["1+2="] * 9 + ["1+" * 20 + "1="])
    preflight.check_row_lengths(cfg, load_split_records(cfg), key_prefix="sft_warmup.")
    assert "exceed sft_warmup.policy.max_total_sequence_length=32" in capsys.readouterr().out
    with pytest.raises(UserError, match="more than half"):
        cfg, _ = sft_config(tmp_path, ["1+" * 20 + "1="] * 2)
        preflight.check_row_lengths(cfg, load_split_records(cfg))
