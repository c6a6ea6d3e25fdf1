from typing import Mapping

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models.refit import (
    bucket_slots,
    build_refit_metadata,
    check_metadata_matches,
    default_bucket_bytes,
    load_bucket,
    load_packed,
    pack_bucket,
    pack,
    refit_metadata_from_state_dict,
    state_dict_checksum,
    unpack,
)


def verify_equal(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise AssertionError naming every tensor of `state_dict` that differs from the model's.

    Compared bit for bit after casting the reference to the model's dtype.
    """
    own = model.state_dict()
    bad = []
    for name, reference in state_dict.items():
        if name not in own:
            bad.append(f"{name} (missing in model)")
        elif not torch.equal(own[name].detach().cpu(), reference.detach().cpu().to(own[name].dtype)):
            bad.append(name)
    if bad:
        raise AssertionError(f"refit verification failed: {len(bad)} tensors differ, e.g. {bad[:5]}")


def mixed_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w_f32": torch.randn(3, 5),
        "w_bf16": torch.randn(7).to(torch.bfloat16),
        "steps_i64": torch.tensor([1, -2, 2**40]),
        "scalar_f16": torch.tensor(1.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_metadata_layout_is_aligned_and_bucketed():
    meta = build_refit_metadata(
        [("a", (10,), torch.float32), ("b", (3, 2), torch.int64), ("c", (1000,), torch.bfloat16), ("d", (1,), torch.uint8)],
        bucket_bytes=1024,
        alignment=512,
    )
    # a: 40 B -> 512; b: 48 B -> 512 (bucket 0 full at 1024); c: 2000 B alone; d: new bucket.
    assert [(s.bucket, s.offset, s.nbytes) for s in meta.slots] == [(0, 0, 40), (0, 512, 48), (1, 0, 2000), (2, 0, 1)]
    assert meta.bucket_sizes == (1024, 2048, 512)
    with pytest.raises(ValueError, match="listed twice"):
        build_refit_metadata([("a", (1,), torch.float32), ("a", (1,), torch.float32)])


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_pack_unpack_round_trip_is_bit_exact(bucket_bytes):
    state = mixed_state_dict()
    meta = refit_metadata_from_state_dict(state, bucket_bytes=bucket_bytes)
    buffers = pack(state, meta)
    assert all(b.dtype == np.uint8 for b in buffers)
    assert (len(buffers) == 1) == (bucket_bytes == 1 << 20)
    # Read-only buffers (as Ray's object store returns them) unpack without copies.
    for b in buffers:
        b.flags.writeable = False
    views = unpack(buffers, meta)
    assert list(views) == list(state)
    for name, tensor in state.items():
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
        assert torch.equal(views[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_pack_errors_name_the_tensor():
    state = mixed_state_dict()
    meta = refit_metadata_from_state_dict(state)
    with pytest.raises(KeyError, match="w_f32"):
        pack({k: v for k, v in state.items() if k != "w_f32"}, meta)
    with pytest.raises(ValueError, match="w_bf16"):
        pack({**state, "w_bf16": torch.zeros(8, dtype=torch.bfloat16)}, meta)
    with pytest.raises(ValueError, match="buffers"):
        unpack([], meta)


def test_load_packed_rebuilds_model_weights_exactly():
    source, target = tiny_llama(1), tiny_llama(2)
    state = source.state_dict()
    assert state_dict_checksum(state) != state_dict_checksum(target.state_dict())
    with pytest.raises(AssertionError, match="differ"):
        verify_equal(target, state)
    meta = refit_metadata_from_state_dict(state, bucket_bytes=16 * 1024)
    assert len(meta.bucket_sizes) > 1
    check_metadata_matches(target, meta)
    load_packed(target, pack(state, meta), meta)
    verify_equal(target, state)
    assert state_dict_checksum(target.state_dict()) == state_dict_checksum(state)
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(target(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_bfloat16_sender_casts_into_float32_receiver():
    source, target = tiny_llama(1), tiny_llama(2)
    bf16_state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    meta = refit_metadata_from_state_dict(bf16_state)
    load_packed(target, pack(bf16_state, meta), meta)
    verify_equal(target, bf16_state)


def test_check_metadata_rejects_foreign_names():
    target = tiny_llama(0)
    meta = build_refit_metadata([("not.a.param", (2,), torch.float32)])
    with pytest.raises(ValueError, match="not.a.param"):
        check_metadata_matches(target, meta)


def test_pack_bucket_holds_one_gathered_tensor_at_a_time():
    """A streamed refit asks for each tensor just before copying it and drops it right after:
    never two gathered tensors alive at once, and only the bucket's own tensors are asked for."""
    import weakref

    state = mixed_state_dict()
    meta = refit_metadata_from_state_dict(state, bucket_bytes=1024)
    alive: set[int] = set()
    peak, asked = 0, []

    def gather(name: str) -> torch.Tensor:  # stands in for DTensor.full_tensor(): a fresh copy
        nonlocal peak
        full = state[name].clone()
        alive.add(id(full))
        weakref.finalize(full, alive.discard, id(full))
        peak = max(peak, len(alive))
        asked.append(name)
        return full

    buffers = []
    for bucket in range(len(meta.bucket_sizes)):
        buffer = pack_bucket(gather, meta, bucket)
        assert [s.name for s in bucket_slots(meta, bucket)] == asked[-len(bucket_slots(meta, bucket)):]
        buffers.append(buffer.numpy())
    assert peak == 1 and not alive
    assert asked == list(state)
    assert len(buffers) > 1 and [b.nbytes for b in buffers] == list(meta.bucket_sizes)
    # Bit-exact, and the same bytes as packing from the whole state dict.
    assert all(np.array_equal(a, b) for a, b in zip(buffers, pack(state, meta)))
    # One reused buffer (`out`) gives the same bytes.
    out = torch.full((meta.max_bucket_bytes,), 255, dtype=torch.uint8)
    for bucket, expected in enumerate(buffers):
        assert np.array_equal(pack_bucket(state.__getitem__, meta, bucket, out=out).numpy(), expected)


def test_load_bucket_loads_only_that_bucket_and_checks_its_size():
    source, target = tiny_llama(1), tiny_llama(2)
    meta = refit_metadata_from_state_dict(source.state_dict(), bucket_bytes=4096)
    first = {s.name for s in bucket_slots(meta, 0)}
    differing = {n for n, t in target.state_dict().items() if not torch.equal(t, source.state_dict()[n])}
    assert first & differing and differing - first
    load_bucket(target, pack_bucket(source.state_dict().__getitem__, meta, 0), meta, 0)
    for name in differing:
        assert torch.equal(target.state_dict()[name], source.state_dict()[name]) == (name in first), name
    with pytest.raises(ValueError, match="expected uint8"):
        load_bucket(target, torch.zeros(3, dtype=torch.uint8), meta, 0)
    with pytest.raises(IndexError, match="bucket 99"):
        bucket_slots(meta, 99)


def test_default_bucket_is_a_share_of_free_host_memory(monkeypatch):
    import psutil

    class Free:
        def __init__(self, available):
            self.available = available

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Free(10 << 30))
    assert default_bucket_bytes(torch.device("cpu")) == 2 << 30  # capped
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Free(1 << 30))
    assert default_bucket_bytes(torch.device("cpu")) == int(0.2 * (1 << 30))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Free(1 << 20))
    assert default_bucket_bytes(torch.device("cpu")) == 1 << 20  # floor


def test_lora_merged_tensor_matches_the_merged_state_dict():
    from posttrain.models import lora

    torch.manual_seed(0)
    prefix = "base_model.model.layers.0.q_proj."
    state = {
        prefix + "base_layer.weight": torch.randn(4, 6),
        prefix + f"lora_A.{lora.ADAPTER}.weight": torch.randn(2, 6),
        prefix + f"lora_B.{lora.ADAPTER}.weight": torch.randn(4, 2),
        "base_model.model.norm.weight": torch.randn(6),
    }
    merged = lora.merged_state_dict(state, 0.5)
    calls = []
    for name in state:
        if not lora.is_adapter(name):
            one = lora.merged_tensor(state, name, 0.5, lambda t: calls.append(t) or t)
            assert torch.equal(one, merged[lora.base_name(name)])
    assert len(calls) == 4  # the base weight, its two adapters, the norm
