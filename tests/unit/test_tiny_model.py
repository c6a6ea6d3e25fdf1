"""Tiny models and their tokenizer: HF round trips, determinism, caching, name resolution."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models import hf, tiny


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


def test_vocabulary_and_special_tokens(tokenizer):
    assert len(tokenizer) == 7 + 1 + 95  # specials, newline, printable ASCII
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2, 3)
    assert tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]
    assert tokenizer.convert_tokens_to_ids(["\n", " ", "0", "~"]) == [7, 8, 24, 102]


@pytest.mark.parametrize("text", ["12+34=46", "Hello,  world!\n  two  spaces ", " leading", "a . b ,c", ""])
def test_decode_encode_round_trip_is_exact(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tokenizer.decode(ids) == text


def test_unknown_characters_map_to_unk(tokenizer):
    ids = tokenizer("a\té")["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids("a"), 1, 1]
    assert tokenizer.decode(ids) == "a<unk><unk>"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+2="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>S<|end|><|user|>1+2=<|end|><|assistant|>"
    full = tokenizer.apply_chat_template(messages[1:] + [{"role": "assistant", "content": "3"}], tokenize=False)
    assert full == "<|user|>1+2=<|end|><|assistant|>3<|end|>"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids == [5, 25, 19, 26, 37, 3, 6, 27, 3]  # role tokens are single tokens
    assert tokenizer.decode(ids) == full
    with pytest.raises(Exception, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_and_reload_gives_identical_logits(tmp_path, arch):
    path = tiny.build_tiny_model(tmp_path / arch, preset="tiny", arch=arch, seed=3)
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (path / name).is_file(), name
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())

    reference, _ = tiny.make_tiny_model("tiny", arch, seed=3)  # same seed, built again in memory
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(loaded) is type(reference)
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 2, 4, 2)
    assert cfg.intermediate_size == 512 and cfg.max_position_embeddings >= 1024
    assert cfg.tie_word_embeddings is (arch == "qwen2")
    assert cfg.vocab_size == len(tokenizer) and loaded.generation_config.eos_token_id == tokenizer.eos_token_id

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_seed_changes_weights_and_global_rng_is_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, _ = tiny.make_tiny_model(seed=0)
    assert torch.equal(torch.rand(1), expected_next)
    b, _ = tiny.make_tiny_model(seed=1)
    c, _ = tiny.make_tiny_model(seed=0)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wc) and not torch.equal(wa, wb)


def test_100m_preset_has_about_100m_parameters():
    config = tiny.tiny_config("100m", "llama")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    # 12 layers * (2*768^2 + 2*768*256 attention + 3*768*3072 MLP + 2*768 norms) + 2*103*768 + 768
    assert n == 12 * (2 * 768**2 + 2 * 768 * 256 + 3 * 768 * 3072 + 2 * 768) + 2 * 103 * 768 + 768
    assert 95e6 < n < 110e6


def test_bad_preset_or_arch_names_the_choices():
    with pytest.raises(ValueError, match="preset 'huge'"):
        tiny.tiny_config("huge")
    with pytest.raises(ValueError, match="arch 'gpt2'"):
        tiny.tiny_config("tiny", "gpt2")


def test_ensure_tiny_model_builds_once_into_the_cache(tmp_path, monkeypatch):
    """Builds once into `<cache>/models`; damaged and older entries: tests/unit/test_cache_entries.py."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    path = tiny.ensure_tiny_model("tiny", "llama")
    assert path == tmp_path / "models" / "llama-tiny"
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.ensure_tiny_model("tiny", "llama") == path and weights.stat().st_mtime_ns == mtime  # reused
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == ["llama-tiny"]


def test_resolve_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    assert hf.resolve_model_path("tiny") == str(tmp_path / "cache" / "models" / "llama-tiny")
    assert hf.resolve_model_path("tiny", tiny_arch="qwen2").endswith("qwen2-tiny")
    assert hf.resolve_model_path("small-qwen2").endswith("qwen2-small")
    assert hf.resolve_model_path("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"  # hub ids pass through
    assert hf.resolve_model_path(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        hf.resolve_model_path(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        hf.load_causal_lm(str(tmp_path))  # exists, but no config.json


def test_load_tokenizer_and_model_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    tokenizer = hf.load_tokenizer("tiny")
    model = hf.load_causal_lm("tiny", dtype=torch.bfloat16)
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "<pad>"
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training


def test_pick_dtype():
    from posttrain.cpu_precision import auto_cpu_precision

    # auto on a CPU: bfloat16 with bfloat16 matmul instructions, else float32 (test_cpu_precision.py)
    assert hf.pick_dtype("auto", "cpu") == getattr(torch, auto_cpu_precision()[0])
    assert hf.pick_dtype("bfloat16", "cpu") == torch.bfloat16
    assert hf.pick_dtype("float16", torch.device("cpu")) == torch.float16
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        assert hf.pick_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        hf.pick_dtype("fp8", "cpu")


def test_models_built_in_threads_at_once_come_out_whole(tmp_path):
    """The local backend builds its worker groups' models in concurrent threads of one process:
    `load_causal_lm` must not let transformers' process-wide build patches cross threads (without
    the lock, most of these tied-embedding models come out with meta tensors or untied heads)."""
    import threading

    from transformers import AutoModelForCausalLM, LlamaConfig

    from posttrain.models.hf import load_causal_lm

    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    broken = []

    def load_a_few():
        for _ in range(4):
            model = load_causal_lm(str(tmp_path))
            if any(p.is_meta for p in model.parameters()) or \
                    model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
                broken.append(model)

    threads = [threading.Thread(target=load_a_few) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert broken == []
