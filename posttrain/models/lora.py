"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for the policy.

peft wraps the target linear layers; only the adapters train, the base weights stay frozen.
Everything that leaves the trainer (refit to the generation engine, weight checksums, Hugging
Face exports, `posttrain convert`) sees *merged* weights under the base model's own names,
`W + alpha / r * B @ A`, so the generation engine and any HF reader need no LoRA support.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Mapping

import torch

from posttrain.config.schema import LoraConfig

PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's parameter names
ADAPTER = "default"  # peft's name for the single adapter


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters on `cfg.target_modules` (peft `get_peft_model`).

    The adapters' random initialisation (A; B starts at zero, so the model is unchanged) is
    seeded, so every data-parallel rank and every run starts from the same adapters.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    _refuse_tied_targets(model, cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=cfg.dim, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none"
    )
    # peft 0.21 still asks transformers for the deprecated `is_gradient_checkpointing`.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, peft_cfg)
        except ValueError as e:  # e.g. no module matches target_modules
            raise ValueError(f"policy.lora.target_modules={list(cfg.target_modules)}: {e}") from None


def _refuse_tied_targets(model: torch.nn.Module, targets: Iterable[str]) -> None:
    """An adapter on one of two tied embeddings cannot be merged: they are one tensor."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    tied = {module: name for name, module in model.named_modules()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        name = tied.get(module, "")
        hit = [t for t in targets if name == t or name.endswith(f".{t}")]
        if hit:
            raise ValueError(
                f"policy.lora.target_modules={list(targets)}: {name!r} is tied to the other embedding in this "
                "model (tie_word_embeddings), so its adapter could not be merged into the shared tensor; "
                "leave it out of target_modules"
            )


def scaling(cfg: LoraConfig) -> float:
    """The factor on `B @ A` (peft's default, not rank-stabilised): `alpha / r`."""
    return cfg.alpha / cfg.dim


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The wrapped model's own name for a peft parameter name (adapters have none)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_tensor(
    state: Mapping[str, torch.Tensor], name: str, lora_scaling: float,
    materialize: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
) -> torch.Tensor:
    """The weight `name` (a peft name, not an adapter) with its adapter folded in
    (`W + scaling * B @ A`); `materialize` turns each stored tensor into a full one (e.g.
    `DTensor.full_tensor`), so a streamed refit gathers one weight and its adapter at a time."""
    tensor = materialize(state[name])
    if name.endswith(".base_layer.weight"):
        prefix = name[: -len("base_layer.weight")]
        a = materialize(state[f"{prefix}lora_A.{ADAPTER}.weight"])
        b = materialize(state[f"{prefix}lora_B.{ADAPTER}.weight"])
        tensor = tensor + lora_scaling * (b.to(tensor.dtype) @ a.to(tensor.dtype))
    return tensor


def merged_state_dict(state: Mapping[str, torch.Tensor], lora_scaling: float) -> dict[str, torch.Tensor]:
    """Base-model names -> weights with every adapter folded in (`W + scaling * B @ A`)."""
    return {base_name(name): merged_tensor(state, name, lora_scaling) for name in state if not is_adapter(name)}


def export_layout(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """`(base name, shape, dtype)` of what `merged_state_dict` returns, from peft-named tensors."""
    return [(base_name(name), tuple(t.shape), t.dtype) for name, t in named if not is_adapter(name)]
