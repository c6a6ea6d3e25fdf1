"""The tiny vision-language preset (`tiny-vl`) and loading vision-language models by name: its
tokenizer and chat template, the cache entry, `AutoProcessor` / `AutoModelForImageTextToText` on
the directory, a forward whose logits depend on the image, other architectures through the same
loader, and one-line errors."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from posttrain.errors import UserError
from posttrain.data import image_prompts
from posttrain.data.generators.visual import Shape
from posttrain.models import hf, tiny, vision, vision_pretrain
from posttrain.utils.cache import ENTRY_FILE

MESSAGES = [{"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image"}, {"type": "text", "text": "?"}]}]


def test_the_tokenizer_is_the_character_tokenizer_plus_image_and_the_template_places_images():
    text, vl = tiny.build_tokenizer(), vision.build_vl_tokenizer()
    assert len(vl) == len(text) + 1 == 104 and vl.convert_tokens_to_ids("<image>") == 103
    sample = "<|user|>How many? 12<|end|><|assistant|>"
    assert vl(sample)["input_ids"] == text(sample)["input_ids"]  # the text ids are unchanged
    assert vl("a<image>b")["input_ids"] == [text.convert_tokens_to_ids("a"), 103, text.convert_tokens_to_ids("b")]
    prompt = vl.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>S<|end|><|user|>look <image>?<|end|><|assistant|>"
    plain = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert vl.apply_chat_template(plain, tokenize=False) == text.apply_chat_template(plain, tokenize=False)
    with pytest.raises(Exception, match="unknown content part type video"):
        vl.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)


def test_the_preset_builds_once_into_the_cache_and_loads_through_the_auto_classes(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(vision_pretrain, "PRETRAIN_STEPS", 2)  # the entry, not what the tower learns (below)
    by_name = hf.load_tokenizer("tiny-vl")  # the preflight's tokenizer: built in code, no model built
    assert not (tmp_path / "models").exists()
    path = hf.resolve_model_path("tiny-vl")
    assert path == str(tmp_path / "models" / "tiny-vl")
    stamp = json.loads((tmp_path / "models" / "tiny-vl" / ENTRY_FILE).read_text())["stamp"]
    assert stamp == {"kind": "tiny-vl-model", "recipe_version": vision.RECIPE_VERSION, "preset": "tiny-vl", "seed": 0}
    mtime = (tmp_path / "models" / "tiny-vl" / "model.safetensors").stat().st_mtime_ns
    assert hf.resolve_model_path("tiny-vl") == path  # built once
    assert (tmp_path / "models" / "tiny-vl" / "model.safetensors").stat().st_mtime_ns == mtime

    processor, model = AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)
    assert (type(processor).__name__, type(model).__name__) == ("LlavaProcessor", "LlavaForConditionalGeneration")
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    assert 100_000 < sum(p.numel() for p in model.model.vision_tower.parameters()) < 200_000
    # The text-only path still reads the template (tokenizer_config.json) for a tokenizer of its own.
    assert hf.load_tokenizer(path).apply_chat_template(MESSAGES, tokenize=False) == \
        "<|system|>S<|end|><|user|>look <image>?<|end|>"
    from_dir = hf.load_tokenizer(path)
    assert (by_name.get_vocab(), by_name.all_special_tokens, by_name.chat_template, by_name.pad_token,
            by_name.padding_side) == (from_dir.get_vocab(), from_dir.all_special_tokens, from_dir.chat_template,
                                      from_dir.pad_token, from_dir.padding_side)
    for text in ("<|user|>How many? 12<|end|><|assistant|>", "a<image>b\n"):
        assert by_name(text)["input_ids"] == from_dir(text)["input_ids"]
    # ... and so is its processor: an image prompt becomes the same tokens and pixels either way.
    image = Image.new("RGB", (80, 48), (200, 30, 30))
    (ids_by_name, pixels_by_name), (ids_from_dir, pixels_from_dir) = (
        image_prompts.image_prompt(t, "look <image>?", [image]) for t in (by_name, from_dir))
    assert ids_by_name.tolist() == ids_from_dir.tolist() and ids_by_name.tolist().count(103) == 64
    assert torch.equal(pixels_by_name, pixels_from_dir)
    # The cached weights are the seed-0 build: the language model and projector as initialised,
    # the vision tower pretrained from there (its patch embedding moved, its last norm unused).
    reference, _ = vision.make_tiny_vlm("tiny-vl", seed=0)
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        pretrained = "vision_tower" in name and "post_layernorm" not in name
        assert torch.equal(a, b) != pretrained, name


def test_scenes_and_patch_labels_of_the_towers_pretraining():
    shapes = [Shape("circle", "red", 8, 8), Shape("diamond", "blue", 60, 9), Shape("square", "yellow", 31, 55)]
    kind, color = vision_pretrain.patch_labels(shapes, patch_size=8)
    # patches row-major on an 8 x 8 grid: (8, 8) -> 1 * 8 + 1; (60, 9) -> 8 + 7; (31, 55) -> 6 * 8 + 3
    assert kind.nonzero().flatten().tolist() == [9, 15, 51] and kind[[9, 15, 51]].tolist() == [1, 4, 2]
    assert color[[9, 15, 51]].tolist() == [5, 1, 6]  # 1 + index in sorted colours: red, blue, yellow
    rng = random.Random(0)
    counts = set()
    for _ in range(200):
        scene = vision_pretrain.random_scene(rng)
        counts.add(len(scene))
        assert all(8 <= s.x <= 55 and 8 <= s.y <= 55 for s in scene)
        assert all((a.x - b.x) ** 2 + (a.y - b.y) ** 2 >= 17 ** 2 for i, a in enumerate(scene) for b in scene[:i])
    assert counts == set(range(10))


def test_the_towers_pretraining_teaches_it_to_see_shapes():
    """Sixty steps already name most held-out shapes' colours (a random tower's head names none:
    it calls every patch empty); the full build's 500 steps: kind 91%, colour 99%."""
    model, processor = vision.make_tiny_vlm(seed=0)
    language = {k: v.clone() for k, v in model.state_dict().items() if "vision_tower" not in k}
    before = torch.get_rng_state()
    result = vision_pretrain.pretrain_vision_tower(model, processor, seed=0, steps=60)
    assert torch.equal(torch.get_rng_state(), before)
    assert result["color_accuracy"] > 0.5 and result["kind_accuracy"] > 0.2, result
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in language.items())  # the tower alone trains


def test_a_forward_through_the_loaders_depends_on_the_image(tmp_path):
    path = vision.build_tiny_vlm(tmp_path / "vl", seed=1, pretrain_vision=False)
    processor, model = hf.load_processor(path), hf.load_vision_model(path)
    prompt = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    red, stripes = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "white")
    stripes.paste((0, 0, 255), (0, 0, 64, 16))
    batch = processor(text=[prompt, prompt], images=[red, stripes], return_tensors="pt")
    text_tokens = len(processor.tokenizer(prompt)["input_ids"]) - 1  # less the one <image> the processor expands
    assert vision.image_tokens_per_image() == 64
    assert batch["input_ids"].shape == (2, text_tokens + 64) and batch["pixel_values"].shape == (2, 3, 64, 64)
    assert (batch["input_ids"] == 103).sum(dim=1).tolist() == [64, 64]
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, text_tokens + 64, 104)
    first = int((batch["input_ids"][0] == 103).nonzero()[0])  # "<|system|>S<|end|><|user|>look " before it
    assert first == 9
    assert torch.allclose(logits[0, :first], logits[1, :first], atol=1e-6)  # causal: the image is not seen yet
    assert (logits[0, first:] - logits[1, first:]).abs().max() > 1e-3  # from the image on, the logits differ
    same = processor(text=[prompt], images=[red.copy()], return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(model(**same).logits[0], logits[0], atol=1e-5)


def test_another_architecture_loads_through_the_same_loader(tmp_path):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path / "qwen2vl")
    model = hf.load_vision_model(tmp_path / "qwen2vl", dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and model.dtype == torch.bfloat16
    assert not model.training


def test_load_errors_are_one_line(tmp_path):
    text_model = tiny.build_tiny_model(tmp_path / "text")
    with pytest.raises(UserError, match=r"is not a vision-language model transformers knows") as e:
        hf.load_vision_model(text_model)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="not a Hugging Face processor directory"):
        hf.load_processor(text_model)  # a tokenizer, but no processor
    with pytest.raises(ValueError, match=r"unknown vision-language preset 'tiny-vlm'; choose one of \['tiny-vl'\]"):
        vision.ensure_tiny_vlm("tiny-vlm")


def test_the_policy_loader_picks_the_vision_language_class_and_the_text_loader_names_it():
    """`load_policy_lm` (what the policy workers and engines load with) takes a VLM; the text-only
    `load_causal_lm` given a VLM's directory names its config class in one line."""
    from posttrain.preflight import check_model_name

    check_model_name("tiny-vl", "policy.model_name")  # a preset: accepted
    assert type(hf.load_policy_lm("tiny-vl")).__name__ == "LlavaForConditionalGeneration"
    with pytest.raises(UserError, match=r"\(LlavaConfig\) is not a causal language model") as e:
        hf.load_causal_lm(hf.resolve_model_path("tiny-vl"))
    assert "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_a_processor_that_needs_torchvision_says_so_in_one_line(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    vision.build_vl_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    with pytest.raises(UserError, match=rf"the processor of '{tmp_path}' needs torchvision, which is not installed") as e:
        hf.load_processor(tmp_path)
    assert "\n" not in str(e.value)
