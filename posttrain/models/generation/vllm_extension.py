"""`VllmWeightLoader`: posttrain's methods inside vLLM's own workers (a vLLM "worker extension").

vLLM mixes this class into each of its workers (`LLM(worker_extension_cls=...)`); the generation
actor calls the methods on every worker with `LLM.collective_rpc`. The refit layout
(`RefitMetadata`) is sent once; each refit then sends only buffers (or handles to them), and the
model's own `load_weights` maps Hugging Face names onto vLLM's fused, tensor-parallel parameters
(`q/k/v_proj` -> `qkv_proj`, `gate/up_proj` -> `gate_up_proj`, shards per rank).

Three ways the bytes arrive (after NeMo-RL's vLLM refit):
- in-process (CPU, and any engine running in the actor's process): a packed numpy bucket, read
  zero-copy from Ray's object store;
- CUDA IPC (colocated on GPU): a handle to a packed bucket the policy worker on the same GPU
  filled;
- a collective broadcast (split placement on GPU): policy rank 0 broadcasts the packed buckets
  over a process group it shares with every vLLM worker.
Every way carries one bucket at a time (`refit.pack_bucket`), loaded before the next arrives,
except the tensors of a layer that goes on in the next bucket: vLLM's reload takes a layer in one
call, so they are copied and loaded with the rest of their layer (`vllm_reload.py`, which also
repacks CPU fused experts on every reload).
The two GPU ways have not run yet (docs/scaling.md, "GPU-only paths").

This module is imported by vLLM inside the isolated environment; it must not import vllm at
module level (the driver imports it to name it).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch

from posttrain.models.generation.vllm_reload import HeldBack, repack_experts_on_reload
from posttrain.models.refit import RefitMetadata, unpack_bucket

EXTENSION_QUALNAME = "posttrain.models.generation.vllm_extension.VllmWeightLoader"


class VllmWeightLoader:
    """Methods vLLM adds to its worker class; `self` is the vLLM worker (`self.model_runner`, `self.device`)."""

    def posttrain_set_refit_metadata(self, metadata: RefitMetadata) -> bool:
        """Keep the packed-buffer layout (once per run) and check that the model takes every name."""
        model = self.model_runner.model
        known = _loadable_names(model)
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # vLLM's checkpoint-prefix renames (LLaVA: model.x -> x)

        def vllm_name(name: str) -> Optional[str]:
            name = vllm_checkpoint_name(name, known)
            return name if mapper is None else mapper.map_name(name)

        # A name the mapper maps to None is one vLLM's loader skips on purpose.
        unknown = [name for name in metadata.names
                   if (mapped := vllm_name(name)) is not None and _vllm_param_name(mapped, known) is None]
        if unknown:
            raise ValueError(
                f"refit metadata names tensors the vLLM model cannot load, e.g. {unknown[:5]} "
                f"(its parameters look like {sorted(known)[:3]})"
            )
        self._posttrain_refit_metadata = metadata
        self._posttrain_held = HeldBack(metadata)  # a vLLM layer split between buckets loads in one piece
        repack_experts_on_reload(model)  # CPU fused experts: repack on every reload (vllm_reload.py)
        return True

    def _posttrain_metadata(self) -> RefitMetadata:
        metadata = getattr(self, "_posttrain_refit_metadata", None)
        if metadata is None:
            raise RuntimeError("refit before prepare_refit_info: call Generation.prepare_refit_info first")
        return metadata

    @torch.no_grad()
    def posttrain_load_bucket(self, buffer: Any, bucket: int) -> int:
        """Load one packed CPU bucket (a numpy uint8 array from `refit.pack_bucket`); returns the
        tensors loaded."""
        return self._posttrain_load_bucket(unpack_bucket(buffer, self._posttrain_metadata(), bucket), bucket)

    @torch.no_grad()
    def posttrain_load_ipc(self, handles_by_device: dict[str, list[Any]], bucket: int) -> int:
        """Colocated GPU refit: rebuild the policy's packed GPU bucket from CUDA IPC handles.

        `handles_by_device` maps a GPU's UUID to the handle (`torch.multiprocessing.reductions
        .reduce_tensor` output) of the bucket packed on that GPU; each vLLM worker opens the one of
        its own GPU, so no byte crosses PCIe.
        """
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        if uuid not in handles_by_device:
            raise RuntimeError(
                f"colocated refit: no packed buffers on this worker's GPU {uuid}; policy GPUs: {sorted(handles_by_device)}"
            )
        (rebuild, args), = handles_by_device[uuid]
        args = list(args)
        args[6] = self.device.index  # the handle names the sender's device ordinal; use ours (same GPU)
        buffer = rebuild(*args)
        loaded = self._posttrain_load_bucket(unpack_bucket(buffer, self._posttrain_metadata(), bucket), bucket)
        torch.cuda.synchronize()
        return loaded

    def posttrain_init_broadcast_group(self, host: str, port: int, world_size: int, rank_offset: int) -> bool:
        """Split GPU refit: join the process group in which policy rank 0 (rank 0) broadcasts
        weights to every vLLM worker (ranks `rank_offset + vLLM rank`)."""
        from posttrain.distributed.collective import new_standalone_group

        rank = rank_offset + self.rank
        self._posttrain_broadcast_group = new_standalone_group(host, port, rank, world_size, self.device)
        return True

    @torch.no_grad()
    def posttrain_load_broadcast(self) -> int:
        """Receive the buckets from the broadcast group's rank 0 one at a time, loading each
        before the next arrives (every tensor-parallel rank holds one bucket at a time)."""
        group = getattr(self, "_posttrain_broadcast_group", None)
        if group is None:
            raise RuntimeError("broadcast refit before the broadcast group was set up")
        metadata = self._posttrain_metadata()
        loaded = 0
        receive = torch.empty(metadata.max_bucket_bytes, dtype=torch.uint8, device=self.device)
        for bucket, size in enumerate(metadata.bucket_sizes):
            buffer = receive[:size]
            group.broadcast(buffer, src=0)
            loaded += self._posttrain_load_bucket(unpack_bucket(buffer, metadata, bucket), bucket)
            torch.cuda.synchronize()  # loaded before the next bucket overwrites the buffer
        return loaded

    def posttrain_suppress_token(self, token_id: int) -> bool:
        """Leave `token_id` out of every distribution the model gives (its logit at -inf): sampled
        tokens, their logprobs and prompt logprobs (the refit probe) alike. A vision-language
        model's image token: the trainer's logprobs and the native engine leave it out the same way
        (`models/vision_inputs.suppress_image_token`); a sampling parameter would not reach the
        prompt logprobs."""
        model = self.model_runner.model
        compute_logits = model.compute_logits

        def without_token(*args, **kwargs):
            logits = compute_logits(*args, **kwargs)
            if logits is not None:  # None: not the last pipeline stage
                logits[..., token_id] = float("-inf")
            return logits

        model.compute_logits = without_token
        return True

    def posttrain_weights_fingerprint(self) -> float:
        """Sum of every parameter's float64 sum: a cheap number that changes when the weights do
        (used to report an engine that did not take a refit)."""
        return float(sum(p.detach().double().sum().item() for p in self.model_runner.model.parameters()))

    def _posttrain_load_bucket(self, views: dict[str, torch.Tensor], bucket: int) -> int:
        """Load bucket `bucket`'s tensors, those of a block that goes on in a later bucket held back
        until it arrives (`vllm_reload.HeldBack`); returns the number of tensors received."""
        ready = self._posttrain_held.ready(views, bucket)
        if ready:
            self._posttrain_load(ready.items())
        return len(views)

    @torch.no_grad()
    def posttrain_load_checkpoint(self, model_path: str) -> int:
        """Load every tensor of a local safetensors checkpoint (one file or indexed shards) through
        the refit's name mapping (`vllm_checkpoint_name`); for a checkpoint vLLM's own loader
        cannot name (the engine then starts with `load_format="dummy"`). Returns the tensors loaded."""
        from safetensors import safe_open

        from posttrain.models.policy.sharded_load import safetensors_files

        files = safetensors_files(model_path)
        if not files:
            raise FileNotFoundError(f"{model_path}: no model.safetensors or model.safetensors.index.json")

        def tensors():
            for file in sorted(set(files.values())):
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self._posttrain_load(tensors())
        return len(files)

    def _posttrain_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM's in-place reload: after start-up a backend may have processed its weights into a
        # kernel layout (the CPU backend repacks linear weights, dropping their `weight_loader`),
        # so a plain `model.load_weights` of checkpoint-format tensors no longer fits; the reload
        # restores the checkpoint layout layer by layer, loads, and processes again.
        known = _loadable_names(self.model_runner.model)
        renamed = ((vllm_checkpoint_name(name, known), tensor) for name, tensor in tensors)
        self.model_runner.reload_weights(weights_iterator=renamed, is_checkpoint_format=True)


# vLLM fuses these Hugging Face projections into one parameter per layer (every decoder-only
# model in vLLM uses these names).
_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


# transformers 5 keeps each MoE layer's routed experts as two 3-D tensors (`experts.gate_up_proj`
# [E, 2I, H], `experts.down_proj` [E, H, I]); vLLM's fused-MoE loader takes them as they are into
# its `w13_weight` / `w2_weight` (under `routed_experts.` in vLLM 0.32), by the names of the
# model's checkpoints: Qwen3-MoE's `gate_up_proj` / `down_proj`, Mixtral's `w13` / `w2`.
_FUSED_EXPERTS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "w13": "w13_weight", "w2": "w2_weight"}

# Mixtral: transformers 5 names a layer's mixture `mlp` (`mlp.gate.weight`, `mlp.experts.gate_up_proj`,
# `mlp.experts.down_proj`), while vLLM 0.32's Mixtral keeps the checkpoints' `block_sparse_moe`, whose
# fused-MoE loader takes the fused tensors as `experts.w13` / `experts.w2` (its expert names are
# w1 = gate, w3 = up, w2 = down; `w13` is [gate; up] stacked as transformers stacks `gate_up_proj`).
_MIXTRAL_MOE = "block_sparse_moe"
_MIXTRAL_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}


# transformers 5.2x names a CLIP / SigLIP vision tower's modules without the `vision_model.` level
# that every LLaVA-style checkpoint before it has, and that vLLM's towers keep (its checkpoint
# mappers only move prefixes): `model.vision_tower.encoder...` in memory, `vision_tower.encoder...`
# in the checkpoints it saves, against vLLM's `vision_tower.vision_model.encoder...`.
_TOWER = "vision_tower."
_TOWER_LEVEL = "vision_model."


def _lacks_tower_level(name: str) -> bool:
    """Whether `name` is a vision tower's tensor named without the `vision_model.` level."""
    head, tower, rest = name.partition(_TOWER)
    return bool(tower) and (not head or head.endswith(".")) and not rest.startswith(_TOWER_LEVEL)


def vllm_checkpoint_name(hf_name: str, known: set[str]) -> str:
    """The checkpoint-format name vLLM's `load_weights` takes for a tensor posttrain names
    `hf_name` (a trainer's name or one in a checkpoint transformers saved): itself, except that
    - a vision tower's tensors get the `vision_model.` level back when the vLLM model (parameter
      names `known`) has it and the name lacks it;
    - a Mixtral layer's router and fused experts (transformers 5's `mlp.gate.weight`,
      `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) get vLLM's Mixtral names
      (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.w13`, `...experts.w2`) when the
      vLLM model has that layer's `block_sparse_moe`."""
    mixtral = mixtral_moe_name(hf_name, known)
    if mixtral is not None:
        return mixtral
    if not _lacks_tower_level(hf_name) or not any(
            name.startswith(_TOWER + _TOWER_LEVEL) or f".{_TOWER}{_TOWER_LEVEL}" in name for name in known):
        return hf_name
    head, _, rest = hf_name.partition(_TOWER)
    return f"{head}{_TOWER}{_TOWER_LEVEL}{rest}"


def mixtral_moe_name(hf_name: str, known: set[str]) -> Optional[str]:
    """vLLM's Mixtral name of a transformers 5 Mixtral router or fused-experts tensor (see
    `vllm_checkpoint_name`), or None for any other tensor or a vLLM model without that layer's
    `block_sparse_moe`."""
    layer, mlp, rest = hf_name.partition(".mlp.")
    # A set lookup (every vLLM Mixtral block has its router): this runs for every tensor of every refit.
    if not mlp or f"{layer}.{_MIXTRAL_MOE}.gate.weight" not in known:
        return None
    if rest == "gate.weight":
        return f"{layer}.{_MIXTRAL_MOE}.{rest}"
    kind, _, fused = rest.partition(".")
    if kind == "experts" and fused in _MIXTRAL_EXPERTS:
        return f"{layer}.{_MIXTRAL_MOE}.experts.{_MIXTRAL_EXPERTS[fused]}"
    return None


def checkpoint_needs_vllm_names(tensor_names: Iterable[str]) -> bool:
    """Whether a checkpoint names its vision tower without the `vision_model.` level (see
    `vllm_checkpoint_name`), which vLLM's own loader cannot place."""
    return any(_lacks_tower_level(name) for name in tensor_names)


def _loadable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}


def _vllm_param_name(hf_name: str, known: set[str]) -> Optional[str]:
    """The vLLM parameter an HF tensor name loads into, or None if the model has none.

    Only for the metadata check: loading itself is the model's `load_weights`.
    """
    if hf_name in known:
        return hf_name
    parts = hf_name.split(".")
    fused = [_FUSED.get(p, p) for p in parts]
    candidate = ".".join(fused)
    if candidate in known:
        return candidate
    if len(parts) > 2 and parts[-2] == "experts" and parts[-1] in _FUSED_EXPERTS:
        for inner in ("", "routed_experts."):
            candidate = f"{'.'.join(parts[:-1])}.{inner}{_FUSED_EXPERTS[parts[-1]]}"
            if candidate in known:
                return candidate
    # Tied or absent heads (vLLM drops lm_head when embeddings are tied; load_weights skips it).
    if parts[0] == "lm_head" and not any(n.startswith("lm_head") for n in known):
        return hf_name
    # vLLM builds a LLaVA-style vision tower only up to the layer whose features the projector
    # reads: its final norm and any later layers are unused, and its loader skips them.
    _, level, rest = hf_name.partition(_TOWER_LEVEL)
    if level and _TOWER in hf_name:
        layer = re.match(r"encoder\.layers\.(\d+)\.", rest)
        if rest.startswith("post_layernorm.") or (
                layer and not any(f"{_TOWER_LEVEL}encoder.layers.{layer.group(1)}." in name for name in known)):
            return hf_name
    # Rotary caches and similar non-persistent buffers vLLM recomputes.
    if parts[-1] in ("inv_freq", "cos_cached", "sin_cached"):
        return hf_name
    return None
