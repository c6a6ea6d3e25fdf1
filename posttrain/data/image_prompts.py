"""Prompts with images, tokenised by the model's own processor: each `<image>` mark of a rendered
prompt becomes the model's image tokens, and the images its `pixel_values`. Here, in the data
layer, because the prompt builders (`processors.py`) need it; the model code re-exports it
(`models/vision_inputs.py`)."""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import torch

from posttrain.errors import UserError

PIXEL_VALUES = "pixel_values"  # the batch key, and the processor's output key, of a row's images


def processor_from(path: str | os.PathLike, name: str | os.PathLike | None = None) -> Any:
    """`AutoProcessor` of the model directory `path` (`name`: how the user named it, for errors).
    Its tokenizer pads on the right, with the eos token as pad token when it has none (as
    `hf.load_tokenizer`). A processor that needs a package this environment lacks (Qwen2-VL's
    needs torchvision) is a one-line UserError naming it."""
    from transformers import AutoProcessor  # here: every worker imports this module, few load a processor

    name = os.fspath(name if name is not None else path)
    try:
        processor = AutoProcessor.from_pretrained(path)
    except ImportError as e:
        needs = next((p for p in ("torchvision", "av", "decord", "librosa") if p in str(e).lower()), "a package")
        raise UserError(f"the processor of {name!r} needs {needs}, which is not installed "
                        f"({type(e).__name__}: {str(e).strip().splitlines()[0]})") from None
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        raise UserError(f"the processor of {name!r} has no tokenizer")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return processor


# A processor built in code (a vision-language preset's, `models.vision.build_vl_processor`) rides
# on its tokenizer under this attribute: there is no directory to load it from.
PROCESSOR_ATTR = "posttrain_processor"


@functools.lru_cache(maxsize=4)
def _processor(path: str) -> Any:
    return processor_from(path)


def processor_for(tokenizer: Any) -> Any:
    """The processor of the model `tokenizer` was loaded from: the one it carries when it was built
    in code (`PROCESSOR_ATTR`), else its directory's (`tokenizer.name_or_path`)."""
    carried = getattr(tokenizer, PROCESSOR_ATTR, None)
    return carried if carried is not None else _processor(str(tokenizer.name_or_path))


def image_prompt(tokenizer: Any, text: str, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token_ids [n], pixel_values [len(images), 3, H, W])` of a rendered prompt whose `<image>`
    marks (one per image) the processor expands into the model's image tokens."""
    processor = processor_for(tokenizer)
    out = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
    return out["input_ids"][0].long(), out[PIXEL_VALUES].float()
