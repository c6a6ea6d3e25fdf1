from typing import Mapping

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models.refit import (
    build_refit_metadata,
    check_metadata_matches,
    load_packed,
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
