"""Mixture-of-experts presets (Qwen3-MoE, Mixtral): build and reload, the router load-balancing
loss, and the native generation engine's KV cache on them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models import moe, tiny
from posttrain.models.generation.decoders import unsupported_reason
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.sampling import process_logits

MOE_ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_model(request):
    model, tokenizer = tiny.make_tiny_model("tiny", request.param, seed=1)
    return request.param, model, tokenizer


def test_presets_are_moe_with_the_load_balancing_loss_on(moe_model):
    arch, model, _ = moe_model
    cfg = model.config
    assert moe.is_moe(model) and cfg.num_experts_per_tok == 2
    if arch == "deepseek_v3":  # aux-loss-free: 8 routed experts balanced by the router's bias instead
        assert cfg.n_routed_experts == 8 and cfg.n_shared_experts == 1 and moe.aux_loss_coef(model, None) == 0.0
        return
    assert (cfg.num_experts if arch == "qwen3_moe" else cfg.num_local_experts) == 4
    assert moe.aux_loss_coef(model, None) == cfg.router_aux_loss_coef == 0.01
    assert moe.aux_loss_coef(model, 0.2) == 0.2 and moe.aux_loss_coef(model, 0.0) == 0.0
    dense, _ = tiny.make_tiny_model("tiny", "llama")
    assert not moe.is_moe(dense) and moe.aux_loss_coef(dense, 0.5) == 0.0


def test_build_and_reload_gives_identical_logits(tmp_path, moe_model):
    arch, model, _ = moe_model
    path = tiny.build_tiny_model(tmp_path / arch, preset="tiny", arch=arch, seed=1)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(7, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, atol=1e-6, rtol=0)


def test_recorded_router_loss_equals_transformers_aux_loss_and_ignores_padding(moe_model):
    arch, model, _ = moe_model
    if arch == "deepseek_v3":  # sigmoid routers: no loss of their own in transformers, Mixtral's is refused
        with pytest.raises(ValueError, match=r"policy.router_aux_loss_coef=0.01: deepseek_v3 has no load-balancing"):
            moe.aux_loss_coef(model, 0.01)
        return
    ids = torch.randint(7, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 4, 6])
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    with torch.no_grad(), moe.record_router_logits(model) as routers:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(routers.logits) == model.config.num_hidden_layers
    ours = moe.load_balancing_loss(model, routers.logits, mask)
    torch.testing.assert_close(ours, out.aux_loss)
    # Padding does not count: the loss over row 1 alone equals the masked loss of a batch of it.
    with torch.no_grad(), moe.record_router_logits(model) as alone:
        model(input_ids=ids[1:2, :4])
    with torch.no_grad(), moe.record_router_logits(model) as padded:
        model(input_ids=ids[1:2], attention_mask=mask[1:2])
    torch.testing.assert_close(moe.load_balancing_loss(model, alone.logits, torch.ones(1, 4)),
                               moe.load_balancing_loss(model, padded.logits, mask[1:2]))
    with moe.record_router_logits(model, enabled=False) as nothing:
        assert nothing is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_kv_cache_logprobs_match_a_full_forward_pass(moe_model, temperature):
    """Prefill + cached decoding (rows leaving the batch as they finish) give the logprobs of one
    full forward pass over the generated sequences."""
    arch, model, tokenizer = moe_model
    model.eval()
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)
    # DeepSeek-V3's latent attention is not llama-like: the engine decodes with the model's own forward.
    assert (engine._llama_like is None) == (arch == "deepseek_v3")
    if arch == "deepseek_v3":
        assert unsupported_reason(model) == "decoder layers ['DeepseekV3DecoderLayer'] are not llama-like"
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(7, 100, (n,), generator=g).tolist() for n in (6, 2, 9, 4)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    out = engine.generate(ids, torch.tensor([len(r) for r in rows]), max_new_tokens=12, temperature=temperature,
                          seeds=torch.arange(4), stop_token_ids=[50])  # some rows stop early
    seq, seq_len = out["output_ids"], out["unpadded_sequence_lengths"]
    mask = (torch.arange(seq.shape[1])[None] < seq_len[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask).logits
    reference = process_logits(logits[:, :-1], temperature, None, 1.0).gather(-1, seq[:, 1:, None]).squeeze(-1)
    positions = torch.arange(1, seq.shape[1])[None]
    generated = (positions >= (seq_len - out["generation_lengths"])[:, None]) & (positions < seq_len[:, None])
    assert generated.sum() > 20
    diff = (out["logprobs"][:, 1:] - reference)[generated]
    assert diff.abs().exp().mean().item() < 1.001
