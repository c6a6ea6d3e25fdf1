"""Images through training and generation: how a row's images travel and reach a vision-language model.

A prompt with images is tokenised by the model's processor (`image_prompt`, in the data layer:
`data/image_prompts.py`): each `<image>` the
chat template writes is expanded into the model's image-token count (64 for `tiny-vl`), and the
images become `pixel_values [n_images, 3, H, W]` (float32). That tensor rides on the prompt
message of the message log (`message["pixel_values"]`), so it follows the sample through the
rollout, and `flatten_message_logs` puts it in the `Batch` as a list: `batch["pixel_values"][i]`
is row i's images (None for a row without any). A list, not a padded tensor: rows carry different
numbers of images, and `Batch`'s row operations (select, shard, repeat, cat) keep a list's items
with their rows.

The model sees them by `model(input_ids, pixel_values=<the rows' images, concatenated in row
order>)`: LLaVA-style models scatter the image features over the `<image>` tokens in row-major
order, which is the rows' order. Logprobs are of text tokens only: an `<image>` token's position
holds 0 (`mask_image_positions`), as no loss reads a prompt token anyway; and the image token is
out of the next-token distribution (`suppress_image_token`): the engine never samples it, the
trainer's logprobs normalise without it.

Under FSDP every rank must run every sharded unit (their all-gathers are collectives), the vision
tower's too, also in a micro-batch without images (a rank's stand-in, or a text-only row):
`vision_keepalive` runs the vision tower on one blank image and adds 0 times its output to the
language model's input embeddings.

LoRA (`models/lora.py`) wraps the model in peft's `PeftModel`; the functions here reach the
vision tower through it (`hf_model`). With LoRA the language model trains through its adapters
and the vision tower and projector train or stay fixed by `policy.freeze_vision_tower`
(`set_vision_training`). Tensor parallelism splits the language model only
(`models/policy/parallel.py`); the vision tower and projector are replicated on the TP ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from posttrain.data.image_prompts import PIXEL_VALUES
from posttrain.errors import UserError


def is_vision_language_config(config: Any) -> bool:
    """Whether a transformers config (object or dict) is a vision-language model's (has a vision tower)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return get("vision_config") is not None


def is_vision_language_model(name_or_path: str, tiny_arch: str = "llama") -> bool:
    """Whether `policy.model_name` names a vision-language model: `tiny-vl`, or a config with a vision tower."""
    from posttrain.models.paths import model_config_dict, parse_tiny_name
    from posttrain.models.presets import VL_PRESETS

    if name_or_path in VL_PRESETS:
        return True
    if parse_tiny_name(name_or_path, tiny_arch) is not None:
        return False
    return is_vision_language_config(model_config_dict(name_or_path) or {})


def image_token_id(model: torch.nn.Module) -> Optional[int]:
    """The id of the model's `<image>` token (None: not a vision-language model)."""
    config = model.config
    return getattr(config, "image_token_id", None) if is_vision_language_config(config) else None


def rows_pixel_values(rows: Any) -> Optional[torch.Tensor]:
    """The images of `rows` (a Batch, or its `pixel_values` list) concatenated in row order (None: none)."""
    values = rows.get(PIXEL_VALUES) if isinstance(rows, dict) else rows
    present = [v for v in (values or []) if v is not None and v.numel()]
    return torch.cat(present) if present else None


def image_inputs(rows: Any, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`{"pixel_values": ...}` for the model's forward over `rows`, or `{}` when they carry no images."""
    pixels = rows_pixel_values(rows)
    return {} if pixels is None else {PIXEL_VALUES: pixels.to(device=device, dtype=dtype)}


def mask_image_positions(values: torch.Tensor, input_ids: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """`values [n, L]` with 0 where `input_ids` is the model's `<image>` token (logprobs of text tokens only)."""
    image_id = image_token_id(model)
    return values if image_id is None else values.masked_fill(input_ids == image_id, 0.0)


def suppress_image_token(logits: torch.Tensor, token_id: int) -> torch.Tensor:
    """`logits [..., V]` with the image token's at -inf: generation never samples it (an `<image>` with
    no image behind it breaks the next forward), and the trainer's logprobs are over the same
    distribution, so the two agree."""
    return logits.index_fill(-1, torch.tensor([token_id], device=logits.device), float("-inf"))


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside peft's LoRA wrapper (`model` itself otherwise): text or vision-language."""
    get_base_model = getattr(model, "get_base_model", None)  # PeftModel's; transformers' models have none
    return get_base_model() if callable(get_base_model) else model


def vision_keepalive(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """0, computed through the vision tower and projector on one blank image: added to a forward
    without images under FSDP, so that this rank gathers (and reduces the gradients of) the same
    sharded units as a rank whose micro-batch has images."""
    model = hf_model(model)
    config = model.config.vision_config
    blank = torch.zeros(1, 3, config.image_size, config.image_size, device=device)
    features = model.model.get_image_features(pixel_values=blank, return_dict=True).pooler_output
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    return features.sum() * 0.0


# Where LLaVA-style models keep the vision side, below the top-level model (`model.<name>`):
# the vision tower (Qwen2-VL's `visual`, its merger included) and the projector into the language model.
VISION_TOWERS = ("vision_tower", "visual")
PROJECTORS = ("multi_modal_projector",)


def vision_parts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Full module name -> module of the vision tower and the projector of a LLaVA-style model
    (peft's wrapper too, under its own names), tower first; empty for a text model."""
    parts = {name: module for name, module in model.named_modules()
             if name.rpartition(".")[2] in VISION_TOWERS + PROJECTORS}
    # The outermost of each (a tower's own submodules may reuse a name, e.g. CLIPVisionModel.vision_model).
    return dict(sorted(((name, module) for name, module in parts.items()
                        if not any(name.startswith(other + ".") for other in parts)),
                       key=lambda item: item[0].rpartition(".")[2] not in VISION_TOWERS))


def set_vision_training(model: torch.nn.Module, train_tower: bool) -> int:
    """The vision side's own weights train (`requires_grad`): the projector's always (LLaVA's
    second stage trains it), the tower's when `train_tower` (False: `policy.freeze_vision_tower`).
    LoRA adapters on them (named in target_modules) are left as peft set them: after `apply_lora`,
    which fixes every weight but the adapters, this makes the vision side train as it would
    without LoRA. Returns the number of parameters fixed (the tower's)."""
    parts = vision_parts(model)
    if not parts:
        raise ValueError(f"policy.freeze_vision_tower: {type(model).__name__} has no vision_tower / visual module")
    frozen = 0
    for name, part in parts.items():
        train = train_tower or name.rpartition(".")[2] not in VISION_TOWERS
        for param_name, p in part.named_parameters():
            if not param_name.startswith("lora_") and ".lora_" not in param_name:
                p.requires_grad_(train)
                frozen += 0 if train else p.numel()
    return frozen


@contextmanager
def keep_vision_tower_in_step(model: torch.nn.Module, device: torch.device, enabled: bool) -> Iterator[None]:
    """Within the block, with `enabled` (an FSDP rank's forward without images), the model's forward
    also runs `vision_keepalive` where its images would go through the tower, just before the
    language model, and adds its 0 to the language model's input embeddings, where image features
    would enter: the sharded units are gathered in the order a forward with images gathers them,
    and the backward reaches the projector from the same place. The place matters with LoRA: the
    embeddings are fixed there, so without images nothing upstream of the first decoder layer
    would need a gradient, and FSDP would reduce that layer's gradient at the end of the backward
    instead of after its own backward, out of step with a rank that has images (a measured hang)."""
    if not enabled:
        yield
        return

    def add_keepalive(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "inputs_embeds": kwargs["inputs_embeds"] + vision_keepalive(model, device)}

    handle = hf_model(model).model.language_model.register_forward_pre_hook(add_keepalive, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def check_vision_policy(policy: Any) -> None:
    """One line for each policy option a vision-language model does not train with yet (`policy` a PolicyConfig).
    Tensor parallelism (the language model split, the vision side replicated) and LoRA (on the
    language model) are supported; the other splits are not."""
    refused = {
        "policy.context_parallel_size > 1": policy.context_parallel_size > 1,
        "policy.pipeline_parallel_size > 1": getattr(policy, "pipeline_parallel_size", 1) > 1,
        "policy.expert_parallel_size > 1": getattr(policy, "expert_parallel_size", 1) > 1,
    }
    for option, on in refused.items():
        if on:
            raise UserError(f"{option} is not supported for a vision-language model ({policy.model_name!r}) yet; "
                            "train it data-parallel (FSDP2 over policy.num_workers), tensor-parallel or with LoRA")
