"""What the memory plan knows of a model: `ModelShape`, read from its Hugging Face config with the
parameters counted on torch's meta device (exact for any architecture, no memory, no weights read)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a decoder-only model (from its HF config)."""

    num_params: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # MLP width (per expert for mixtures of experts)
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    largest_tensor: int = 0  # elements of the largest parameter (one refit bucket must hold it)
    lora_params: int = 0  # what trains with the configured policy.lora: adapters (+ a VLM's projector); 0 without
    embedding_params: int = 0  # input embeddings and LM head (once if tied): whole on every TP rank
    kv_cache_width: int = 0  # KV-cache elements per token and layer; 0: keys and values, 2 x kv_heads x head_dim
    expert_params: int = 0  # routed experts' elements (all MoE layers): what expert parallelism splits
    shared_experts: int = 0  # experts every token goes through (DeepSeek's n_shared_experts), in experts_per_token
    tokenizer_file_bytes: int = 0  # size of the tokenizer's tokenizer.json (0: unknown); `formulas.tokenizer_bytes`


def shape_from_hf_config(config: dict, num_params: int, largest_tensor: int = 0, lora_params: int = 0,
                         embedding_params: Optional[int] = None, expert_params: int = 0) -> ModelShape:
    """`ModelShape` from a Hugging Face config dict (config.json's keys; llama / qwen / mixtral /
    deepseek_v3 names). `embedding_params` (default: vocabulary x hidden, twice unless
    `tie_word_embeddings`) are the embeddings' and LM head's elements, which tensor parallelism leaves whole.

    Multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank` set): a query/key head is
    `qk_nope_head_dim + qk_rope_head_dim` wide, and the KV cache holds the compressed latent and the
    shared rotary key (`kv_lora_rank + qk_rope_head_dim` per token and layer, as transformers' cache
    and vLLM's MLA keep it). Shared experts (`n_shared_experts`) run on every token: they count as
    experts each token goes through. The first dense layers (`first_k_dense_replace`) are planned
    like the MoE ones."""
    hidden = config["hidden_size"]
    if embedding_params is None:
        embedding_params = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    heads = config["num_attention_heads"]
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    latent = config.get("kv_lora_rank")
    head_dim = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] if latent
                else config.get("head_dim") or hidden // heads)
    return ModelShape(
        num_params=num_params, hidden_size=hidden, num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=(config.get("moe_intermediate_size") if experts and config.get("moe_intermediate_size")
                           else config["intermediate_size"]),
        num_experts=experts,
        experts_per_token=(config.get("num_experts_per_tok") or 0) + (config.get("n_shared_experts") or 0) if experts else 0,
        largest_tensor=largest_tensor, lora_params=lora_params, embedding_params=embedding_params,
        kv_cache_width=latent + config["qk_rope_head_dim"] if latent else 0, expert_params=expert_params,
        shared_experts=(config.get("n_shared_experts") or 0) if experts else 0,
    )


def hf_config_of(policy: Any) -> Any:
    """The Hugging Face config of `policy.model_name`: a preset's, a training checkpoint's or config.json's."""
    from transformers import AutoConfig

    from posttrain.models.hf import parse_tiny_name, resolve_model_path
    from posttrain.models.presets import VL_PRESETS

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    if policy.model_name in VL_PRESETS:
        # The preset's config from its sizes: the shape needs no weights, and building them means
        # pretraining its vision tower (about 40 s of CPU).
        from posttrain.models.vision import tiny_vl_config

        hf_config = tiny_vl_config(policy.model_name)
    elif tiny is not None:
        from posttrain.models.paths import model_vocab_size
        from posttrain.models.tiny import tiny_config

        hf_config = tiny_config(*tiny, vocab_size=model_vocab_size(policy.model_name))  # `-pairs`: its own vocabulary
    else:
        from posttrain.models.paths import checkpoint_policy_dir

        # A training checkpoint (`step_N`, which every job accepts as a model) keeps its HF config
        # beside the sharded weights (`models/policy/checkpoint.py`, HF_DIR).
        checkpoint = checkpoint_policy_dir(Path(policy.model_name).expanduser())
        path = str(checkpoint / "hf") if checkpoint is not None else resolve_model_path(policy.model_name,
                                                                                       policy.tiny_arch)
        hf_config = AutoConfig.from_pretrained(path)
    return hf_config


def model_shape(policy: Any) -> ModelShape:
    """Shape of `policy.model_name` (its config.json; a preset's config): the parameters are counted
    on torch's meta device, so nothing is allocated and no weights are read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = hf_config_of(policy)
    from posttrain.models.vision_inputs import is_vision_language_config

    # A vision-language model: every parameter counts (the vision tower's too: weights, gradients,
    # optimizer state); the activations are the language model's, over the prompt's expanded image
    # tokens as well (`longest_prompt_tokens` builds prompts with them). The vision tower's own
    # activations (one short sequence of patches per image) are left out.
    vision = is_vision_language_config(hf_config)
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(hf_config)
    params = list(model.parameters())
    lora = 0
    if policy.lora.enabled:  # the adapters, on the modules LoRA resolves the targets to (models/lora.py)
        from posttrain.models.lora import target_module_names
        from posttrain.models.vision_inputs import VISION_TOWERS, vision_parts

        from posttrain.errors import UserError

        modules = dict(model.named_modules())
        try:  # the preflight's plan is where a target list that matches nothing is first known
            targets = target_module_names(model, policy.lora.target_modules)
        except ValueError as e:
            raise UserError(str(e)) from None
        lora = sum(policy.lora.dim * (modules[name].in_features + modules[name].out_features)
                   for name in targets if isinstance(modules[name], torch.nn.Linear))
        # A vision-language model's projector (its tower too, unless frozen) trains in full beside them.
        lora += sum(p.numel() for name, part in vision_parts(model).items() for p in part.parameters()
                    if not (policy.vision_tower_frozen and name.rpartition(".")[2] in VISION_TOWERS))
    heads = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
             if m is not None}  # one entry when tied
    # Routed experts: transformers 5's 3-D expert tensors (models/policy/expert_parallel.py).
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name and p.ndim == 3)
    text_config = hf_config.get_text_config() if vision else hf_config
    shape = shape_from_hf_config(json.loads(text_config.to_json_string()), sum(p.numel() for p in params),
                                 max(p.numel() for p in params), lora, sum(heads.values()), experts)
    return ModelShape(**{**shape.__dict__, "tokenizer_file_bytes": tokenizer_file_bytes(policy)})


def tokenizer_file_bytes(policy: Any) -> int:
    """Size of the tokenizer.json of `policy`'s tokenizer (`tokenizer_name`, else the model's); 0
    when it has none (a slow tokenizer) or it cannot be found here."""
    from posttrain.models.hf import parse_tiny_name, resolve_model_path
    from posttrain.models.presets import VL_PRESETS

    name = policy.tokenizer_name or policy.model_name
    try:
        if parse_tiny_name(name, policy.tiny_arch) is not None or name in VL_PRESETS:
            return 0  # a tiny preset's tokenizer is small (the character one)
        return (Path(resolve_model_path(name, policy.tiny_arch)) / "tokenizer.json").stat().st_size
    except Exception:  # noqa: BLE001 (an optional row: a tokenizer that cannot be read is preflight's to report)
        return 0


def shape_for(cfg: Any, shape: ModelShape) -> ModelShape:
    """`shape` with LoRA's adapter count estimated when a fix turns LoRA on (rank x (in + out) for
    each attention projection of each layer, the default target modules)."""
    if not cfg.policy.lora.enabled or shape.lora_params:
        return shape
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h)
    return ModelShape(**{**shape.__dict__, "lora_params": cfg.policy.lora.dim * per_layer * shape.num_layers})
