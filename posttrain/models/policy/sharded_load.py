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

So does expert parallelism (mixtures of experts, which rank-0 loading does not serve: worker.py):
every rank builds the model on the meta device, reads every tensor but the routed experts
(`fill_from_safetensors` with `skip`), and then only its own experts (`ExpertSliceReader`, called
by `expert_parallel.shard_experts`): checkpoints keep one tensor per expert (`...experts.<j>.gate_proj.weight`,
Mixtral's `w1` / `w3` / `w2`), which it reads for its experts only and fuses as transformers 5 does
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); a checkpoint saved with the fused tensors is
read by a slice of its expert dimension (safetensors' `get_slice`). Checkpoint names are mapped to
the model's by transformers' own renamings for the model type (Mixtral's `block_sparse_moe` -> `mlp`).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

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
    # Tying assigns the input embeddings' parameter to the head, and `parameters_on_meta` made that a new
    # meta parameter: tie again outside it, or a tied model (Qwen2, Gemma 3) has one parameter more on
    # these ranks than on rank 0, and FSDP2's collectives disagree in size (gloo: "Received data size
    # doesn't match expected size").
    tie_head(model)
    return model.eval()


def tie_head(model: torch.nn.Module) -> None:
    """Make a tied model's output head share the input embeddings' parameter again, after something
    replaced one of them (`parameters_on_meta`, a `load_state_dict(assign=True)`); nothing for an
    untied model or a pipeline stage without one of the two."""
    if (getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
            and model.get_input_embeddings() is not None):
        model.tie_weights()


def rank0_weights(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: the loaded model's state dict (references, no copy) to send after sharding; `{}` elsewhere."""
    return dict(model.state_dict()) if rank == 0 else {}


def fill_shards_from_rank0(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Collective, after `fully_shard`: every rank's shards (meta or not) get rank 0's `weights`,
    broadcast one tensor at a time (torch's `set_model_state_dict(broadcast_from_rank0=True)`)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # On the meta ranks the values are assigned (new parameters), the tied head's too: a parameter of
    # its own that the optimizer would then hold beside the embeddings' (and a checkpoint could not name).
    tie_head(model)
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


def checkpoint_names(files: dict[str, Path], model_type: str) -> dict[str, str]:
    """`{the model's name for a tensor: its name in the checkpoint}` for every tensor of `files`,
    by transformers' renamings for `model_type` (`conversion_mapping`; none: the same names).
    Per-expert tensors keep their expert index (`...mlp.experts.0.w1.weight`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [pair for rule in get_checkpoint_conversion_mapping(model_type) or ()
                 if isinstance(rule, WeightRenaming) for pair in zip(rule.source_patterns, rule.target_patterns)]
    names = {}
    for key in files:
        renamed = key
        for source, target in renamings:
            renamed = re.sub(source, target, renamed)
        names[renamed] = key
    return names


def fill_from_safetensors(model: torch.nn.Module, files: dict[str, Path], dtype: torch.dtype = torch.float32,
                          skip: Iterable[str] = (), names: Optional[dict[str, str]] = None) -> None:
    """Give every meta parameter of `model` but those named in `skip` its tensor from `files`
    (`safetensors_files`), read one tensor at a time in `dtype`: only what the (pruned) model keeps
    is read; with `names` (`checkpoint_names`: the model's names to the checkpoint's) also the
    persistent buffers the checkpoint holds (DeepSeek-V3's routing bias). Raises naming the first
    missing tensors, or any parameter left on the meta device."""
    from safetensors import safe_open

    names = names if names is not None else {name: name for name in files}
    skip = set(skip)
    tied = getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
    # A tied head is the input embeddings (tied below), which checkpoints keep once. The skeleton is
    # tied already (`empty_causal_lm`): then the one parameter is read under the embeddings' name.
    output_weight = model.get_output_embeddings().weight if tied else None
    input_weight = getattr(model.get_input_embeddings(), "weight", None)  # None: a pipeline stage without them
    head_weight = output_weight if output_weight is not input_weight else None
    head = {name for name, p in model.named_parameters() if p is head_weight}
    wanted = [name for name, p in model.named_parameters() if p.is_meta and name not in skip | head]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise RuntimeError(f"the checkpoint has no tensor for {missing[:5]} ({len(missing)} missing)")
    params = {name for name, _ in model.named_parameters()}
    wanted += [name for name in model.state_dict() if name not in params and name in names]  # persistent buffers
    state: dict[str, torch.Tensor] = {}
    for file in sorted({files[names[name]] for name in wanted}):
        with safe_open(file, framework="pt") as f:
            for name in wanted:
                if files[names[name]] == file:
                    state[name] = f.get_tensor(names[name]).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    tie_head(model)  # `assign` replaced the input embeddings' parameter: the head shares the new one
    left = [name for name, p in model.named_parameters() if p.is_meta and name not in skip]
    if left:
        raise RuntimeError(f"sharded loading left tensors on the meta device: {left[:5]}")


class ExpertSliceReader:
    """Reads experts `[start, stop)` of one fused expert tensor of the model (`...experts.gate_up_proj`
    or `...experts.down_proj`, named as the model names it) from a checkpoint's safetensors files,
    in float32 (module doc). `reads` lists what was read, `(checkpoint name, first, end)` (a
    per-expert tensor: None, None: the whole of it), and `bytes_read` its bytes as stored."""

    def __init__(self, files: dict[str, Path], model_type: str) -> None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        self.files, self.names = files, checkpoint_names(files, model_type)
        # (fused target, its per-expert sources in order): gate_up_proj <- (gate, up), down_proj <- (down,)
        self.converters = [(rule.target_patterns[0].lstrip("."), [s.lstrip(".") for s in rule.source_patterns])
                           for rule in get_checkpoint_conversion_mapping(model_type) or ()
                           if isinstance(rule, WeightConverter)]
        self.reads: list[tuple[str, Optional[int], Optional[int]]] = []
        self.bytes_read = 0

    def _read(self, key: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            tensor = f.get_tensor(key) if start is None else f.get_slice(key)[start:stop]
        self.reads.append((key, start, stop))
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.float()

    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.names:  # saved fused (transformers 5's own layout): a slice of the expert dimension
            return self._read(self.names[name], start, stop)
        for target, sources in self.converters:
            if name.endswith(target):
                prefix = name[: len(name) - len(target)]
                keys = [[prefix + source.replace("*", str(j)) for j in range(start, stop)] for source in sources]
                missing = [key for group in keys for key in group if key not in self.names]
                if missing:
                    raise RuntimeError(f"the checkpoint has no tensor for the experts {missing[:3]} of {name}")
                # Each source stacked over the experts, then the sources concatenated (gate, up): [E, 2I, H].
                return torch.cat([torch.stack([self._read(self.names[key]) for key in group]) for group in keys], dim=1)
        raise RuntimeError(f"no per-expert checkpoint layout is known for {name} (transformers' conversion mapping)")
