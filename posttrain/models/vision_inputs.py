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
`vision_keepalive` runs the vision tower on one blank image and adds 0 times its output.
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


def vision_keepalive(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """0, computed through the vision tower and projector on one blank image: added to a forward
    without images under FSDP, so that this rank gathers (and reduces the gradients of) the same
    sharded units as a rank whose micro-batch has images."""
    config = model.config.vision_config
    blank = torch.zeros(1, 3, config.image_size, config.image_size, device=device)
    features = model.model.get_image_features(pixel_values=blank, return_dict=True).pooler_output
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    return features.sum() * 0.0


def vision_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower and the projector of a LLaVA-style model (what `policy.freeze_vision_tower` freezes)."""
    inner = getattr(model, "model", model)
    found = [getattr(inner, name) for name in ("vision_tower", "visual", "multi_modal_projector")
             if isinstance(getattr(inner, name, None), torch.nn.Module)]
    if not found:
        raise ValueError(f"policy.freeze_vision_tower: {type(model).__name__} has no vision_tower / visual module")
    return found


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop training the vision tower (the projector stays trainable, as LLaVA's second stage);
    returns the number of parameters frozen."""
    tower = vision_modules(model)[0]
    for p in tower.parameters():
        p.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


@contextmanager
def keep_vision_tower_in_step(model: torch.nn.Module, device: torch.device, enabled: bool) -> Iterator[list[torch.Tensor]]:
    """Within the block, with `enabled` (an FSDP rank's forward without images), the model's forward
    also runs `vision_keepalive`, where its images would go through the tower: just before the
    language model, so the sharded units are gathered in the order a forward with images gathers
    them. The yielded list holds the 0 to add to the forward's output (empty when not `enabled`)."""
    kept: list[torch.Tensor] = []
    if not enabled:
        yield kept
        return
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args: kept.append(vision_keepalive(model, device)) and None)
    try:
        yield kept
    finally:
        handle.remove()


def check_vision_policy(policy: Any) -> None:
    """One line for each policy option a vision-language model does not train with yet (`policy` a PolicyConfig)."""
    refused = {
        "policy.tensor_parallel_size > 1": policy.tensor_parallel_size > 1,
        "policy.context_parallel_size > 1": policy.context_parallel_size > 1,
        "policy.lora.enabled": policy.lora.enabled,
        "policy.pipeline_parallel_size > 1": getattr(policy, "pipeline_parallel_size", 1) > 1,
        "policy.expert_parallel_size > 1": getattr(policy, "expert_parallel_size", 1) > 1,
    }
    for option, on in refused.items():
        if on:
            raise UserError(f"{option} is not supported for a vision-language model ({policy.model_name!r}) yet; "
                            "train it data-parallel (FSDP2 over policy.num_workers) with the full weights")
