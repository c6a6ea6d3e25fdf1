"""How a `PolicyWorker`'s model is split over its worker group: FSDP2 over data parallel ranks,
DTensor tensor parallelism (TP) within a tensor-parallel group.

The group's `num_workers` ranks form a 2-D device mesh `("dp", "tp")` of shape
`(num_workers / tensor_parallel_size, tensor_parallel_size)`; rank r is data-parallel rank
`r // tp` and tensor-parallel rank `r % tp` (the ranks of one TP group are neighbours, so on GPUs
they share a node). Every decoder layer is parallelised by a plan: attention q/k/v column-wise
(each TP rank holds `heads / tp` query heads and `kv_heads / tp` key/value heads; transformers'
attention reshapes with `-1` heads, so it runs on the local heads unchanged), o row-wise (an
all-reduce gives every TP rank the full output), MLP gate/up column-wise and down row-wise. The
plan is the model's own `base_model_tp_plan` (transformers) where its config has one, else
`LLAMA_LIKE_PLAN` for llama-like model types. Then FSDP2 (`fully_shard`) shards every decoder
layer and the root over the `dp` sub-mesh, which also shards the TP shards further.

A vision-language model (LLaVA): the plan splits its language model exactly as the text model's
(the plan of its text config, under the language model's path, `language_model_path`); the vision
tower and the projector are replicated on every TP rank (sharded over `dp` by FSDP only, each
vision layer and the projector a unit, as without TP). The TP ranks get the same rows, so they run
the tower on the same images, and the image features enter the language model replicated, where
the embeddings would; the gradient that flows back into them is summed over the TP group by the
column-wise projections' input redistribution, so the tower's gradient is one worker's too.

Kept whole on every TP rank (sharded over `dp` by FSDP only): embeddings, norms, the LM head
(the fused chunked lm_head + logprob path, `linear_logprobs.py`, needs the whole vocabulary;
a vocabulary-parallel head would need a logsumexp over the shards) and mixture-of-experts
experts and routers (every TP rank runs all experts on the same tokens). Per-head q/k norms
(Qwen3, Gemma 3) run on the local heads with their weight replicated and its gradient summed over
the TP group (`SequenceParallel` over the head dimension does exactly that; Gemma 3's take
`[batch, heads, seq, head_dim]`, Qwen3's `[batch, seq, heads, head_dim]`, and a norm over the last
dimension computes the same whichever other dimension is declared split). Gemma 3's config has
its own plan (transformers'); its sliding-window layers need nothing more (the masks are built
before the first layer, the attention runs on the local heads).

Sequence parallelism (`policy.sequence_parallel`, with TP): between the attention and MLP blocks
the residual stream and the layer norms hold `1/tp` of the sequence on each TP rank (Megatron-LM's
SP, Korthikanti et al. 2022): the first decoder layer takes its rank's slice of the embeddings, the
attention and MLP blocks all-gather the sequence once at their input and keep only their slice of
it for the backward pass (`sequence_parallel.GatherSequence`), the row-wise projections
reduce-scatter instead of all-reducing, the norms' weights are replicated with their gradients
summed over the TP group, and the final norm gathers the whole sequence again for the LM head.
Masks, positions and rotary embeddings are computed before the first layer on the whole sequence,
so they need no change; micro-batches are right-padded to a multiple of `tp` tokens
(`pad_for_sequence_parallel`).

Gradients: a TP rank's replicated parameters get the same gradient on every TP rank, the sharded
ones their shard's; FSDP reduces over `dp` only. So with the loss normalised by the global token
count (counted over `dp` only: TP ranks see the same rows) and multiplied by the dp size, the
gradient equals one worker's.

Context parallelism (`policy.context_parallel_size`: split each sequence over a `cp` mesh
dimension, ring attention) lives in `context_parallel.py`; with TP its mesh is `("dp", "cp", "tp")`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch.nn.functional as F

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from posttrain.distributed import collective
from posttrain.distributed.batch import Batch
from posttrain.models.parallel_sizes import tensor_parallel_problem
from posttrain.models.policy.forward import MicroBatch
from posttrain.models.policy.sequence_parallel import GatherSequence
from posttrain.models.vision_inputs import is_vision_language_config

# posttrain's plan for llama-like decoders whose config carries no `base_model_tp_plan`
# (the same as transformers 5.23's llama plan), relative to the decoder (`model.model`).
LLAMA_LIKE_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
LLAMA_LIKE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})
# Per-head norms applied to `[batch, seq, heads, head_dim]` (Qwen3's q_norm / k_norm).
HEAD_NORMS = ("q_norm", "k_norm")


def build_mesh(device_type: str, world_size: int, tp_size: int) -> tuple[DeviceMesh, Optional[DeviceMesh]]:
    """`(dp mesh, tp mesh)` of the group; the tp mesh is None without tensor parallelism (then the
    dp mesh is the 1-D mesh of all ranks, as before TP existed)."""
    if tp_size == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",)), None
    mesh = init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def tp_plan(model: torch.nn.Module, sequence_parallel: bool = False,
            regather_in_backward: bool = True) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of `model` (module path pattern -> style), from its config's
    `base_model_tp_plan` or `LLAMA_LIKE_PLAN`; experts stay replicated. `sequence_parallel`: the
    residual stream and the layer norms between the blocks are split by sequence (module doc);
    `regather_in_backward`: see `GatherSequence` (False under activation checkpointing).

    Raises ValueError naming the model type when there is no plan, or the entries whose style
    posttrain does not apply."""
    prefix, config = language_model_path(model)  # "model": the decoder inside XForCausalLM
    if getattr(config, "kv_lora_rank", None):  # transformers' DeepSeek-V3 plan splits only the MLPs
        raise ValueError(f"policy.tensor_parallel_size: {config.model_type}'s multi-head latent attention has no "
                         "tensor-parallel plan in posttrain; use data parallelism (tensor_parallel_size=1)")
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        if config.model_type not in LLAMA_LIKE_MODEL_TYPES:
            raise ValueError(
                f"policy.tensor_parallel_size: model_type {config.model_type!r} has no base_model_tp_plan in its "
                f"config and is not one posttrain has a plan for ({sorted(LLAMA_LIKE_MODEL_TYPES)})"
            )
        base_plan = LLAMA_LIKE_PLAN
    plan: dict[str, ParallelStyle] = {}
    unsupported = []
    for pattern, style in base_plan.items():
        if ".experts" in pattern:
            continue  # experts replicated on every TP rank
        block, leaf = pattern.rsplit(".", 1)
        if style == "colwise":
            plan[f"{prefix}.{pattern}"] = ColwiseParallel()
            if sequence_parallel:  # the block's input arrives split by sequence: gather it once
                plan[f"{prefix}.{block}"] = GatherSequence(regather_in_backward)
        elif style == "rowwise":
            plan[f"{prefix}.{pattern}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        elif style == "replicated_with_grad_allreduce" and leaf in HEAD_NORMS:
            # Input [batch, seq, local heads, head_dim]: a shard of the heads (dim 2).
            plan[f"{prefix}.{pattern}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        else:
            unsupported.append(f"{pattern}: {style}")
    if unsupported:
        raise ValueError(
            f"policy.tensor_parallel_size: {config.model_type}'s base_model_tp_plan has entries posttrain does not "
            f"apply: {unsupported}"
        )
    if sequence_parallel:
        plan.update(_sequence_parallel_plan(model, prefix))
    return plan


def language_model_path(model: torch.nn.Module) -> tuple[str, Any]:
    """`(path, config)` of the decoder that tensor parallelism splits: a causal LM's own decoder
    (`model`) and config; a vision-language model's language model (LLaVA's `model.language_model`)
    and its text config (the vision tower and the projector are not in the plan: replicated)."""
    if is_vision_language_config(model.config):
        paths = [name for name, _ in model.named_modules() if name.rpartition(".")[2] == "language_model"]
        if not paths:
            raise ValueError(f"policy.tensor_parallel_size: no language_model module in {type(model).__name__}")
        return paths[0], model.config.get_text_config()
    return model.base_model_prefix, model.config


def _sequence_parallel_plan(model: torch.nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """The SP entries around the TP ones: the first layer takes its slice of the sequence, the
    layers' own norms run on their slice, the final norm gathers the sequence back."""
    from posttrain.models import moe

    if moe.is_moe(model):
        raise ValueError("policy.sequence_parallel: mixture-of-experts models are not supported (their experts are "
                         "replicated over the TP group, not split by sequence); use tensor parallelism without it")
    decoder = model.get_submodule(prefix)
    layers = getattr(decoder, "layers", None)
    if layers is None or not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise ValueError(f"policy.sequence_parallel: {type(model).__name__} has no decoder layers and final norm "
                         "where posttrain looks for them (model.layers, model.norm)")
    norms = sorted(name for name, child in layers[0].named_children() if name.endswith("layernorm"))
    if not norms:
        raise ValueError(f"policy.sequence_parallel: no *layernorm modules in {type(layers[0]).__name__}")
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                 use_local_output=True),
        f"{prefix}.norm": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True),
    }
    for name in norms:
        # A local output: Gemma 3's post-attention and post-feed-forward norms feed the residual
        # sum (a local tensor) directly; a block's GatherSequence takes a local slice as it is.
        plan[f"{prefix}.layers.*.{name}"] = SequenceParallel(use_local_output=True)
    return plan


def pad_for_sequence_parallel(mb: MicroBatch, multiple: int) -> MicroBatch:
    """`mb` with its sequence dimension right-padded (zeros) to a multiple of `multiple` tokens, so
    that SP splits it evenly. Padding is never read: rows keep their `input_lengths`, a packed row
    its `cu_seqlens` (the padding's positions start a sequence of their own)."""
    def pad(value: Any, width: int) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == width and width % multiple:
            extra = [0, 0] * (value.ndim - 2) + [0, -width % multiple]
            return F.pad(value, extra)
        return value

    width = mb.rows["input_ids"].shape[1]
    rows = Batch({key: pad(value, width) for key, value in mb.rows.items()})
    packed = mb.packed
    if packed is not None:
        total = packed["input_ids"].shape[1]
        packed = dict(packed, input_ids=pad(packed["input_ids"], total))
        if total % multiple:
            tail = torch.arange(-total % multiple, dtype=packed["position_ids"].dtype)[None, :]
            packed["position_ids"] = torch.cat([packed["position_ids"], tail], dim=1)
    return MicroBatch(rows, mb.index, packed, mb.dummy)


def tensor_parallel_size_problem(config: Any, tp_size: int) -> Optional[str]:
    """Why the model of `config` cannot be split over `tp_size` ranks (None when it can); a
    vision-language model's sizes are its language model's (the part TP splits)."""
    config = config.get_text_config()
    sizes = {key: getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    return tensor_parallel_problem(sizes, tp_size, "policy.model_name")


def shard_model(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    tp_mesh: Optional[DeviceMesh],
    *,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    weights_on_rank0_only: bool = False,
    mixed_precision: Optional[MixedPrecisionPolicy] = None,
    cpu_offload: bool = False,
    ep_mesh: Optional[DeviceMesh] = None,
    expert_reader: Optional[Callable[[str, int, int], torch.Tensor]] = None,
) -> list[torch.nn.Parameter]:
    """Tensor-parallelise `model` over `tp_mesh` (if any), then FSDP2 over `dp_mesh`: one unit per
    decoder layer (HF's `_no_split_modules`), then the root.

    `weights_on_rank0_only` (sharded loading): the other ranks' parameters are on the meta device
    and their values arrive later (`sharded_load.fill_shards_from_rank0`), so TP takes each rank's
    shard of its own tensor (`src_data_rank=None`: real on rank 0, meta elsewhere) instead of
    scattering rank 0's, a collective the meta ranks cannot serve (the pair deadlocked).

    `ep_mesh` (expert parallelism, `expert_parallel.py`): the routed experts are split over it
    first and FSDP ignores them; experts on the meta device are read by `expert_reader` (this
    rank's only, `sharded_load.ExpertSliceReader`). Returns the expert parameters so split, in
    model order (empty without EP)."""
    if tp_mesh is not None:
        # DTensor warns, once per process, that gathering a 2-D (dp, tp) sharded tensor (state
        # dicts, the gradient norm) takes two collectives instead of one: expected, and noise in a
        # job's console.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        problem = tensor_parallel_size_problem(model.config, tp_mesh.size())
        if problem:
            raise ValueError(problem)
        parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel, not activation_checkpointing),
                           src_data_rank=None if weights_on_rank0_only else 0)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"cannot find decoder layers to shard in {type(model).__name__}: _no_split_modules={sorted(layer_classes)}"
        )
    # A vision-language model's projector (LLaVA's multi_modal_projector) is a unit of its own, as the
    # vision tower's layers are (they are in `_no_split_modules`): gathered only while the images go through it.
    layers += [m for name, m in model.named_modules() if name.rpartition(".")[2] == "multi_modal_projector"]
    expert_params: list[torch.nn.Parameter] = []
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if ep_mesh is not None:
        from posttrain.models.policy.expert_parallel import shard_experts

        expert_params = shard_experts(model, ep_mesh, expert_reader)
        kwargs["ignored_params"] = set(expert_params)
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return expert_params


def mixed_precision_policy(compute_dtype: torch.dtype) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's mixed precision for `policy.precision`: parameters all-gathered in the compute dtype
    (bf16: half the all-gather traffic and unsharded memory) and gradients reduced in float32;
    None for float32 (nothing to cast). The sharded master weights and the optimizer stay float32."""
    if compute_dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, stage_group: Any = None) -> float:
    """Total gradient norm over every rank before clipping (clipped to `max_norm` when finite).

    Under TP + FSDP the gradients are DTensors on two meshes (`(dp, tp)` for TP-sharded
    parameters, `dp` for the rest); torch's `clip_grad_norm_` stacks them and refuses mixed meshes,
    so the norm is taken per mesh and combined here. `stage_group` (pipeline parallelism): the
    ranks holding the other stages, whose squares add up too (default None: none)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    if len(groups) <= 1 and stage_group is None:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    squares = 0.0
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if stage_group is not None:
        squares = float(collective.all_reduce(torch.tensor([squares], dtype=torch.float64), group=stage_group))
    total = math.sqrt(squares)
    if math.isfinite(max_norm) and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return total
