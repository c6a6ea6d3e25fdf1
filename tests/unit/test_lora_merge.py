"""LoRA merging (pure tensors, no workers): merged weights equal the adapted model's."""

import pytest
import torch

from posttrain.config.schema import LoraConfig
from posttrain.models.lora import apply_lora, merged_state_dict, scaling
from posttrain.models.tiny import make_tiny_model


def test_lora_merges_exactly_and_refuses_tied_embeddings():
    cfg = LoraConfig(enabled=True, dim=2, alpha=4, target_modules=["q_proj"])
    base, _ = make_tiny_model("tiny", "llama", 0)
    model = apply_lora(base, cfg)
    with torch.no_grad():  # B starts at 0; give it values so the merge is visible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    state = model.state_dict()
    merged = merged_state_dict(state, scaling(cfg))
    q = "model.layers.0.self_attn.q_proj"
    a = state[f"base_model.model.{q}.lora_A.default.weight"]
    b = state[f"base_model.model.{q}.lora_B.default.weight"]
    torch.testing.assert_close(merged[f"{q}.weight"], state[f"base_model.model.{q}.base_layer.weight"] + 2.0 * b @ a)
    plain, _ = make_tiny_model("tiny", "llama", 0)
    assert list(merged) == list(plain.state_dict())  # the base model's names, in its order
    ids = torch.randint(7, 100, (2, 9))
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)

    tied, _ = make_tiny_model("tiny", "qwen2", 0)
    with pytest.raises(ValueError, match=r"'lm_head' is tied to the other embedding"):
        apply_lora(tied, LoraConfig(enabled=True, target_modules=["q_proj", "lm_head"]))


def test_lora_on_a_vision_language_model_adapts_the_language_model_and_merges_under_its_names():
    """tiny-vl: the default targets (q/k/v/o_proj) reach the Llama language model only, not CLIP's
    q/k/v_proj of the same names; the vision side is reached only by entries naming it; the merged
    weights carry the plain LLaVA's names and give its logits on an image."""
    from posttrain.models.lora import target_module_names
    from posttrain.models.vision import make_tiny_vlm

    base, _ = make_tiny_vlm()
    cfg = LoraConfig(enabled=True, dim=2, alpha=4)
    language = [f"model.language_model.layers.{i}.self_attn.{proj}" for i in (0, 1)
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert target_module_names(base, cfg.target_modules) == language
    named = target_module_names(base, ["o_proj", "multi_modal_projector.linear_1",
                                       "vision_tower.encoder.layers.1.mlp.fc1"])
    assert named == ["model.vision_tower.encoder.layers.1.mlp.fc1", "model.multi_modal_projector.linear_1",
                     "model.language_model.layers.0.self_attn.o_proj", "model.language_model.layers.1.self_attn.o_proj"]
    with pytest.raises(ValueError, match=r"target_modules=\['fc1'\] match no module of LlavaForConditionalGeneration; "
                       r"in a vision-language model they match outside its vision tower and projector"):
        target_module_names(base, ["fc1"])  # CLIP's MLP only: not without its path

    model = apply_lora(base, cfg)
    adapted = sorted({name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_" in name})
    assert adapted == sorted(f"base_model.model.{name}" for name in language)  # CLIP's q/k/v_proj have none
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    merged = merged_state_dict(model.state_dict(), scaling(cfg))
    plain, _ = make_tiny_vlm()
    assert list(merged) == list(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.cat([torch.full((1, 64), 103), torch.randint(7, 100, (1, 6))], dim=1)
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids, pixel_values=pixels).logits,
                                   model(input_ids=ids, pixel_values=pixels).logits, atol=1e-5, rtol=0)
