"""Pipeline parallelism (PP, `policy.pipeline_parallel_size`, default 1): the decoder layers split
into stages on different workers, with torch's `torch.distributed.pipelining` schedules.

Layout. The workers form the mesh `("dp", "pp")`, or `("dp", "pp", "tp")` with tensor parallelism
(`build_mesh`): rank r is data-parallel rank `r // (pp * tp)`, pipeline rank `(r // tp) % pp` and
tensor-parallel rank `r % tp`; the `pp * tp` ranks of one data-parallel rank see the same rows (the
controller hands them one shard, as it does a TP group). The model has `pp * v` stages (`v` =
`policy.pipeline_virtual_stages`: 1 for 1F1B and GPipe, 2 by default for interleaved 1F1B); stage s
lives on pipeline rank `s % pp` (the "loop" placement of Narayanan et al. 2021, as torch's
interleaved schedules expect). The layers split evenly (the first `layers % stages` stages take one
more) or as `policy.pipeline_layer_split` says (layers per stage). The first stage also holds the
embeddings, the last the final norm and the LM head, and computes the logprobs there with the fused
chunked lm_head + logprob (`linear_logprobs.py`: no `[tokens, vocab]` logits), and the loss.

Each worker keeps one module, `self.model`: the transformers model with only its stages' parts
(the layers in a `ModuleDict` keyed by their index, the rest set to None), so its parameter names
are the full model's (`model.layers.7.mlp.up_proj.weight`): checkpoints (DCP, keyed by name) load
into any other PP size, PP=1 included, and refit names are the engine's. A stage is a thin
`StageChunk` over the same submodules, run by `PipelineStage`. Tensor parallelism splits the
layers first (`parallel.shard_model`'s plan), then FSDP2 shards each layer and each chunk (its
root: embeddings, norm, head) over the stage's `dp` sub-mesh (torchtitan's order).

Schedules (`policy.pipeline_schedule`): "1f1b" (default; PipeDream-Flush, Narayanan et al. 2021:
at most `pp` micro-batches' activations in flight on the first stage), "interleaved_1f1b" (`v`
stages per rank, a bubble `v` times smaller, more point-to-point traffic) and "gpipe" (Huang et al.
2019: every micro-batch's forward, then every backward; all activations in flight; for
reference). The micro-batches are `policy.train_micro_batch_size` rows (`logprob_batch_size` for
inference), every micro-batch of a step right-padded to the step's widest (the stages exchange
fixed-shape buffers); a step with fewer micro-batches than the schedule needs (1F1B: the stage
count; interleaved: a multiple of `pp`) gets zero-loss stand-ins.

Loss and gradients. The last stage calls posttrain's loss on each micro-batch's real rows with the
global counts (all-reduced over `dp` before the step, as without PP), multiplied by the dp size;
gradients are not rescaled by the schedule (`scale_grads=False`), so the accumulated gradient is
one worker's. The gradient norm sums each stage's squares over the `pp` ranks; metrics reduce over
`dp x pp` (only last stages contribute). Logprobs (policy, reference, previous policy) come from
the last stage, broadcast to the other stages so every rank returns them.

Not supported, refused in one line: with context parallelism, LoRA, sequence parallelism, sequence
packing, dynamic batching or batch-invariant mode (config); reward / value models, mixtures of
experts, tied input/output embeddings, models other than llama / qwen2 / qwen3 and full logits
(distillation, `get_topk_logits`) (worker). Every rank builds the model on the meta device and
reads only its stages' tensors from the checkpoint's safetensors files
(`sharded_load.fill_from_safetensors`); a checkpoint that is not local safetensors is read whole by
every rank, which keeps its stages. Tested on CPU over gloo (tests/unit/test_pipeline.py,
tests/functional/test_pipeline_workers.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from posttrain.distributed import collective
from posttrain.distributed.batch import Batch
from posttrain.models.parallel_sizes import (  # the stage split, shared with the memory plan
    local_stages,
    microbatches_needed,
    pipeline_problem,
    stage_layer_counts,
    stage_layers,
)
from posttrain.models.policy.forward import MicroBatch, compute_autocast
from posttrain.models.policy.linear_logprobs import fused_logprobs_problem, linear_logprobs


# ------------------------------------------------------------------------------ the stage modules
def model_problem(model: torch.nn.Module, num_stages: int = 1) -> Optional[str]:
    """Why `model` cannot be split into `num_stages` pipeline stages (None when it can)."""
    problem = pipeline_problem(model.config.to_dict(), num_stages)
    if problem:
        return problem
    problem = fused_logprobs_problem(model)
    if problem:
        return f"policy.pipeline_parallel_size: the last stage computes logprobs from the head directly, but {problem}"
    return None


def keep_stages(model: torch.nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
    """Prune `model` in place to one rank's stages: its layers in a `ModuleDict` keyed by their
    index (parameter names stay the full model's), embeddings only on the first stage, the final
    norm and the head only on the last."""
    decoder = getattr(model, model.base_model_prefix)
    decoder.layers = torch.nn.ModuleDict({str(i): decoder.layers[i] for i in layer_ids})
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        model.lm_head = None


class StageChunk(torch.nn.Module):
    """One pipeline stage over submodules of the pruned model: `input_ids [n, L]` (first stage) or
    hidden states `[n, L, H]` in, hidden states or (last stage) logprobs `[n, L]` out (float32; 0 at
    position 0; padding positions are computed and left to the caller to mask).

    Rows are right-padded and causal, so no padding mask is needed: no valid token sees the padding
    after it (the fused path's reasoning, `forward.py`). `temperature` divides the logits."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        decoder = getattr(model, model.base_model_prefix)
        self.config = model.config
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = torch.nn.ModuleList([decoder.layers[str(i)] for i in layer_ids])
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.temperature = 1.0

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        n_rows, width = input_ids.shape
        position_ids = torch.arange(width, device=hidden.device)[None, :].expand(n_rows, -1)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids)
        if self.lm_head is None:
            return hidden
        hidden = self.norm(hidden)[:, :-1].reshape(-1, hidden.shape[-1])
        values = linear_logprobs(hidden, self.lm_head.weight, input_ids[:, 1:].reshape(-1), self.temperature)
        return F.pad(values.view(n_rows, width - 1), (1, 0))


# ------------------------------------------------------------------------------ mesh and sharding
def build_mesh(device_type: str, world_size: int, pp_size: int, tp_size: int) -> dict[str, Any]:
    """The `(dp, pp[, tp])` mesh's pieces: `dp_mesh` (FSDP2 of a stage), `tp_mesh` (or None),
    `dp_group` (counts), `pp_group` (the pipeline's point-to-point and broadcasts), `metrics_group`
    (`dp x pp`: metrics, where only last stages contribute) and `pp_rank`."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size == 1:
        mesh = init_device_mesh(device_type, (world_size // pp_size, pp_size), mesh_dim_names=("dp", "pp"))
        metrics_group, tp_mesh = None, None  # dp x pp is every rank: the default group
    else:
        mesh = init_device_mesh(device_type, (world_size // (pp_size * tp_size), pp_size, tp_size),
                                mesh_dim_names=("dp", "pp", "tp"))
        metrics_group, tp_mesh = mesh["dp", "pp"]._flatten("dp_pp").get_group(), mesh["tp"]
    return dict(dp_mesh=mesh["dp"], tp_mesh=tp_mesh, dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(),
                metrics_group=metrics_group, pp_rank=mesh["pp"].get_local_rank())


def split_and_shard(model: torch.nn.Module, cfg: Any, mesh: dict[str, Any], *, mixed_precision: Any = None,
                    cpu_offload: bool = False, fill_stages: Optional[Callable[[torch.nn.Module], None]] = None,
                    ) -> tuple[list[StageChunk], list[int]]:
    """Prune `model` to this rank's stages, tensor-parallelise its layers (when `tp_mesh`), then
    FSDP2 each layer and each stage chunk over `dp_mesh`. Returns the chunks and their stage indices.

    `fill_stages` (a model built on the meta device): called on the pruned model to read its
    stages' weights (`sharded_load.fill_from_safetensors`) before anything is sharded."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from posttrain.models.policy.parallel import tensor_parallel_size_problem, tp_plan

    pp, virtual = cfg.pipeline_parallel_size, cfg.pipeline_stages_per_worker
    problem = model_problem(model, pp * virtual)
    if problem:
        raise ValueError(problem)
    counts = stage_layer_counts(model.config.num_hidden_layers, pp * virtual, cfg.pipeline_layer_split)
    layers = stage_layers(counts)
    stages = local_stages(mesh["pp_rank"], pp, virtual)
    num_stages = pp * virtual
    keep_stages(model, [i for s in stages for i in layers[s]], first=0 in stages, last=num_stages - 1 in stages)
    if fill_stages is not None:
        fill_stages(model)
    chunks = [StageChunk(model, layers[s], first=s == 0, last=s == num_stages - 1) for s in stages]
    if mesh["tp_mesh"] is not None:
        problem = tensor_parallel_size_problem(model.config, mesh["tp_mesh"].size())
        if problem:
            raise ValueError(problem)
        parallelize_module(model, mesh["tp_mesh"], tp_plan(model))
    kwargs: dict[str, Any] = {"mesh": mesh["dp_mesh"]}
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for chunk in chunks:
        for layer in chunk.layers:
            # Kept gathered between a micro-batch's forward and backward: with several micro-batches
            # in flight, resharding would all-gather every layer again per micro-batch (torchtitan).
            fully_shard(layer, reshard_after_forward=False, **kwargs)
        fully_shard(chunk, reshard_after_forward=False, **kwargs)
    return chunks, stages


# ------------------------------------------------------------------------------ running a schedule
def padded_inputs(mbs: list[MicroBatch], rows: int) -> torch.Tensor:
    """The micro-batches' `input_ids` stacked as `[len(mbs) * rows, width]`, each right-padded
    (zeros) to `rows` rows and the widest micro-batch's width."""
    width = max(mb.rows["input_ids"].shape[1] for mb in mbs)
    out = torch.zeros(len(mbs) * rows, width, dtype=torch.long)
    for k, mb in enumerate(mbs):
        ids = mb.rows["input_ids"]
        out[k * rows: k * rows + ids.shape[0], : ids.shape[1]] = ids
    return out


def build_schedule(cfg: Any, chunks: list[StageChunk], stages: list[int], pp_group: Any, device: torch.device,
                   n_microbatches: int, shape: tuple[int, int, int], activation_dtype: torch.dtype,
                   loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]) -> Any:
    """torch's schedule for `policy.pipeline_schedule` over this rank's chunks, for micro-batches
    of `shape = (rows, width, hidden)`: the stages' buffers are declared (static mode), so nothing
    is inferred at run time; built per step, since every step has its own width."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rows, width, hidden = shape
    num_stages = cfg.pipeline_parallel_size * cfg.pipeline_stages_per_worker
    # Received activations need a gradient to send back (training only).
    activations = torch.empty(rows, width, hidden, dtype=activation_dtype, device="meta",
                              requires_grad=loss_fn is not None)
    pipeline_stages = [
        PipelineStage(chunk, s, num_stages, device, group=pp_group,
                      input_args=torch.empty(rows, width, dtype=torch.long, device="meta") if s == 0 else activations,
                      output_args=torch.empty(rows, width, device="meta") if s == num_stages - 1 else activations)
        for chunk, s in zip(chunks, stages)
    ]
    if cfg.pipeline_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = Schedule1F1B if cfg.pipeline_schedule == "1f1b" else ScheduleGPipe
    return schedule(pipeline_stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


class PipelineParallel:
    """Mixin of `PolicyWorker`: training steps, inference and weight export under PP. Reads
    `self.cfg`, `self.model`, `self.device`, `self.compute_dtype`, `self.fsdp_size`, `self._microbatches`; `_shard_model`
    (`model_loading.py`) sets `self.pipeline_chunks`, `self.pipeline_stages`, `self.pp_group`."""

    pp_size: int = 1
    pipeline_chunks: list[StageChunk] = []
    stage_weights: Optional[dict[str, Any]] = None  # {tensor name: safetensors file} when stages read only theirs
    pipeline_stages: list[int] = []
    pp_group: Any = None
    # `(name, full shape, dtype, owning pipeline rank)` of every tensor of the whole model (`_gather_layout`).
    pipeline_layout: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []

    def _gather_layout(self) -> None:
        """Collective over the pipeline: every rank learns the names, full shapes and owners of
        all stages' tensors (refit metadata comes from rank 0, export gathers them in this order)."""
        mine = [(name, tuple(t.shape), t.dtype) for name, t in self.model.state_dict().items()]
        everyone = collective.all_gather_object(mine, group=self.pp_group)
        self.pipeline_layout = [(name, shape, dtype, rank) for rank, entries in enumerate(everyone)
                                for name, shape, dtype in entries]

    # ----------------------------------------------------------------- weights leaving (WeightExport)
    def refit_info(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if self.pp_size == 1:
            return super().refit_info()
        return [(name, shape, dtype) for name, shape, dtype, _ in self.pipeline_layout]

    def _exported_tensor_getter(self) -> Callable[[str], torch.Tensor]:
        """Under PP: the owning stage gathers the tensor from its shards (as without PP) and
        broadcasts it over the pipeline, so every rank can pack any bucket (collective: all ranks
        ask for the same names in the same order)."""
        local = super()._exported_tensor_getter()
        if self.pp_size == 1:
            return local
        layout = {name: (shape, dtype, owner) for name, shape, dtype, owner in self.pipeline_layout}
        ranks = torch.distributed.get_process_group_ranks(self.pp_group)
        me = ranks.index(torch.distributed.get_rank())

        def tensor_of(name: str) -> torch.Tensor:
            shape, dtype, owner = layout[name]
            tensor = local(name).contiguous() if owner == me else torch.empty(shape, dtype=dtype, device=self.device)
            collective.broadcast(tensor, src=ranks[owner], group=self.pp_group)
            return tensor

        return tensor_of

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.pp_size == 1:
            return super()._full_state_dict()
        tensor_of = self._exported_tensor_getter()
        state = {}
        for name, *_ in self.pipeline_layout:
            tensor = tensor_of(name).cpu()
            if torch.distributed.get_rank() == 0:
                state[name] = tensor
        return state

    @property
    def is_last_stage(self) -> bool:
        return self.cfg.pipeline_parallel_size * self.cfg.pipeline_stages_per_worker - 1 in self.pipeline_stages

    def _pipeline_last_rank(self) -> int:
        """The global rank of this pipeline's last stage (pipeline rank pp - 1)."""
        ranks = torch.distributed.get_process_group_ranks(self.pp_group)
        return ranks[-1]

    def _run_pipeline(self, mbs: list[MicroBatch], rows: int, temperature: float,
                      loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]) -> Optional[torch.Tensor]:
        """Run `mbs` through the pipeline (padded to `rows` rows, stand-ins appended as the
        schedule needs); with `loss_fn(output, index)` a training step (backward included),
        else inference. Returns the last stage's stacked outputs there (None elsewhere)."""
        count = microbatches_needed(len(mbs), self.cfg.pipeline_schedule, self.pp_size,
                                    self.pp_size * self.cfg.pipeline_stages_per_worker)
        mbs = mbs + [mbs[-1].as_dummy() for _ in range(count - len(mbs))]
        input_ids = padded_inputs(mbs, rows).to(self.device)
        for chunk in self.pipeline_chunks:
            chunk.temperature = temperature
        # Between stages the hidden states travel in the compute dtype (FSDP2's mixed precision).
        shape = (rows, input_ids.shape[1], self.model.config.hidden_size)
        schedule = build_schedule(self.cfg, self.pipeline_chunks, self.pipeline_stages, self.pp_group, self.device,
                                  count, shape, self.compute_dtype, loss_fn)
        index = torch.arange(count, device=self.device)
        first = 0 in self.pipeline_stages
        args = (input_ids,) if first else ()
        with compute_autocast(self.device, self.compute_dtype):
            if loss_fn is None:
                return schedule.eval(*args, input_ids=input_ids, target=index)
            return schedule.step(*args, input_ids=input_ids, target=index)

    def _pipeline_train_step(self, rows: Batch, rows_per_mb: int, loss_fn: Any, valid_seqs: torch.Tensor,
                             valid_toks: torch.Tensor, sums: dict[str, float], temperature: float) -> list[int]:
        """One optimizer step's forward and backward passes through the pipeline; the loss on the
        last stage (metrics accumulated into `sums` there). Returns the micro-batches whose loss
        was not finite (last stage)."""
        from posttrain.utils.metrics import accumulate

        mbs = self._microbatches(rows, for_training=True, rows_per_mb=rows_per_mb)
        bad: list[int] = []

        def stage_loss(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            k = int(index.reshape(-1)[0])
            if k >= len(mbs) or mbs[k].dummy:
                return output.sum() * 0.0
            mb = mbs[k]
            n_rows, width = mb.rows["input_ids"].shape
            valid = torch.arange(width, device=output.device)[None, :] < mb.rows["input_lengths"].to(output.device)[:, None]
            with torch.autocast(self.device.type, enabled=False):
                loss, metrics = loss_fn(output[:n_rows, :width].float() * valid, mb.rows.to(self.device), valid_seqs,
                                        valid_toks)
            if not torch.isfinite(loss):
                bad.append(k)
            accumulate(sums, metrics)
            return loss * self.fsdp_size  # FSDP2 averages over the stage's dp ranks

        self._run_pipeline(mbs, rows_per_mb, temperature, stage_loss)
        return bad

    @torch.no_grad()
    def _pipeline_infer(self, batch: Batch, temperature: float) -> torch.Tensor:
        """`[B, S]` logprobs of this rank's rows, computed on the last stage and broadcast to every
        rank of the pipeline (0 at position 0 and in the padding)."""
        batch_size, seq_len = batch["input_ids"].shape
        rows = self.cfg.logprob_batch_size
        mbs = self._microbatches(batch, for_training=False, rows_per_mb=rows)
        out = torch.zeros(batch_size, seq_len)
        if not mbs:
            return out
        width = max(mb.rows["input_ids"].shape[1] for mb in mbs)
        stacked = self._run_pipeline(mbs, rows, temperature, None)
        self._reshard()  # the stages keep their layers gathered after a forward (no backward frees them here)
        values = torch.zeros(len(mbs) * rows, width, device=self.device)  # on the device: nccl broadcasts there
        if stacked is not None:
            values = stacked[: len(mbs) * rows].float().contiguous()
        collective.broadcast(values, src=self._pipeline_last_rank(), group=self.pp_group)
        values = values.cpu()
        for k, mb in enumerate(mbs):
            if mb.dummy:
                continue
            n_rows, mb_width = mb.rows["input_ids"].shape
            valid = torch.arange(mb_width)[None, :] < mb.rows["input_lengths"][:, None]
            out[mb.index, :mb_width] = values[k * rows: k * rows + n_rows, :mb_width] * valid
        return out
