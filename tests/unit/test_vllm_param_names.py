"""The refit's names on the vLLM side (`vllm_extension`): which vLLM parameter each Hugging Face
tensor name loads into (the metadata check) and Mixtral's renames, without vLLM (the names are
vLLM 0.32's)."""

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


# vLLM 0.32's Mixtral parameters of one layer (block_sparse_moe, its fused experts under `routed_experts.`).
MIXTRAL = {
    "model.layers.1.block_sparse_moe.gate.weight",
    "model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight",
    "model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight",
    "model.layers.1.self_attn.qkv_proj.weight",
}


def test_mixtral_router_and_fused_experts_take_vllm_mixtral_names():
    """transformers 5's `mlp` router and fused experts become vLLM's `block_sparse_moe` names, which
    the metadata check then places; other tensors, checkpoint names and other models keep theirs."""
    from posttrain.models.generation.vllm_extension import mixtral_moe_name, vllm_checkpoint_name

    layer = "model.layers.1"
    renamed = {f"{layer}.mlp.gate.weight": f"{layer}.block_sparse_moe.gate.weight",
               f"{layer}.mlp.experts.gate_up_proj": f"{layer}.block_sparse_moe.experts.w13",
               f"{layer}.mlp.experts.down_proj": f"{layer}.block_sparse_moe.experts.w2"}
    for hf_name, vllm_name in renamed.items():
        assert vllm_checkpoint_name(hf_name, MIXTRAL) == vllm_name
        assert _vllm_param_name(vllm_name, MIXTRAL) is not None
    assert _vllm_param_name(f"{layer}.block_sparse_moe.experts.w13", MIXTRAL).endswith("routed_experts.w13_weight")
    for kept in (f"{layer}.self_attn.q_proj.weight", f"{layer}.block_sparse_moe.experts.0.w1.weight",
                 f"{layer}.mlp.experts.unknown", "model.layers.0.mlp.experts.gate_up_proj"):  # no layer 0 in vLLM
        assert mixtral_moe_name(kept, MIXTRAL) is None
        assert vllm_checkpoint_name(kept, MIXTRAL) == kept
    assert vllm_checkpoint_name("model.layers.0.mlp.experts.gate_up_proj", KNOWN) == \
        "model.layers.0.mlp.experts.gate_up_proj"  # Qwen3-MoE: vLLM keeps `mlp`


def test_mixtral_fused_experts_stack_the_checkpoint_experts_as_vllm_splits_them(tmp_path):
    """vLLM's fused-MoE loader takes `experts.w13` [E, 2I, H] as w1 = its first half along dim 1 and
    w3 = the second, `experts.w2` [E, H, I] as w2 per expert: exactly the per-expert `w1` (gate),
    `w3` (up) and `w2` (down) tensors transformers 5 writes in a Mixtral checkpoint."""
    import torch
    from safetensors.torch import load_file

    from posttrain.models.tiny import build_tiny_model, make_tiny_model

    model, _ = make_tiny_model("tiny", "mixtral")
    saved = load_file(str(build_tiny_model(tmp_path, "tiny", "mixtral") / "model.safetensors"))
    state = model.state_dict()
    experts = model.config.num_local_experts
    for layer in range(model.config.num_hidden_layers):
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
        w1, w3 = gate_up.chunk(2, dim=1)  # as vLLM's RoutedExperts.load_weights splits a fused w13
        for e in range(experts):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            assert torch.equal(w1[e], saved[f"{prefix}.w1.weight"])
            assert torch.equal(w3[e], saved[f"{prefix}.w3.weight"])
            assert torch.equal(down[e], saved[f"{prefix}.w2.weight"])
        assert torch.equal(state[f"model.layers.{layer}.mlp.gate.weight"],
                           saved[f"model.layers.{layer}.block_sparse_moe.gate.weight"])
