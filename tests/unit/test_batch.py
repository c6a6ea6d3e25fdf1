"""Batch: every row operation checked on values."""

import pickle

import pytest
import torch

from posttrain.distributed.batch import Batch


def make_batch(rows: int = 5, seq: int = 3) -> Batch:
    return Batch(
        input_ids=torch.arange(rows * seq).reshape(rows, seq),
        rewards=torch.arange(rows, dtype=torch.float32),
        answers=[f"a{i}" for i in range(rows)],
    )


def test_size_and_mismatch_errors_name_the_key():
    batch = make_batch(5)
    assert batch.size == 5
    assert Batch().size == 0
    with pytest.raises(ValueError, match="'bad'.*4 rows.*5"):
        batch["bad"] = torch.zeros(4)
    with pytest.raises(ValueError, match="rows"):
        Batch(a=torch.zeros(2, 3), b=[1, 2, 3])
    with pytest.raises(ValueError, match="'scalar'.*0-dim"):
        Batch(scalar=torch.tensor(1.0))
    with pytest.raises(TypeError, match="'meta'.*dict"):
        Batch(meta={"x": 1})
    batch["rewards"] = torch.ones(5)  # replacing an entry with the same size is fine
    assert batch["rewards"].tolist() == [1.0] * 5


def test_cat_pads_dim1_per_key():
    a = Batch(
        input_ids=torch.tensor([[1, 2, 3]]),
        mask=torch.tensor([[True, True, True]]),
        lengths=torch.tensor([3]),
        text=["abc"],
    )
    b = Batch(
        input_ids=torch.tensor([[4], [5]]),
        mask=torch.tensor([[True], [True]]),
        lengths=torch.tensor([1, 1]),
        text=["d", "e"],
    )
    out = Batch.cat([a, b], pad_values={"input_ids": 9})
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9], [5, 9, 9]]
    assert out["mask"].tolist() == [[True, True, True], [True, False, False], [True, False, False]]
    assert out["lengths"].tolist() == [3, 1, 1]
    assert out["text"] == ["abc", "d", "e"]
    assert isinstance(out, Batch) and out.size == 3


def test_cat_pads_3d_tensors_and_checks_keys():
    a = Batch(x=torch.ones(1, 2, 4))
    b = Batch(x=torch.ones(1, 3, 4))
    out = Batch.cat([a, b])
    assert out["x"].shape == (2, 3, 4)
    assert out["x"][0, 2].tolist() == [0.0] * 4 and out["x"][1].sum().item() == 12.0
    with pytest.raises(KeyError, match="y"):
        Batch.cat([a, Batch(y=torch.ones(1))])
    with pytest.raises(ValueError):
        Batch.cat([])


def test_shard_sizes_order_and_roundtrip():
    batch = make_batch(7)
    shards = batch.shard(2)
    assert [s.size for s in shards] == [4, 3]
    assert shards[0]["rewards"].tolist() == [0, 1, 2, 3]
    assert shards[1]["answers"] == ["a4", "a5", "a6"]
    assert [s.size for s in batch.shard(3)] == [3, 2, 2]
    assert [s.size for s in make_batch(2).shard(4)] == [1, 1, 0, 0]
    back = Batch.cat(batch.shard(3))
    assert torch.equal(back["input_ids"], batch["input_ids"]) and back["answers"] == batch["answers"]


def test_repeat_interleave_copies_list_items():
    batch = Batch(ids=torch.tensor([[1, 2], [3, 4]]), logs=[[{"role": "user"}], [{"role": "user"}]])
    out = batch.repeat_interleave(3)
    assert out["ids"].tolist() == [[1, 2]] * 3 + [[3, 4]] * 3
    assert out.size == 6
    out["logs"][0].append({"role": "assistant"})  # one generation's turn must not leak into another
    assert len(out["logs"][1]) == 1 and len(batch["logs"][0]) == 1


def test_select_with_indices_and_mask():
    batch = make_batch(5)
    out = batch.select([4, 0, 2])
    assert out["rewards"].tolist() == [4.0, 0.0, 2.0]
    assert out["answers"] == ["a4", "a0", "a2"]
    assert out["input_ids"][0].tolist() == [12, 13, 14]
    masked = batch.select(torch.tensor([True, False, False, True, False]))
    assert masked["answers"] == ["a0", "a3"]
    with pytest.raises(IndexError):
        batch.select([5])


def test_chunk_microbatches_truncate_to_copy():
    batch = make_batch(5, seq=4)
    assert [c.size for c in batch.chunk(2)] == [2, 2, 1]
    assert [m["answers"] for m in batch.microbatches(3)] == [["a0", "a1", "a2"], ["a3", "a4"]]
    cut = batch.truncate(2)
    assert cut["input_ids"].tolist()[1] == [4, 5] and cut["rewards"].shape == (5,)
    moved = batch.to("cpu")
    assert moved["input_ids"].device.type == "cpu" and moved["answers"] == batch["answers"]
    dup = batch.copy()
    dup["answers"][0] = "changed"
    assert batch["answers"][0] == "a0" and dup["input_ids"] is batch["input_ids"]


def test_pickle_roundtrip():
    batch = make_batch(3)
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, Batch) and back["answers"] == batch["answers"]
    assert torch.equal(back["input_ids"], batch["input_ids"])
