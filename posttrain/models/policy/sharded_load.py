"""Sharded loading: under FSDP (and tensor parallelism) only rank 0 reads the checkpoint; the other
ranks build the model with its parameters on the meta device (no memory) and receive their shards
from rank 0 after sharding, so a node's host memory holds about one model at start-up, not one per rank.

    model = load_causal_lm(...) if rank == 0 else empty_causal_lm(...)
    full = rank0_weights(model, rank)     # rank 0: references to its loaded tensors, no copy
    parallelize_module(..., src_data_rank=None)  # TP: each rank cuts its own (rank 0 real, others meta)
    fully_shard(...)                      # rank 0 keeps its shard only, once `full` is dropped
    fill_shards_from_rank0(model, full)   # torch's broadcast_from_rank0, tensor by tensor

Only parameters go to the meta device: buffers (rotary frequencies and other non-persistent
ones, which no state dict carries) are built as usual on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.models.hf import apply_rope_scaling, resolve_model_path
from posttrain.utils.model_build import MODEL_BUILD_LOCK


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None:
            kwargs = dict(param.__dict__, requires_grad=param.requires_grad)
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_causal_lm(name_or_path: str, tiny_arch: str = "llama", attn_implementation: Optional[str] = None,
                    dtype: torch.dtype = torch.float32, rope_scaling: Optional[dict] = None) -> torch.nn.Module:
    """The architecture of `name_or_path` (as `hf.load_causal_lm` would load it, `rope_scaling`
    included) with its parameters on the meta device: no weights read, no memory for them."""
    path = resolve_model_path(name_or_path, tiny_arch)
    config = apply_rope_scaling(AutoConfig.from_pretrained(path), rope_scaling)
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with MODEL_BUILD_LOCK, parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **options)
    return model.eval()


def rank0_weights(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: the loaded model's state dict (references, no copy) to send after sharding; `{}` elsewhere."""
    return dict(model.state_dict()) if rank == 0 else {}


def fill_shards_from_rank0(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Collective, after `fully_shard`: every rank's shards (meta or not) get rank 0's `weights`,
    broadcast one tensor at a time (torch's `set_model_state_dict(broadcast_from_rank0=True)`)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    left = [name for name, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise RuntimeError(f"sharded loading left tensors on the meta device: {left[:5]}")
