"""The refit metadata check on the vLLM side (`vllm_extension._vllm_param_name`): which vLLM
parameter each Hugging Face tensor name loads into, without vLLM (the names are vLLM 0.32's)."""

from __future__ import annotations

from posttrain.models.generation.vllm_extension import _vllm_param_name

KNOWN = {
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.0.mlp.experts.routed_experts.w13_weight",
    "model.layers.0.mlp.experts.routed_experts.w2_weight",
    "model.layers.1.mlp.gate_up_proj.weight",
}


def test_hf_names_map_to_vllm_parameters():
    assert _vllm_param_name("model.embed_tokens.weight", KNOWN) == "model.embed_tokens.weight"
    assert _vllm_param_name("model.layers.0.self_attn.k_proj.weight", KNOWN) == "model.layers.0.self_attn.qkv_proj.weight"
    assert _vllm_param_name("model.layers.1.mlp.up_proj.weight", KNOWN) == "model.layers.1.mlp.gate_up_proj.weight"
    assert _vllm_param_name("model.layers.0.self_attn.rotary_emb.inv_freq", KNOWN) is not None


def test_transformers_5_fused_experts_load_into_vllm_fused_moe():
    """transformers 5's 3-D expert tensors go to vLLM's w13 / w2 as they are (with or without the
    `routed_experts.` level); a name the model lacks is still refused."""
    assert (_vllm_param_name("model.layers.0.mlp.experts.gate_up_proj", KNOWN)
            == "model.layers.0.mlp.experts.routed_experts.w13_weight")
    assert _vllm_param_name("model.layers.0.mlp.experts.down_proj", {"model.layers.0.mlp.experts.w2_weight"}) == \
        "model.layers.0.mlp.experts.w2_weight"
    assert _vllm_param_name("model.layers.1.mlp.experts.gate_up_proj", KNOWN) is None
    assert _vllm_param_name("model.layers.0.mlp.experts.gate_proj", KNOWN) is None
