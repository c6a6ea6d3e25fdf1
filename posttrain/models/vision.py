"""Vision-language models: the built-in tiny one, and loading any by hub id or local directory.

`tiny-vl` (`policy.model_name: tiny-vl`, sizes in `presets.VL_PRESETS`) is LLaVA's architecture
(Liu et al. 2023, "Visual Instruction Tuning", arXiv:2304.08485): a CLIP vision tower (Radford et
al. 2021) whose patch features a two-layer projector maps into a Llama language model, which sees
them in place of the `<image>` tokens. It is built locally, like the text presets
(`posttrain.models.tiny`), and written as an ordinary Hugging Face directory with a real processor:
`AutoProcessor.from_pretrained(dir)` gives a `LlavaProcessor` (a CLIP image processor and the
character tokenizer plus `<image>`, id 103) and `AutoModelForImageTextToText.from_pretrained(dir)`
a `LlavaForConditionalGeneration`, so no code path special-cases it.

Why LLaVA and not Qwen2-VL: in transformers 5.23 every Qwen2-VL / Qwen2.5-VL processor carries a
video processor that needs torchvision, which has no CPU build on the package index this project
installs from; LLaVA's processor takes images only and loads without it. Its language model is the
same Llama as the text presets, with ordinary 1-D positions (no multimodal RoPE).

Images: the processor resizes the shortest edge to 64 pixels and crops the centre square (CLIP's
preprocessing); each image becomes (64 / 8) ** 2 = 64 `<image>` tokens. The chat template is the
text presets' (`<|user|>...<|end|><|assistant|>`) and writes `<image>` where a message's content
has an `{"type": "image"}` part, the processor then expands each into 64.

Real VLMs (Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3, ...) load through the same functions by hub id or
directory: `hf.load_vision_model` (`AutoModelForImageTextToText`) and `hf.load_processor` (`AutoProcessor`).
Training and generation on images (the policy workers, the native engine): `posttrain.models.vision_inputs`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    GenerationConfig,
    LlavaConfig,
    PreTrainedModel,
)

from posttrain.data.image_prompts import PROCESSOR_ATTR
from posttrain.models.presets import VL_PRESETS
from posttrain.models.tiny import (
    ALPHABET, ASSISTANT, BOS, EOS, MAX_POSITION_EMBEDDINGS, PAD, SPECIAL_TOKENS, SYSTEM, USER, build_tokenizer, save_quietly,
)
from posttrain.utils.cache import cache_dir, publish_entry
from posttrain.utils.model_build import MODEL_BUILD_LOCK

IMAGE_TOKEN = "<image>"

# The text presets' template, with message content either a string or a list of parts:
# `{"type": "text", "text": ...}` as is, `{"type": "image"}` (with or without the image itself) as
# `<image>`, in order. Images may sit in any message, the assistant's too.
_RENDER = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}" + IMAGE_TOKEN +
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('tiny-vl chat template: unknown content part type ' ~ part['type'] ~"
    " ' (expected text or image)') }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
VL_CHAT_TEMPLATE = (
    _RENDER +
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM + "{{ render(message['content']) }}" + EOS +
    "{%- elif message['role'] == 'user' -%}" + USER + "{{ render(message['content']) }}" + EOS +
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT +
    "{% generation %}{{ render(message['content']) }}" + EOS + "{% endgeneration %}"
    "{%- else -%}{{ raise_exception('tiny-vl chat template: unknown role ' ~ message['role'] ~"
    " ' (expected system, user or assistant)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)

# Bump when the recipe below changes, so `ensure_tiny_vlm` rebuilds stale cached copies.
# 2: the vision tower is pretrained at build (`vision_pretrain`).
RECIPE_VERSION = 2


def check_vl_preset(preset: str) -> dict[str, dict[str, int]]:
    """The sizes of a vision-language preset; ValueError naming the choices for an unknown one."""
    if preset not in VL_PRESETS:
        raise ValueError(f"unknown vision-language preset {preset!r}; choose one of {sorted(VL_PRESETS)}")
    return VL_PRESETS[preset]


def build_vl_tokenizer():
    """The character tokenizer (`tiny.build_tokenizer`) plus `<image>` (id 103), with `VL_CHAT_TEMPLATE`."""
    return build_tokenizer(extra_special_tokens=[IMAGE_TOKEN], chat_template=VL_CHAT_TEMPLATE)


def tiny_vl_config(preset: str = "tiny-vl") -> LlavaConfig:
    """The transformers config of a vision-language preset: a Llama language model of the preset's
    `text` sizes (untied embeddings, as the `tiny` llama), a CLIP vision tower of its `vision` sizes;
    the last layer's patch features (without CLIP's class token: `vision_feature_select_strategy=
    default`, as LLaVA-1.5) go through a GELU projector."""
    sizes = check_vl_preset(preset)
    vocab_size = len(SPECIAL_TOKENS) + len(ALPHABET) + 1  # + <image>, the last id
    text = dict(
        sizes["text"], model_type="llama", vocab_size=vocab_size, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        pad_token_id=SPECIAL_TOKENS.index(PAD), bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS), initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    vision = dict(sizes["vision"], model_type="clip_vision_model", projection_dim=sizes["vision"]["hidden_size"])
    return LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=vocab_size - 1, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
    )


def image_tokens_per_image(preset: str = "tiny-vl") -> int:
    """How many `<image>` tokens one image becomes in a preset ((image_size / patch_size) ** 2)."""
    vision = check_vl_preset(preset)["vision"]
    return (vision["image_size"] // vision["patch_size"]) ** 2


def build_vl_processor(preset: str = "tiny-vl") -> Any:
    """A vision-language preset's processor, in memory: its CLIP image processor and
    `build_vl_tokenizer()`, as its cached directory holds them (`build_tiny_vlm` saves this one).
    Its tokenizer carries it, so `image_prompts.processor_for` finds it without a directory."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    config = tiny_vl_config(preset)
    tokenizer = build_vl_tokenizer()
    assert len(tokenizer) == config.text_config.vocab_size and tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == config.image_token_id
    vision = config.vision_config
    # The PIL backend: transformers' default backend needs torchvision (see the module docstring).
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": vision.image_size}, crop_size={"height": vision.image_size, "width": vision.image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=VL_CHAT_TEMPLATE,  # 1: CLIP's class token, dropped
    )
    setattr(tokenizer, PROCESSOR_ATTR, processor)  # `image_prompts.processor_for` finds it there
    return processor


def make_tiny_vlm(preset: str = "tiny-vl", seed: int = 0) -> tuple[PreTrainedModel, Any]:
    """Build a randomly initialised vision-language preset and its processor in memory (float32,
    cpu). Weights are a pure function of (preset, seed); the global RNG state is left untouched."""
    config = tiny_vl_config(preset)
    with torch.random.fork_rng(devices=[]), MODEL_BUILD_LOCK:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    return model.eval(), build_vl_processor(preset)


def build_tiny_vlm(out_dir: str | os.PathLike, preset: str = "tiny-vl", seed: int = 0,
                   pretrain_vision: bool = True) -> Path:
    """Write a Hugging Face directory (config, weights, generation config, tokenizer, processor and
    image processor configs, chat template) for a vision-language preset into `out_dir`.

    Args:
        out_dir: target directory (created; existing files of the same names are overwritten).
        preset: `tiny-vl` (the only one; default).
        seed: seed of the random initialisation and of the tower's pretraining (default 0).
        pretrain_vision: pretrain the vision tower on per-patch shape detection
            (`vision_pretrain`; default true, as the cached preset is: a random tower learns
            to see, or not, depending on the seed).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = make_tiny_vlm(preset, seed)
    if pretrain_vision:
        from posttrain.models.vision_pretrain import pretrain_vision_tower

        with MODEL_BUILD_LOCK:
            pretrain_vision_tower(model, processor, seed)
    save_quietly(model, out)
    processor.save_pretrained(out)
    # The template inside tokenizer_config.json too, so `AutoTokenizer` alone (the text-only path) has it.
    processor.tokenizer.save_pretrained(out, save_jinja_files=False)
    return out


def tiny_vl_stamp(preset: str) -> dict[str, Any]:
    """What a cached vision-language preset is built from (its cache entry's stamp)."""
    return {"kind": "tiny-vl-model", "recipe_version": RECIPE_VERSION, "preset": preset, "seed": 0}


def ensure_tiny_vlm(preset: str = "tiny-vl") -> Path:
    """Return `<cache>/models/<preset>`, building it (seed 0) on first use; a copy written by an
    older recipe, or a broken one, is replaced (`posttrain.utils.cache.publish_entry`)."""
    check_vl_preset(preset)
    return publish_entry(cache_dir() / "models" / preset, lambda tmp: build_tiny_vlm(tmp, preset, seed=0),
                         tiny_vl_stamp(preset), describe=f"vision-language model {preset}")
