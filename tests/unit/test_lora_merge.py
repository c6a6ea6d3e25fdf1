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
