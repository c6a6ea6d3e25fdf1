"""Tiny local causal LMs with a character-level tokenizer: the embedded default model.

Everything in posttrain runs and is tested on a 2-core CPU with no hub access, so the project
builds its own models. `build_tiny_model` writes an ordinary Hugging Face directory
(`config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json`) that `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
load like any hub model, so no code path special-cases the tiny model.

Tokenizer: one token per character over printable ASCII (space to `~`) plus newline; anything
else becomes `<unk>`. Special tokens:

`<pad>` 0 (padding), `<unk>` 1 (any character outside the alphabet), `<bos>` 2 (declared for
HF compatibility, never added automatically), `<|end|>` 3 (end of turn, and eos), `<|system|>` 4,
`<|user|>` 5, `<|assistant|>` 6 (each opens a turn of that role).

A second tokenizer, `pairs` (`small-pairs`, `tiny-llama-pairs`, ...: `build_pairs_tokenizer`), gives a
teacher of another tokenizer for cross-tokenizer distillation: a number of three digits or more that a
text starts with has its first two digits as one token (an answer `123` is `12`, `3`; `85` stays `8`,
`5`), every other character one token, at other ids than the character tokenizer's, and ChatML's turns
(`<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n`). So the two tokenisations of an answer
differ (half the 2-digit sums have three digits) while the teacher's arithmetic stays digit-wise: the
operands inside a prompt (which starts with its role) stay single digits, and the one pair an answer
can start with is a sum's hundreds and tens, which a digit-wise model computes anyway. Measured on the
`small` preset's 800-step SFT warm start (greedy accuracy on 500 2-digit additions): this tokenizer
93.8-94.4% (seeds 1-3; the character tokenizer: 95.2%, seed 42); with the two leading digits of every
answer paired (`85` one token) 55.8% (seed 42); with every two digits in a row one token 6.6% after
400 steps (a table of pairs to learn instead of digit-wise addition).

We do not prepend `<bos>`: the chat template already starts every conversation with a role
token, and every extra token costs training time on a CPU. Chat format (no separators, so
prompts stay short): `<|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|>`; with
`add_generation_prompt=True` the text ends in `<|assistant|>`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3MoeConfig,
)

from posttrain.models.saving import save_pretrained_here
from posttrain.utils.cache import cache_dir, publish_entry
from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.models.presets import (  # noqa: F401 (re-exported: tiny.PRESETS, tiny.ARCHS)
    ARCHS,
    DEEPSEEK_V3_EXPERTS,
    GEMMA3_GLOBAL_EVERY,
    GEMMA3_SLIDING_WINDOW,
    MOE_ARCHS,
    MOE_EXPERTS,
    MOE_ROUTER_AUX_LOSS_COEF,
    MOE_TOP_K,
    PRESETS,
)

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<|end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, SYSTEM, USER, ASSISTANT]
# Printable ASCII (0x20..0x7e) plus newline; `string.printable` would also bring \t\r\x0b\x0c.
ALPHABET = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM + "{{ message['content'] }}" + EOS +
    "{%- elif message['role'] == 'user' -%}" + USER + "{{ message['content'] }}" + EOS +
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT + "{% generation %}{{ message['content'] }}" + EOS +
    "{% endgeneration %}"
    "{%- else -%}{{ raise_exception('tiny chat template: unknown role ' ~ message['role'] ~"
    " ' (expected system, user or assistant)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)

# The `pairs` tokenizer: its own special tokens (ChatML's; pad, unk, bos and eos at the same ids as the
# character tokenizer's, which `tiny_config` sets), then the 100 digit pairs, then the alphabet.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PAIRS_SPECIAL_TOKENS = [PAD, UNK, BOS, IM_END, IM_START]
DIGIT_PAIRS = [f"{a}{b}" for a in "0123456789" for b in "0123456789"]
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '" + IM_END + "' }}{% endgeneration %}"
    "{%- else -%}{{ message['content'] + '" + IM_END + "' }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '" + IM_START + "assistant\\n' }}{%- endif -%}"
)

# Bump when the recipe below changes, so `ensure_tiny_model` rebuilds stale cached copies.
RECIPE_VERSION = 1
# Bump when the `pairs` tokenizer changes (its cached models only). 2: pairs only before a third digit.
PAIRS_VERSION = 2

MAX_POSITION_EMBEDDINGS = 2048


def build_tokenizer(extra_special_tokens: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The character-level tokenizer shared by every tiny model (vocabulary of 103 tokens).

    `extra_special_tokens` (default none) get the ids after the alphabet, so the text ids stay
    the same: the tiny vision-language model's `<image>` (`posttrain.models.vision`) is id 103.
    `chat_template` defaults to `CHAT_TEMPLATE`."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET + list(extra_special_tokens))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character (newline included); special tokens are matched before this runs.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates pieces as they are: the default decoder would put spaces between them.
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, *extra_special_tokens],
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a." and break round trips
        padding_side="right",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_pairs_tokenizer() -> PreTrainedTokenizerFast:
    """The `pairs` tokenizer (vocabulary of 201 tokens): when a text (a piece between special tokens)
    starts with three digits or more, its first two are one token (`123` is `12`, `3`; `85` is `8`, `5`;
    `123+45` is `12`, `3`, `+`, `4`, `5`), every other character one token; ChatML chat template, eos
    `<|im_end|>`."""
    vocab = {tok: i for i, tok in enumerate(PAIRS_SPECIAL_TOKENS + DIGIT_PAIRS + ALPHABET)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\A[0-9][0-9](?=[0-9])|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=IM_END,
        additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False, padding_side="right",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_tokenizer(kind: str = "char") -> PreTrainedTokenizerFast:
    """The tokenizer of the tiny models named `kind` (`presets.TINY_TOKENIZERS`): `char` (default) or `pairs`."""
    if kind == "pairs":
        return build_pairs_tokenizer()
    if kind != "char":
        raise ValueError(f"unknown tiny tokenizer {kind!r}; choose one of char, pairs")
    return build_tokenizer()


def tiny_config(preset: str = "tiny", arch: str = "llama", vocab_size: int | None = None):
    """The transformers config of a preset (`tiny`, `small`, `100m`, `1b`) and arch (`llama`, `qwen2`,
    `qwen3_moe`, `mixtral`, `deepseek_v3`, `gemma3`).

    Llama keeps input and output embeddings separate (`tie_word_embeddings=False`); qwen2 ties
    them, as Qwen2.5-0.5B/1.5B do, so both layouts are exercised by the same tests. The
    mixture-of-experts archs replace each MLP by `MOE_EXPERTS` experts of a quarter of its width,
    `MOE_TOP_K` per token (same active MLP width), with the router's load-balancing loss
    (`router_aux_loss_coef`, Fedus et al. 2021) on: Qwen3-MoE (per-head q/k norms, tied
    embeddings like the small Qwen3 models) and Mixtral (untied). `deepseek_v3`: see `deepseek_v3_config`,
    `gemma3`: `gemma3_config`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {list(ARCHS)}")
    common: dict[str, Any] = dict(
        PRESETS[preset],
        vocab_size=vocab_size or len(SPECIAL_TOKENS) + len(ALPHABET),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        initializer_range=0.02,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "deepseek_v3":
        return deepseek_v3_config(common)
    if arch == "gemma3":
        return gemma3_config(common)
    expert_width = common["intermediate_size"] // 4
    moe: dict[str, Any] = dict(num_experts_per_tok=MOE_TOP_K, router_aux_loss_coef=MOE_ROUTER_AUX_LOSS_COEF)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, num_experts=MOE_EXPERTS, moe_intermediate_size=expert_width,
                              head_dim=common["hidden_size"] // common["num_attention_heads"], tie_word_embeddings=True)
    common["intermediate_size"] = expert_width
    return MixtralConfig(**common, **moe, num_local_experts=MOE_EXPERTS, tie_word_embeddings=False)


def deepseek_v3_config(common: dict[str, Any]) -> DeepseekV3Config:
    """DeepSeek-V3's layout (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sections 2.1-2.2) at
    a preset's size, every part of it exercised:

    - multi-head latent attention: queries through a rank hidden/2 bottleneck (`q_lora_rank`), keys and
      values through a rank hidden/4 latent (`kv_lora_rank`, what the KV cache holds) plus one shared
      rotary key of half a head (`qk_rope_head_dim`, interleaved as in the released weights); the
      other half of each query/key head is position-free (`qk_nope_head_dim`); values a head wide;
    - mixture of experts from the second layer on (`first_k_dense_replace=1`; the first keeps a dense
      MLP, as DeepSeek-V3's first 3 do): 8 routed experts of an eighth of the dense width plus one shared
      expert of that width, top-2 of the routed ones within the best 1 of 2 groups of 4
      (`n_group`, `topk_group`: node-limited routing in miniature);
    - sigmoid router scores, normalised over the chosen experts (`norm_topk_prob`); the per-expert bias
      `e_score_correction_bias` enters the choice only (models/moe_balance.py updates it);
      `routed_scaling_factor=1.0`: with normalised weights summing to 1 the routed output has the
      scale of the other MoE presets' (DeepSeek-V3's 2.5 goes with its 256 experts);
    - no auxiliary load-balancing loss and no multi-token-prediction module (`num_mtp_layers=0`).
    """
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    head_dim = hidden // heads
    experts = DEEPSEEK_V3_EXPERTS
    return DeepseekV3Config(
        **{**common, "num_key_value_heads": heads},  # MLA: every head has its own keys and values
        q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim, rope_interleave=True,
        n_routed_experts=experts, n_shared_experts=1, moe_intermediate_size=common["intermediate_size"] // experts,
        num_experts_per_tok=MOE_TOP_K, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        first_k_dense_replace=1, num_mtp_layers=0, tie_word_embeddings=False,
    )


def gemma3_config(common: dict[str, Any]) -> Gemma3TextConfig:
    """Gemma 3's text model (Gemma Team 2025, "Gemma 3 Technical Report", section 2) at a preset's
    size: every `GEMMA3_GLOBAL_EVERY`-th layer attends globally (RoPE base 1M), the others to the
    last `GEMMA3_SLIDING_WINDOW` positions (RoPE base 10k); per-head RMSNorm of queries and keys
    (QK-norm), attention scaled by `query_pre_attn_scalar ** -0.5` (the head width, as in the 270M
    model), embeddings scaled by sqrt(hidden) and tied to the output head, GELU-tanh MLP, no logit
    soft-capping (Gemma 3 has none)."""
    layers, head_dim = common["num_hidden_layers"], common["hidden_size"] // common["num_attention_heads"]
    return Gemma3TextConfig(
        **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                     for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
    )


def make_tiny_model(
    preset: str = "tiny", arch: str = "llama", seed: int = 0, tokenizer: str = "char"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a randomly initialised tiny model and its tokenizer (`char` or `pairs`) in memory (float32, cpu).

    Weights are a pure function of (preset, arch, seed, tokenizer); the global RNG state is left untouched.
    """
    tokenizer = build_tiny_tokenizer(tokenizer)
    config = tiny_config(preset, arch, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]), MODEL_BUILD_LOCK:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval(), tokenizer


def build_tiny_model(out_dir: str | os.PathLike, preset: str = "tiny", arch: str = "llama", seed: int = 0,
                     tokenizer: str = "char") -> Path:
    """Write a Hugging Face model directory for a tiny preset into `out_dir` and return its path.

    Args:
        out_dir: target directory (created; existing files of the same names are overwritten).
        preset: `tiny` (hidden 128, 2 layers; default), `small` (hidden 256, 4 layers) `100m` or `1b` (GPU benchmarks).
        arch: `llama` (default), `qwen2`, `gemma3`, or the mixture-of-experts `qwen3_moe` / `mixtral` / `deepseek_v3`.
        seed: seed of the random initialisation (default 0).
        tokenizer: `char` (default) or `pairs` (`build_pairs_tokenizer`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = make_tiny_model(preset, arch, seed, tokenizer)
    save_quietly(model, out)
    # Chat template inside tokenizer_config.json (not chat_template.jinja): older readers find it too.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return out


def save_quietly(model: PreTrainedModel, out: Path) -> None:
    """`save_pretrained_here` without transformers' progress bar (a one-shard "Writing model
    shards" bar is noise in a job's console)."""
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save_pretrained_here(model, out)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def tiny_stamp(preset: str, arch: str, tokenizer: str = "char") -> dict[str, Any]:
    """What a cached tiny model is built from (its cache entry's stamp; the character tokenizer's
    entries keep the stamp they had before there was a second tokenizer)."""
    stamp = {"kind": "tiny-model", "recipe_version": RECIPE_VERSION, "preset": preset, "arch": arch, "seed": 0}
    return stamp if tokenizer == "char" else {**stamp, "tokenizer": tokenizer, "tokenizer_version": PAIRS_VERSION}


def ensure_tiny_model(preset: str = "tiny", arch: str = "llama", tokenizer: str = "char") -> Path:
    """Return `<cache>/models/<arch>-<preset>` (`-<tokenizer>` after it for `pairs`), building it (seed 0)
    on first use; a copy written by an older recipe, or a broken one, is replaced
    (`posttrain.utils.cache.publish_entry`)."""
    tiny_config(preset, arch)  # validate the names before touching the file system
    build_tiny_tokenizer(tokenizer)
    name = f"{arch}-{preset}" + ("" if tokenizer == "char" else f"-{tokenizer}")
    return publish_entry(
        cache_dir() / "models" / name, lambda tmp: build_tiny_model(tmp, preset, arch, seed=0, tokenizer=tokenizer),
        tiny_stamp(preset, arch, tokenizer), describe=f"tiny model {name}",
    )
