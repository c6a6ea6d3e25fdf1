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

Pipeline parallelism loads differently: every rank builds the model on the meta device, prunes it
to its own stages and reads only their tensors from the checkpoint's safetensors files
(`fill_from_safetensors`), so the ranks of a node hold about one model between them and no rank
sends weights to another.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
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


def safetensors_files(model_path: str) -> Optional[dict[str, Path]]:
    """`{tensor name: file}` of a local checkpoint directory saved as safetensors (one
    `model.safetensors`, or shards listed by `model.safetensors.index.json`); None when the
    directory has neither (a hub id, a `.bin` checkpoint): the caller then loads the whole model."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {name: root / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = root / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def fill_from_safetensors(model: torch.nn.Module, files: dict[str, Path], dtype: torch.dtype = torch.float32) -> None:
    """Give every meta parameter of `model` its tensor from `files` (`safetensors_files`), read one
    tensor at a time in `dtype`: only what the (pruned) model keeps is read. Raises naming the first
    missing tensors, or any parameter left on the meta device."""
    from safetensors import safe_open

    wanted = [name for name, p in model.named_parameters() if p.is_meta]
    missing = [name for name in wanted if name not in files]
    if missing:
        raise RuntimeError(f"the checkpoint has no tensor for {missing[:5]} ({len(missing)} missing)")
    state: dict[str, torch.Tensor] = {}
    for file in sorted({files[name] for name in wanted}):
        with safe_open(file, framework="pt") as f:
            for name in wanted:
                if files[name] == file:
                    state[name] = f.get_tensor(name).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"stage loading left tensors on the meta device: {left[:5]}")
