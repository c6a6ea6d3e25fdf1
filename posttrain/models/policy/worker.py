"""`PolicyWorker`: one training rank (a Ray actor created by `Policy`).

Each worker holds the model, the optimizer and the LR scheduler. With more than one worker the
model is sharded (`parallel.py`): DTensor tensor parallelism within groups of
`policy.tensor_parallel_size` workers, FSDP2 (`fully_shard` on every decoder layer and on the
root) over the data-parallel ranks; both work over gloo on CPU as well as nccl on GPU. With one
worker it is a plain module. Master weights and optimizer state are float32; `policy.precision`
picks the compute dtype (autocast; with FSDP2 also the dtype parameters are all-gathered in,
gradients being reduced in float32), so a bf16 run keeps exact fp32 updates.

Exact loss normalisation (NeMo-RL, `nemo-rl.md` section 3, "Inside policy.train"): for every
optimizer step the worker all-reduces the valid token / sequence counts of its rows, so each
micro-batch's loss is already divided by the *global* counts. FSDP averages gradients over
ranks, so the loss is multiplied by the data-parallel size before `backward`; the accumulated
gradient then equals the gradient of one big batch, whatever the split into ranks, micro-batches
or packed bins. The ranks of a tensor-parallel group see the same rows, so counts and metrics
are reduced over the data-parallel ranks only (`self.dp_group`). So do the ranks of a
context-parallel group (`context_parallel.py`): each holds a slice of every row's tokens, FSDP2
shards over `dp x cp`, and the loss is multiplied by `dp * cp` (`self.fsdp_size`).

Besides training and inference here, a worker is made of mixins: building and sharding the model
(`ModelLoading`, `model_loading.py`), checkpoints and HF export (`Checkpointing`, `checkpoint.py`),
weights leaving for export and refit (`WeightExport`, `weight_export.py`), offloading while the
colocated engine generates (`OffloadsDuringGeneration`, `offload.py`) and per-phase memory
(`MeasuresPhases`, `utils/phase_memory.py`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import transformers
from torch.distributed.tensor import DTensor

from posttrain.config.schema import PolicyConfig
from posttrain.distributed import collective
from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import DistributedWorker
from posttrain.models import lora, moe, moe_balance, router_replay
from posttrain.models.hf import load_tokenizer, pick_dtype, resolve_model_path
from posttrain.cpu_precision import float32_matmuls_where_bfloat16_is_slow
from posttrain.models.parallel_sizes import expert_parallel_problem
from posttrain.models.policy import checkpoint as ckpt
from posttrain.models.policy import context_parallel, expert_parallel, parallel, pipeline, sharded_load
from posttrain.models.policy.checkpoint import Checkpointing
from posttrain.models.policy.forward import (
    MicroBatch,
    compute_autocast,
    dynamic_microbatches,
    fixed_size_microbatches,
    logprob_positions,
    microbatch_logits,
    microbatch_logprobs,
    microbatch_scores,
    microbatch_values,
    packed_microbatches,
)
from posttrain.models.policy.linear_logprobs import use_fused_logprobs
from posttrain.models.policy.model_loading import ModelLoading, is_mixture_of_experts
from posttrain.models.policy.offload import OffloadsDuringGeneration
from posttrain.models.policy.weight_export import WeightExport
from posttrain.models import vision_inputs
from posttrain.models.vision_inputs import check_vision_policy, is_vision_language_model
from posttrain.utils import memory
from posttrain.utils.lr_schedule import build_lr_scheduler
from posttrain.utils.metrics import NEUTRAL, accumulate, average_over_steps, reduction, valid_counts
from posttrain.utils.phase_memory import MeasuresPhases, measured_phase

# The loss input types each model type trains with (a loss's `input_type`).
INPUT_TYPES = {"lm": ("logprobs", "logits"), "reward": ("scores",), "value": ("values",)}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def fused_optimizer_kwargs(name: str, params: list[torch.Tensor]) -> dict[str, Any]:
    """`fused=True` for Adam / AdamW when every parameter is a plain tensor (one worker, no FSDP2
    DTensors): the fused kernel updates each parameter in one pass. torch's default on CPU is the
    single-tensor loop, whose `exp_avg_sq.sqrt() / bias_correction2_sqrt` makes two temporary copies
    of each parameter in turn: two float32 copies of the largest one at the step's peak (Gemma 3
    270M's 262,144 x 640 embedding: 1.25 GiB, measured; `plan.formulas.optimizer_step_bytes`)."""
    if name not in ("adam", "adamw") or not params or any(isinstance(p, DTensor) for p in params):
        return {}
    return {"fused": True}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP-sharded) tensor, sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class PolicyWorker(pipeline.PipelineParallel, ModelLoading, Checkpointing, WeightExport, OffloadsDuringGeneration,
                   MeasuresPhases, DistributedWorker):
    """Training, logprob inference, checkpoints and weight export for one rank (see `parallel.py`).

    Args:
        cfg: the `policy` config section (a `PolicyConfig` or a dict validated into one).
        init_reference_model: keep a frozen copy of the initial weights for
            `get_reference_logprobs` (KL penalty, DPO). The copy is this rank's shard, kept in
            CPU memory (1/dp of the model per worker); it is swapped into the live parameters for
            the duration of a reference forward pass, so it costs no accelerator memory.
        init_optimizer: build the optimizer and scheduler (default True; False for inference-only).
        weights_path: a directory written by `save_checkpoint` to start from (default None: the
            weights of `cfg.model_name`). The reference model is always the `model_name` weights,
            as in NeMo-RL. Optimizer, scheduler and RNG state are restored too when present and
            `init_optimizer` is set.
        model_type: "lm" (default; causal LM, logprobs), "reward" (`AutoModelForSequenceClassification`
            with one label: a scalar score per sequence for losses with `input_type == "scores"`) or
            "value" (`AutoModelForTokenClassification` with one label: PPO's critic, a value per
            token for losses with `input_type == "values"`; `get_values`).
    """

    def __init__(
        self,
        cfg: PolicyConfig | dict,
        init_reference_model: bool,
        init_optimizer: bool = True,
        weights_path: Optional[str] = None,
        model_type: str = "lm",
    ) -> None:
        super().__init__()
        transformers.utils.logging.disable_progress_bar()  # one bar per worker per load is noise
        self.cfg = cfg if isinstance(cfg, PolicyConfig) else PolicyConfig.model_validate(cfg)
        if model_type not in ckpt.MODEL_CLASSES:
            raise ValueError(f"model_type={model_type!r}; choose one of {sorted(ckpt.MODEL_CLASSES)}")
        self.model_type = model_type
        # DistributedWorker set self.rank, self.world_size and self.device (cuda when present).
        self.tp_size = self.cfg.tensor_parallel_size
        self.cp_size = self.cfg.context_parallel_size
        self.pp_size = self.cfg.pipeline_parallel_size
        if self.world_size % (self.tp_size * self.cp_size * self.pp_size):
            raise ValueError(f"policy.tensor_parallel_size={self.tp_size} * policy.context_parallel_size="
                             f"{self.cp_size} * policy.pipeline_parallel_size={self.pp_size} does not divide the "
                             f"{self.world_size} workers")
        if self.pp_size > 1 and model_type != "lm":
            raise ValueError("policy.pipeline_parallel_size > 1 is supported for language models, not reward or value "
                             "models")
        if self.cp_size > 1 and model_type != "lm":
            raise ValueError("policy.context_parallel_size > 1 is supported for language models, not reward or "
                             "value models")
        self.dp_size = self.world_size // (self.tp_size * self.cp_size * self.pp_size)
        # Expert parallelism (expert_parallel.py): the experts split over groups of ep ranks; set by _shard_model.
        self.ep_size = self.cfg.expert_parallel_size
        self.expert_params: list[torch.nn.Parameter] = []
        self.expert_replica_group: Any = None
        self.fsdp_size = self.dp_size * self.cp_size  # ranks FSDP averages gradients over
        self.dp_group: Any = None  # the data-parallel ranks' process group (None: all ranks, the default group)
        self.cp_group: Any = None  # the context-parallel ranks' process group (None: no CP)
        self.metrics_group: Any = None  # where metrics reduce: dp_group, or dp x pp under PP (pipeline.py)
        self.compute_dtype = pick_dtype(self.cfg.precision, self.device)
        self.step = 0  # number of `train` calls (= scheduler steps) so far
        # Only rank 0 reads the weights and the others receive their FSDP / TP shards (sharded_load.py).
        # Not for mixtures of experts: their FSDP all-gathers disagreed in size between the rank that
        # loaded and the meta-built one (a gloo size mismatch killed the pair; tests/functional/test_moe_training.py).
        # A vision-language model (models/vision_inputs.py): every rank reads it (sharded_load builds text models).
        self.is_vision = model_type == "lm" and is_vision_language_model(self.cfg.model_name, self.cfg.tiny_arch)
        if self.is_vision:
            check_vision_policy(self.cfg)
        self.loads_sharded = (model_type == "lm" and self.world_size > 1 and self.cp_size == 1 and self.pp_size == 1
                              and not self.is_vision and not self.cfg.lora.enabled and not is_mixture_of_experts(self.cfg))

        model_path = resolve_model_path(self.cfg.model_name, self.cfg.tiny_arch)
        self.tokenizer = load_tokenizer(self.cfg.tokenizer_name or model_path, self.cfg.tiny_arch)
        memory.reset_peak_rss()  # the load's own high-water mark (`load_host_memory`)
        rss_before_load = memory.rss_bytes()
        self.model = self._load_model(model_path)
        self.lora_scaling: Optional[float] = None
        if self.cfg.lora.enabled:
            if model_type != "lm":
                raise ValueError("policy.lora.enabled: LoRA is supported for language models, not reward or value "
                                 "models (yet)")
            self.model = lora.apply_lora(self.model, self.cfg.lora)  # adapters on the language model (lora.py)
            self.lora_scaling = lora.scaling(self.cfg.lora)
        float32_matmuls_where_bfloat16_is_slow(self.model, self.compute_dtype, self.device)
        if self.is_vision and (self.cfg.lora.enabled or self.cfg.vision_tower_frozen):
            # LoRA fixed every weight but the adapters: the vision side trains as freeze_vision_tower says.
            frozen = vision_inputs.set_vision_training(self.model, train_tower=not self.cfg.vision_tower_frozen)
            if self.rank == 0 and frozen:
                print(f"[posttrain] policy.freeze_vision_tower: {frozen} vision-tower parameters fixed", flush=True)
        self.hf_config = self.model.config
        if self.ep_size > 1:
            problem = ("reward and value models are not supported" if model_type != "lm"
                       else expert_parallel_problem(self.hf_config, self.ep_size))
            if problem:
                raise ValueError(problem if problem.startswith("policy.") else f"policy.expert_parallel_size: {problem}")
        # Mixture of experts: weight of the router's load-balancing loss (0: dense, or turned off).
        self.router_aux_loss_coef = moe.aux_loss_coef(self.model, self.cfg.router_aux_loss_coef)
        # Routers balanced by a bias (DeepSeek-V3): moved after each optimizer step (models/moe_balance.py).
        self.bias_update_rate = self.cfg.moe_router_bias_update_rate
        if self.bias_update_rate > 0 and not moe_balance.balance_biases(self.model):
            raise ValueError(f"policy.moe_router_bias_update_rate={self.bias_update_rate}: {type(self.model).__name__}"
                             f"'s routers have no {moe_balance.BIAS_NAME} to update (DeepSeek-V3-style models do)")
        self.model.config.use_cache = False  # no KV cache in training / scoring forwards
        if self.cfg.activation_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.fused_logprobs = model_type == "lm" and use_fused_logprobs(self.model, self.cfg.fused_logprobs, self.rank == 0)
        if self.cp_size > 1:
            context_parallel.enable_ring_attention(self.model)
            if self.rank == 0:
                print(f"[posttrain] context parallel x{self.cp_size}: ring attention over load-balanced sequence "
                      "chunks; FSDP2 shards over data x context parallel ranks", flush=True)
        if self.tp_size > 1 and self.rank == 0:
            whole = ("embeddings, LM head, vision tower and projector" if self.is_vision
                     else "embeddings, LM head and MoE experts")
            print(f"[posttrain] tensor parallel x{self.tp_size}: {whole} stay whole on every tensor-parallel rank "
                  "(the fused chunked lm_head + logprob path needs the whole vocabulary)", flush=True)
        self.is_fsdp = self.world_size > 1
        if self.is_fsdp and self.loads_sharded:
            rank0_weights = sharded_load.rank0_weights(self.model, self.rank)
            self._shard_model()
            sharded_load.fill_shards_from_rank0(self.model, rank0_weights)  # other ranks built on meta
            del rank0_weights
        elif self.is_fsdp:
            self._shard_model()
        else:
            self.model.to(self.device)
        self.load_host_memory = {"rss_before": rss_before_load, "peak": memory.peak_rss_bytes(),
                                 "rss_after": memory.rss_bytes()}

        self.reference_params: Optional[dict[str, torch.Tensor]] = None
        if init_reference_model:
            self.reference_params = {
                name: _local(p.detach()).to("cpu", copy=True) for name, p in self._weights_and_balance_biases()
            }

        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
        if init_optimizer:
            opt = self.cfg.optimizer
            kwargs: dict[str, Any] = dict(lr=opt.lr, weight_decay=opt.weight_decay)
            if opt.name != "sgd":
                kwargs.update(betas=tuple(opt.betas), eps=opt.eps)
            trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
            if opt.name == "muon":  # Muon on the hidden layers' matrices, AdamW on the rest
                from posttrain.models.policy.muon import build_muon

                self.optimizer = build_muon(self.model, opt)
            else:
                self.optimizer = OPTIMIZERS[opt.name](trainable, **kwargs, **fused_optimizer_kwargs(opt.name, trainable))
            self.scheduler = build_lr_scheduler(self.optimizer, opt, self.cfg.scheduler)
        if weights_path is not None:
            self.load_checkpoint(weights_path, load_optimizer=init_optimizer)

    # ----------------------------------------------------------------------- micro-batching
    def _microbatches(self, batch: Batch, for_training: bool, rows_per_mb: int) -> list[MicroBatch]:
        """Cut `batch` into micro-batches, padded with dummies to the same count on every rank."""
        packing, dynamic = self.cfg.sequence_packing, self.cfg.dynamic_batching
        if batch.size == 0:
            mbs = []
        elif self.cfg.batch_invariant:  # each sequence alone, unpadded: nothing else in its forward
            mbs = fixed_size_microbatches(batch, 1)
        elif packing.enabled:
            budget = packing.train_mb_tokens if for_training else packing.logprob_mb_tokens
            mbs = packed_microbatches(batch, budget, packing.algorithm)
        elif dynamic.enabled:
            budget = dynamic.train_mb_tokens if for_training else dynamic.logprob_mb_tokens
            mbs = dynamic_microbatches(batch, budget, dynamic.sequence_length_round)
        else:
            mbs = fixed_size_microbatches(batch, rows_per_mb)
        if self.world_size > 1:
            count = collective.all_reduce(torch.tensor([len(mbs)], dtype=torch.long), op="max")
            if int(count) == 0:
                return []
            if not mbs:  # this rank has no rows: a one-token stand-in keeps the collectives in step
                pad = Batch(input_ids=torch.zeros(1, 1, dtype=torch.long), input_lengths=torch.ones(1, dtype=torch.long))
                mbs = [fixed_size_microbatches(pad, 1)[0].as_dummy()]
            mbs += [mbs[-1].as_dummy() for _ in range(int(count) - len(mbs))]
        if self.cfg.sequence_parallel:
            mbs = [parallel.pad_for_sequence_parallel(mb, self.tp_size) for mb in mbs]
        return mbs

    def _forward(
        self, mb: MicroBatch, temperature: float, input_type: str = "logprobs", for_loss: bool = False
    ) -> torch.Tensor:
        """Scores, logits or logprobs of one micro-batch; `for_loss`: logprobs are needed only where
        the loss reads them (the fused path leaves the other positions 0)."""
        # Batch-invariant: the fused path's token chunks hold every position of the sequence, in a
        # training pass too, so a logprob does not depend on which positions the loss reads.
        for_loss = for_loss and not self.cfg.batch_invariant
        if self.model_type == "reward":
            return microbatch_scores(self.model, mb, self.device, self.compute_dtype)
        if self.model_type == "value":
            return microbatch_values(self.model, mb, self.device, self.compute_dtype)
        if self.cp_size > 1:
            if input_type == "logits":
                raise ValueError("policy.context_parallel_size > 1 does not give full logits (distillation's "
                                 "input_type='logits', get_topk_logits); use context_parallel_size=1 there")
            wanted = logprob_positions(mb.rows, for_loss and self.fused_logprobs)
            with compute_autocast(self.device, self.compute_dtype):
                return context_parallel.microbatch_logprobs(
                    self.model, mb.rows, self.device, self.cp_group, self.cp_size, temperature,
                    fused=self.fused_logprobs, wanted=wanted.to(self.device),
                    sequence_parallel_size=self.tp_size if self.cfg.sequence_parallel else 1, packed=mb.packed)
        with vision_inputs.keep_vision_tower_in_step(self.model, self.device, self.is_vision and self.is_fsdp
                                                     and vision_inputs.rows_pixel_values(mb.rows) is None):
            if input_type == "logits":  # full next-token logits [n, L, V] (distillation)
                outputs = microbatch_logits(self.model, mb, self.device, self.compute_dtype, temperature)
            else:
                routed = (mb.rows.get(router_replay.ROUTED_EXPERTS) if self.cfg.moe_router_replay and mb.packed is None
                          else None)
                with router_replay.replaying(self.model, None if routed is None else routed.flatten(0, 1)):
                    outputs = microbatch_logprobs(self.model, mb, self.device, self.compute_dtype, temperature,
                                                  fused=self.fused_logprobs, loss_positions_only=for_loss)
        return outputs

    # ------------------------------------------------------------------------------ logprobs
    @measured_phase("logprobs")
    def get_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """`Batch({"logprobs": [B, S]})`: position i = log p(token_i | tokens_<i) (float32), 0 at
        position 0 and in the padding; logits are divided by `temperature` first (default 1.0).

        Collective under FSDP: every rank must call it (a rank may have 0 rows).
        """
        if self.model_type != "lm":
            raise ValueError("get_logprobs needs model_type='lm'; a reward model has get_scores")
        return Batch(logprobs=self._infer(batch, temperature))

    def get_scores(self, batch: Batch) -> Batch:
        """`Batch({"scores": [B]})` from a reward model (`model_type="reward"`); collective like `get_logprobs`."""
        if self.model_type != "reward":
            raise ValueError("get_scores needs model_type='reward'")
        return Batch(scores=self._infer(batch, 1.0))

    @measured_phase("logprobs")
    def get_values(self, batch: Batch) -> Batch:
        """`Batch({"values": [B, S]})` from a value model (`model_type="value"`), aligned like
        `get_logprobs` (`forward.microbatch_values`); collective like `get_logprobs`."""
        if self.model_type != "value":
            raise ValueError("get_values needs model_type='value'")
        return Batch(values=self._infer(batch, 1.0))

    @torch.no_grad()
    def _infer(self, batch: Batch, temperature: float) -> torch.Tensor:
        self._require(batch, ("input_ids", "input_lengths"), "inference")
        self.model.eval()
        if self.pp_size > 1:
            return self._pipeline_infer(batch, temperature)
        batch_size, seq_len = batch["input_ids"].shape
        scores = self.model_type == "reward"
        out = torch.zeros((batch_size,) if scores else (batch_size, seq_len))
        for mb in self._microbatches(batch, for_training=False, rows_per_mb=self.cfg.logprob_batch_size):
            values = self._forward(mb, temperature).float().cpu()
            if mb.dummy:
                continue
            if scores:
                out[mb.index] = values
            else:
                out[mb.index, : values.shape[1]] = values[:, :seq_len]  # sequence parallel pads the width
        return out

    @torch.no_grad()
    def get_topk_logits(self, batch: Batch, k: int, temperature: float = 1.0, token_logprobs: bool = False) -> Batch:
        """`Batch(topk_logits [B, S, k] float32, topk_indices [B, S, k] long)`: at every position i the
        `k` largest next-token logits for token i (divided by `temperature`) and their vocabulary
        indices, aligned like `get_logprobs` (position 0 and the padding hold 0). A distillation
        teacher's answer; collective like `get_logprobs`. `token_logprobs` (default False) adds
        `token_logprobs [B, S]`, log p(token_i | tokens_<i) from the same forward (a cross-tokenizer
        teacher's span log-probabilities) and `logsumexp [B, S]`, each position's log normaliser (top-k
        logits minus it are log-probabilities).
        """
        if self.model_type != "lm":
            raise ValueError("get_topk_logits needs model_type='lm'")
        if self.pp_size > 1:
            raise ValueError("get_topk_logits: policy.pipeline_parallel_size > 1 gives logprobs, not full logits; use "
                             "pipeline_parallel_size=1 for a teacher")
        self._require(batch, ("input_ids", "input_lengths"), "get_topk_logits")
        vocab = self.hf_config.vocab_size
        if not 1 <= k <= vocab:
            raise ValueError(f"get_topk_logits: k={k} must be between 1 and the vocabulary size {vocab}")
        self.model.eval()
        batch_size, seq_len = batch["input_ids"].shape
        values = torch.zeros(batch_size, seq_len, k)
        indices = torch.zeros(batch_size, seq_len, k, dtype=torch.long)
        chosen = torch.zeros(batch_size, seq_len) if token_logprobs else None
        normaliser = torch.zeros(batch_size, seq_len) if token_logprobs else None
        for mb in self._microbatches(batch, for_training=False, rows_per_mb=self.cfg.logprob_batch_size):
            logits = self._forward(mb, temperature, input_type="logits")[:, :seq_len]  # SP pads the width
            if mb.dummy:
                continue
            top = logits.topk(k, dim=-1)
            values[mb.index, : logits.shape[1]] = top.values.cpu()
            indices[mb.index, : logits.shape[1]] = top.indices.cpu()
            if chosen is not None:
                ids = mb.rows["input_ids"][:, : logits.shape[1]].to(logits.device)
                lse = logits.logsumexp(-1)
                lp = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
                chosen[mb.index, 1: logits.shape[1]] = lp[:, 1:].cpu()
                normaliser[mb.index, : logits.shape[1]] = lse.cpu()
        if chosen is not None:
            return Batch(topk_logits=values, topk_indices=indices, token_logprobs=chosen, logsumexp=normaliser)
        return Batch(topk_logits=values, topk_indices=indices)

    @measured_phase("logprobs")
    def get_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """Like `get_logprobs`, from the frozen initial weights (needs `init_reference_model`)."""
        if self.reference_params is None:
            raise RuntimeError("get_reference_logprobs needs a Policy created with init_reference_model=True")
        if router_replay.ROUTED_EXPERTS in batch and not self.cfg.moe_router_replay_reference:
            # The reference routes each token itself (policy.moe_router_replay_reference, default False): the KL is
            # to the reference model as it is, not to one forced onto the rollout's experts. NeMo-RL skips the
            # replay for reference logprobs on purpose (its Megatron worker, `_should_use_router_replay`); verl's R3
            # replays in every forward of its actor engine, so a LoRA policy's reference follows the rollout's routes.
            batch = Batch({key: value for key, value in batch.items() if key != router_replay.ROUTED_EXPERTS})
        with self._reference_weights():
            return self.get_logprobs(batch, temperature)

    @contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """Swap the reference weights into the live parameters, and back afterwards."""
        assert self.reference_params is not None
        self._reshard()
        live = {name: _local(p.detach()) for name, p in self._weights_and_balance_biases()}
        backup = {name: t.to("cpu", copy=True) for name, t in live.items()}
        with torch.no_grad():
            for name, t in live.items():
                t.copy_(self.reference_params[name])
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for name, t in live.items():
                    t.copy_(backup[name])

    def _weights_and_balance_biases(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters and the routers' balancing biases: the reference model is both, since
        `policy.moe_router_bias_update_rate` moves the biases outside the optimizer."""
        return list(self.model.named_parameters()) + list(moe_balance.balance_biases(self.model).items())

    # --------------------------------------------------------------------------------- train
    @measured_phase("training")
    def train(
        self,
        batch: Batch,
        loss_fn: Any,
        *,
        global_batch_size: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Optimizer step(s) on this rank's rows; one scheduler step per call.

        Args:
            batch: this rank's rows (`input_ids`, `input_lengths`, `token_mask`, `sample_mask`,
                plus whatever the loss reads). Row k*L..(k+1)*L-1 belongs to optimizer step k,
                L = global_batch_size / dp.
            loss_fn: `loss_fn(logprobs, mb, global_valid_seqs, global_valid_toks) -> (loss, metrics)`.
            global_batch_size: rows per optimizer step over all ranks (default
                `policy.train_global_batch_size`).
            micro_batch_size: rows per micro-batch without packing / dynamic batching (default
                `policy.train_micro_batch_size`).
            temperature: logits are divided by it, as in `get_logprobs` (default 1.0).

        Returns:
            Loss metrics summed over micro-batches and ranks (`_min`/`_max` names: min/max) and
            averaged over the optimizer steps of this call, plus `grad_norm` (mean, before
            clipping), `lr` (of this call's steps), `global_valid_toks` and `global_valid_seqs`
            (totals); for a mixture of experts `moe/expert_load_max_over_mean` and
            `moe/expert_load_entropy` (models/moe_balance.py; averaged over the steps). Identical on every rank.
        """
        if self.optimizer is None:
            raise RuntimeError("train needs a Policy created with init_optimizer=True")
        input_type = getattr(loss_fn, "input_type", "logprobs")  # "logprobs", "scores", "logits" or "values"
        scores = input_type == "scores"
        if self.pp_size > 1 and input_type != "logprobs":
            raise ValueError(f"policy.pipeline_parallel_size > 1 trains on logprobs only, not loss input_type={input_type!r}")
        if input_type not in INPUT_TYPES[self.model_type]:
            raise ValueError(f"loss input_type={input_type!r} does not fit model_type={self.model_type!r}")
        self._require(batch, ("input_ids", "input_lengths", "sample_mask") + (() if scores else ("token_mask",)), "train")
        gbs = global_batch_size or self.cfg.train_global_batch_size
        mbs = micro_batch_size or self.cfg.train_micro_batch_size
        if gbs % self.dp_size:
            raise ValueError(f"global batch size {gbs} is not divisible by the {self.dp_size} data-parallel workers")
        local_gbs = gbs // self.dp_size
        if batch.size == 0 or batch.size % local_gbs:
            raise ValueError(
                f"this worker got {batch.size} rows, not a positive multiple of global_batch_size / dp = {local_gbs}"
            )

        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        sums: dict[str, float] = {}
        grad_norms, total_toks, total_seqs = [], 0.0, 0.0
        balance: dict[str, float] = {}
        num_steps = batch.size // local_gbs
        for step_index in range(num_steps):
            rows = batch.select(torch.arange(step_index * local_gbs, (step_index + 1) * local_gbs))
            valid_seqs, valid_toks = self._global_counts(rows, scores)
            total_toks, total_seqs = total_toks + float(valid_toks), total_seqs + float(valid_seqs)
            router_tokens = self._global_input_tokens(rows) if self.router_aux_loss_coef > 0 else None
            self.optimizer.zero_grad(set_to_none=True)
            bad_microbatches: list[int] = []
            loads = moe_balance.new_loads(self.model)  # None for a dense model
            if self.pp_size > 1:  # the loss runs on the last stage (pipeline.py)
                bad_microbatches = self._pipeline_train_step(rows, mbs, loss_fn, valid_seqs, valid_toks, sums, temperature)
            for mb_index, mb in enumerate([] if self.pp_size > 1 else
                                          self._microbatches(rows, for_training=True, rows_per_mb=mbs)):
                with moe.record_router_logits(self.model, enabled=router_tokens is not None) as routers, \
                        moe_balance.record_expert_choices(self.model, loads):
                    outputs = self._forward(mb, temperature, input_type, for_loss=True)
                if mb.dummy:
                    (outputs.sum() * 0.0).backward()
                    continue
                if loads is not None:
                    loads.add(self._token_mask(mb))
                loss, metrics = loss_fn(outputs, mb.rows.to(self.device), valid_seqs, valid_toks)
                if routers is not None:
                    router_loss = self._router_loss(mb, routers, router_tokens)
                    loss = loss + self.router_aux_loss_coef * router_loss
                    metrics = {**metrics, "router_aux_loss": router_loss.detach()}
                if not torch.isfinite(loss):
                    bad_microbatches.append(mb_index)
                # Keep going even on a bad loss so the other ranks' collectives stay in step.
                (loss * self.fsdp_size).backward()
                accumulate(sums, metrics)
            grad_norm = self._clip_grad_norm()
            self._raise_if_not_finite(bad_microbatches, grad_norm, step_index)
            self.optimizer.step()
            grad_norms.append(grad_norm)
            if loads is not None:
                accumulate(balance, self._balance_experts(loads))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1

        result = average_over_steps(self._all_reduce_metrics(sums), num_steps)
        result.update(
            grad_norm=sum(grad_norms) / num_steps, lr=lr, global_valid_toks=total_toks, global_valid_seqs=total_seqs
        )
        result.update(average_over_steps(balance, num_steps))  # from all ranks' loads already
        return result

    def _global_counts(self, rows: Batch, scores: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`(global_valid_seqs, global_valid_toks)` of one optimizer step (`posttrain.utils.metrics.
        valid_counts`), summed over data-parallel ranks."""
        counts = torch.stack(valid_counts(rows, tokens=not scores))
        collective.all_reduce(counts, group=self.dp_group)  # TP ranks hold the same rows: count them once
        counts = counts.float().to(self.device)
        return counts[0], counts[1]

    def _global_input_tokens(self, rows: Batch) -> torch.Tensor:
        """Tokens (prompt and response, no padding) of one optimizer step's rows, over data-parallel ranks."""
        count = collective.all_reduce(rows["input_lengths"].sum().double().reshape(1), group=self.dp_group)
        return count.float().to(self.device)[0]

    @staticmethod
    def _token_mask(mb: MicroBatch) -> torch.Tensor:
        """`[rows, width]` 1 at the micro-batch's real tokens, 0 in padding (a packed bin's tail)."""
        if mb.packed is not None:
            width = mb.packed["input_ids"].shape[1]
            return (torch.arange(width) < mb.packed["cu_seqlens"][-1]).long()[None, :]
        width = mb.rows["input_ids"].shape[1]
        return (torch.arange(width)[None, :] < mb.rows["input_lengths"][:, None]).long()

    def _router_loss(self, mb: MicroBatch, routers: moe.RouterLogits, step_tokens: torch.Tensor) -> torch.Tensor:
        """The micro-batch's load-balancing loss times its share of the step's tokens (see `models/moe.py`)."""
        mask = self._token_mask(mb).to(self.device)
        return moe.load_balancing_loss(self.model, routers.logits, mask) * (mask.sum() / step_tokens)

    def _balance_experts(self, loads: moe_balance.ExpertLoads) -> dict[str, float]:
        """After an optimizer step: its expert loads summed over all ranks (collective), their metrics,
        and the routers' bias update when `policy.moe_router_bias_update_rate` is on (identical on every rank)."""
        counts = collective.all_reduce(loads.counts)  # all ranks: CP ranks hold slices of the rows (module doc)
        if self.bias_update_rate > 0:
            moe_balance.update_balance_biases(self.model, counts, self.bias_update_rate)
        return moe_balance.load_metrics(counts)

    def _clip_grad_norm(self) -> float:
        """Total grad norm over all ranks before clipping; clips when `policy.max_grad_norm` is set."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        if self.expert_params:  # summed over the expert replicas, FSDP's scaling undone (expert_parallel.py)
            expert_parallel.reduce_expert_gradients(self.expert_params, self.expert_replica_group,
                                                    self.world_size // self.ep_size, self.fsdp_size)
        stages = self.pp_group if self.pp_size > 1 else None  # stages hold different parameters
        return parallel.clip_grad_norm(list(self.model.parameters()), max_norm, stages)

    def _raise_if_not_finite(self, bad_microbatches: list[int], grad_norm: float, step_index: int) -> None:
        """Raise on every rank, before the optimizer step, if any rank saw a NaN/inf."""
        flag = collective.all_reduce(torch.tensor([float(bool(bad_microbatches))]), op="max")
        if flag.item() == 0 and math.isfinite(grad_norm):
            return
        self.optimizer.zero_grad(set_to_none=True)
        where = (
            f"micro-batch(es) {bad_microbatches} on rank {self.rank}" if bad_microbatches else "another rank's micro-batch"
        )
        what = "loss" if flag.item() else f"gradient norm ({grad_norm})"
        raise FloatingPointError(
            f"non-finite {what} at train call {self.step}, optimizer step {step_index}, {where}; "
            "the optimizer step was skipped, so the weights are unchanged"
        )

    def _all_reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-rank metric totals reduced over the data-parallel ranks by the reduction rule
        (`posttrain.utils.metrics.reduction`: sum, or min / max for `_min` / `_max` names; a
        tensor-parallel group's ranks computed the same ones; under PP over `dp x pp`, where only
        the last stages have any)."""
        if self.world_size == 1:
            return dict(sums)
        keys = sorted(set().union(*collective.all_gather_object(sorted(sums), group=self.metrics_group)))
        out = {}
        for op in ("min", "max", "sum"):
            group = [k for k in keys if reduction(k) == op]
            if not group:
                continue
            values = torch.tensor([sums.get(k, NEUTRAL[op]) for k in group], dtype=torch.float64)
            collective.all_reduce(values, op=op, group=self.metrics_group)
            out.update(zip(group, values.tolist()))
        return out

    # --------------------------------------------------------------------------------- misc
    @staticmethod
    def _require(batch: Batch, keys: tuple[str, ...], who: str) -> None:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"PolicyWorker.{who}: batch is missing {missing}; it has {sorted(batch)}")
