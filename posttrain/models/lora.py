"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for the policy.

peft wraps the target linear layers; only the adapters train, the base weights stay frozen.
Everything that leaves the trainer (refit to the generation engine, weight checksums, Hugging
Face exports, `posttrain convert`) sees *merged* weights under the base model's own names,
`W + alpha / r * B @ A`, so the generation engine and any HF reader need no LoRA support.

Which modules get adapters (`target_module_names`): an entry of `policy.lora.target_modules`
matches a module whose full name is the entry or ends with `.<entry>` (peft's rule for a list).
In a vision-language model the vision tower and the projector (`vision_inputs.vision_parts`) are
left out unless an entry names them by path: `q_proj` matches the language model's attention
only, not CLIP's `q_proj` of the same name, while `multi_modal_projector.linear_1` or
`vision_tower.encoder.layers.0.mlp.fc1` reach those modules. LoRA then adapts the language model,
as LLaVA-1.5's LoRA fine-tuning does (its `find_all_linear_names` leaves the vision tower and the
projector out); whether the vision side's own weights train in full beside the adapters is
`policy.freeze_vision_tower`'s choice (`vision_inputs.set_vision_training`). peft gets the
resolved full names.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Mapping

import torch

from posttrain.config.schema import LoraConfig
from posttrain.models.vision_inputs import vision_parts

PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's parameter names
ADAPTER = "default"  # peft's name for the single adapter


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters on the modules `cfg.target_modules` resolves to
    (`target_module_names`; peft `get_peft_model`), every other weight fixed.

    The adapters' random initialisation (A; B starts at zero, so the model is unchanged) is
    seeded, so every data-parallel rank and every run starts from the same adapters.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = target_module_names(model, cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.dim, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none")
    # peft 0.21 still asks transformers for the deprecated `is_gradient_checkpointing`.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, peft_cfg)
        except ValueError as e:  # e.g. a target that is not a layer type peft adapts
            raise ValueError(f"policy.lora.target_modules={list(cfg.target_modules)}: {e}") from None


def target_module_names(model: torch.nn.Module, targets: Iterable[str]) -> list[str]:
    """Full names of the modules of `model` (not yet wrapped) that `targets` give adapters (module
    doc): a module matches an entry equal to its name or to a dotted suffix of it; one inside a
    vision-language model's vision tower or projector only an entry that names that part.

    Raises ValueError naming `policy.lora.target_modules` when nothing matches, or when an entry
    hits one of two tied embeddings (they are one tensor: its adapter could not be merged)."""
    targets = list(targets)
    parts = list(vision_parts(model))
    found = []
    for name, _ in model.named_modules():
        hits = [t for t in targets if name == t or name.endswith(f".{t}")]
        part = next((p for p in parts if name.startswith(f"{p}.")), None)
        if part is not None:  # e.g. "q_proj" stays out of CLIP; "vision_tower.<...>.q_proj" reaches it
            hits = [t for t in hits if part.rpartition(".")[2] in t.split(".")]
        if hits:
            found.append(name)
    if not found:
        named = " or ".join(p.rpartition(".")[2] for p in parts)
        where = (f"; in a vision-language model they match outside its vision tower and projector only, unless "
                 f"an entry names {named} (e.g. multi_modal_projector.linear_1)" if parts else "")
        raise ValueError(f"policy.lora.target_modules={targets} match no module of {type(model).__name__}{where}")
    _refuse_tied_targets(model, targets, found)
    return found


def _refuse_tied_targets(model: torch.nn.Module, targets: list[str], found: list[str]) -> None:
    """An adapter on one of two tied embeddings cannot be merged: they are one tensor."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    names = {module: name for name, module in model.named_modules()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        name = names.get(module, "")
        if name in found:
            raise ValueError(
                f"policy.lora.target_modules={targets}: {name!r} is tied to the other embedding in this "
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
