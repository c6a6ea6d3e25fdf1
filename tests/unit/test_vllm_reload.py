"""Refit into vLLM without splitting a layer between two reloads (`vllm_reload.load_buckets`,
`HeldBack`), without vLLM: a layer's tensors must reach vLLM's layerwise reload in one call."""

from __future__ import annotations

import torch

from posttrain.models.generation.vllm_reload import HeldBack, load_buckets, reload_block
from posttrain.models.refit import build_refit_metadata


def test_reload_block_is_the_numbered_layer():
    assert reload_block("model.layers.3.mlp.experts.0.up_proj.weight") == "model.layers.3"
    assert reload_block("model.layers.12.mlp.experts.gate_up_proj") == "model.layers.12"
    assert reload_block("model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0"
    assert reload_block("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert reload_block("lm_head.weight") == "lm_head.weight"


# Names as a transformers 5 Qwen3-MoE holds them; 512-byte float32 tensors (128 elements), so
# with 1024-byte buckets every bucket holds two tensors.
NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
    "model.layers.0.mlp.gate.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight",
]


def _metadata():
    return build_refit_metadata([(n, (128,), torch.float32) for n in NAMES], bucket_bytes=1024)


def test_each_layer_loads_with_the_bucket_that_completes_it():
    metadata = _metadata()
    assert [s.bucket for s in metadata.slots] == [0, 0, 1, 1, 2, 2, 3, 3]
    # Layer 0 spans buckets 0-2: all of it loads with bucket 2; layer 1 is whole in bucket 3.
    assert list(load_buckets(metadata).values()) == [0, 2, 2, 2, 2, 2, 3, 3]


def test_held_back_tensors_are_copies_loaded_once_with_their_layer():
    metadata = _metadata()
    held = HeldBack(metadata)
    buffers = [torch.full((2, 128), float(b)) for b in range(4)]  # bucket b's two tensors hold b
    loaded: list[dict[str, float]] = []
    for bucket in range(4):
        views = {s.name: buffers[bucket][i] for i, s in enumerate(s for s in metadata.slots if s.bucket == bucket)}
        ready = held.ready(views, bucket)
        buffers[bucket].fill_(-1.0)  # the buffer is reused (broadcast) or freed: held tensors must not see it
        loaded.append({name: float(t[0]) for name, t in ready.items()})
    assert loaded[0] == {"model.embed_tokens.weight": -1.0}  # loaded before the buffer is reused: a view
    assert loaded[1] == {}
    assert loaded[2] == {"model.layers.0.self_attn.q_proj.weight": 0.0, "model.layers.0.self_attn.k_proj.weight": 1.0,
                         "model.layers.0.mlp.experts.gate_up_proj": 1.0, "model.layers.0.mlp.experts.down_proj": -1.0,
                         "model.layers.0.mlp.gate.weight": -1.0}
    assert set(loaded[3]) == {"model.layers.1.self_attn.q_proj.weight", "model.norm.weight"}
    assert not held.held

    # A refit abandoned after bucket 1 holds nothing over into the next one.
    for bucket in (0, 1, 0):
        held.ready({s.name: torch.zeros(128) for s in metadata.slots if s.bucket == bucket}, bucket)
    assert set(held.held) == {"model.layers.0.self_attn.q_proj.weight"}
