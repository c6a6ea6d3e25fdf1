"""The cache publishes only complete entries (`posttrain/utils/cache.py`), whoever builds them.

The poisoning these guard against, as it happened on a fresh machine: two gloo ranks built the
tiny model at once; on rank 1 transformers' `save_pretrained` wrote no config and no weights (it
saves on rank 0 only), the half entry was renamed into place, and its marker alone made every
later run trust it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.models import tiny
from posttrain.utils import cache
from test_collectives import free_ports


def _rank_builds_first(rank: int, port: int, cache_root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), POSTTRAIN_CACHE=cache_root)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:  # the non-zero rank builds; rank 0 waits, then only reads
            tiny.ensure_tiny_model("tiny", "llama")
        dist.barrier()
        if rank == 0:
            assert cache.entry_problem(Path(cache_root) / "models" / "llama-tiny", tiny.tiny_stamp("tiny", "llama")) is None
    finally:
        dist.destroy_process_group()


def test_a_non_zero_rank_builds_a_whole_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mp.spawn(_rank_builds_first, args=(free_ports(1)[0], str(tmp_path)), nprocs=2, join=True)
    path = tmp_path / "models" / "llama-tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json", cache.ENTRY_FILE} <= {p.name for p in path.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.hidden_size == tiny.PRESETS["tiny"]["hidden_size"]
    assert AutoTokenizer.from_pretrained(path)("12+3").input_ids == tiny.build_tokenizer()("12+3").input_ids


def _model_files(tmp: Path) -> None:
    tiny.build_tiny_model(tmp)


@pytest.fixture
def tiny_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    return tiny.ensure_tiny_model("tiny", "llama")


@pytest.mark.parametrize("damage", ["weights deleted", "weights truncated", "manifest deleted", "config deleted"])
def test_a_damaged_entry_is_named_and_rebuilt(tiny_entry, damage):
    weights = tiny_entry / "model.safetensors"
    if damage == "weights deleted":
        weights.unlink()
    elif damage == "weights truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "manifest deleted":
        (tiny_entry / cache.ENTRY_FILE).unlink()
    else:
        (tiny_entry / "config.json").unlink()
    stamp = tiny.tiny_stamp("tiny", "llama")
    problem = cache.entry_problem(tiny_entry, stamp)
    expected = {"weights deleted": "model.safetensors is missing", "config deleted": "config.json is missing",
                "weights truncated": "model.safetensors has 1000 bytes", "manifest deleted": "no posttrain-entry.json"}
    assert problem is not None and problem.startswith(expected[damage])
    assert tiny.ensure_tiny_model("tiny", "llama") == tiny_entry
    assert cache.entry_problem(tiny_entry, stamp) is None and cache.model_dir_problem(tiny_entry) is None


def test_an_entry_of_an_older_recipe_is_replaced(tiny_entry, monkeypatch):
    mtime = (tiny_entry / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model("tiny", "llama") == tiny_entry
    assert (tiny_entry / "model.safetensors").stat().st_mtime_ns == mtime  # current: reused, not rebuilt
    monkeypatch.setattr(tiny, "RECIPE_VERSION", tiny.RECIPE_VERSION + 1)
    assert cache.entry_problem(tiny_entry, tiny.tiny_stamp("tiny", "llama")).startswith("built from")
    tiny.ensure_tiny_model("tiny", "llama")
    assert cache.read_manifest(tiny_entry)["stamp"]["recipe_version"] == tiny.RECIPE_VERSION


def test_a_build_that_writes_no_weights_is_refused_and_leaves_nothing(tmp_path):
    def no_weights(tmp: Path) -> None:
        tiny.build_tiny_model(tmp)
        (tmp / "model.safetensors").unlink()

    final = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError, match="went wrong: no weights"):
        cache.publish_entry(final, no_weights, {"v": 1})
    assert not final.exists() and not cache.leftovers(final)


def test_a_build_interrupted_half_way_leaves_nothing_a_later_run_trusts(tmp_path):
    final = tmp_path / "models" / "m"

    def interrupted(tmp: Path) -> None:
        tiny.build_tiny_model(tmp)
        raise KeyboardInterrupt  # Ctrl-C after the files, before the manifest

    with pytest.raises(KeyboardInterrupt):
        cache.publish_entry(final, interrupted, {"v": 1})
    assert not final.exists() and not cache.leftovers(final)
    # kill -9 leaves the temporary directory behind (no `finally` runs): the next builder removes it
    orphan = final.parent / f".tmp-{final.name}-999-deadbeef"
    tiny.build_tiny_model(orphan)
    assert cache.leftovers(final) == [orphan]
    assert cache.publish_entry(final, _model_files, {"v": 1}) == final
    assert cache.entry_problem(final, {"v": 1}) is None and not cache.leftovers(final)


def test_builders_racing_for_one_entry_build_it_once(tmp_path):
    final, builds, results = tmp_path / "models" / "m", [], []

    def counted(tmp: Path) -> None:
        builds.append(1)
        _model_files(tmp)

    threads = [threading.Thread(target=lambda: results.append(cache.publish_entry(final, counted, {"v": 1})))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 4 and len(builds) == 1


def test_a_manifest_names_every_file_and_its_size(tiny_entry):
    manifest = json.loads((tiny_entry / cache.ENTRY_FILE).read_text())
    assert manifest["stamp"] == tiny.tiny_stamp("tiny", "llama")
    assert manifest["files"]["model.safetensors"] == (tiny_entry / "model.safetensors").stat().st_size
    assert set(manifest["files"]) == {p.name for p in tiny_entry.iterdir()} - {cache.ENTRY_FILE}
