"""The fused, chunked head + logprob path against the plain one (`next_token_logprobs` of the
model's logits): values and gradients of the hidden states, the head weight (tied or not) and every
parameter of a real tiny HF model, for every micro-batching mode; which models may use it."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig
from posttrain.distributed.batch import Batch
from posttrain.models.policy.forward import (
    dynamic_microbatches,
    fixed_size_microbatches,
    logprob_positions,
    microbatch_logprobs,
    next_token_logprobs,
    packed_microbatches,
)
from posttrain.cpu_precision import matmul_dtype
from posttrain.models.policy.linear_logprobs import fused_logprobs_problem, linear_logprobs, tile_shape

CPU = torch.device("cpu")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def reference(hidden, weight, targets, temperature):
    """The plain path: full logits, then `next_token_logprobs` (a `[1, N + 1]` row whose position
    i + 1 is token i, so its logits are those of hidden state i)."""
    logits = (hidden @ weight.T)[None]
    padded = torch.cat([logits, logits[:, :1]], dim=1)  # the last position is never read
    ids = torch.cat([targets.new_zeros(1), targets])[None]
    return next_token_logprobs(padded, ids, temperature)[0, 1:]


def values_and_grads(fn, hidden, weight, targets, temperature, upstream):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    values = fn(hidden, weight, targets, temperature)
    (values * upstream).sum().backward()
    return values.detach(), hidden.grad, weight.grad


# Tiles over 10 tokens x 300 logits: one token and 7 logits (the last block partial); 3 tokens
# (the last chunk partial) and 64 logits; everything in one tile; tiles larger than the inputs.
@pytest.mark.parametrize("chunk_tokens, vocab_block", [(1, 7), (3, 64), (10, 300), (64, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernel_matches_full_logits_values_and_gradients(chunk_tokens, vocab_block, temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 10, 16, 300
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 2
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)

    def fused(hd, w, t, temp):
        return linear_logprobs(hd, w, t, temp, chunk_tokens=chunk_tokens, vocab_block=vocab_block)

    got = values_and_grads(fused, hidden, weight, targets, temperature, upstream)
    want = values_and_grads(reference, hidden, weight, targets, temperature, upstream)
    for name, a, b in zip(("logprobs", "grad hidden", "grad weight"), got, want):
        assert relative_error(a, b) < 1e-5, name
    # The temperature really is applied: without it the values differ.
    if temperature != 1.0:
        assert relative_error(linear_logprobs(hidden, weight, targets, 1.0), want[0]) > 1e-2


def test_kernel_with_nothing_selected_gives_zero_gradients():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    values = linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert values.shape == (0,) and values.dtype == torch.float32
    values.sum().backward()
    # A zero tensor, not None: FSDP reduces the same parameters' gradients on every rank.
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))
    assert hidden.grad.shape == (0, 8)


def test_kernel_under_bfloat16_autocast_matches_the_autocast_head():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(12, 32, generator=g), torch.randn(500, 32, generator=g) / 4
    targets = torch.randint(0, 500, (12,), generator=g)
    upstream = torch.randn(12, generator=g)

    # The head as posttrain's autocast runs it: a bf16 matmul where this CPU has bfloat16 matmul
    # instructions, else float32 (`matmul_dtype`: PyTorch's bf16 GEMM is scalar code there), then a
    # float32 log-softmax.
    bf16_matmuls = matmul_dtype(torch.bfloat16, "cpu") == torch.bfloat16

    def plain(hd, w, t, temp):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_matmuls):
            logits = torch.nn.functional.linear(hd, w)
        return torch.log_softmax(logits.float() / temp, -1).gather(-1, t[:, None]).squeeze(-1)

    def fused(hd, w, t, temp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear_logprobs(hd, w, t, temp, chunk_tokens=5, vocab_block=128)

    got = values_and_grads(fused, hidden, weight, targets, 0.8, upstream)
    want = values_and_grads(plain, hidden, weight, targets, 0.8, upstream)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32  # float32 master weight's grad
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)  # same bf16 logits, same float32 math
    for a, b in zip(got[1:], want[1:]):  # gradients: bf16 matmuls, one rounding per chunk
        assert relative_error(a, b) < 2e-2


def test_tile_shape():
    assert tile_shape(2400, 49152) == (2400, 1747)  # all tokens, 16 MiB of float32 logits per tile
    assert tile_shape(10, 49152) == (10, 49152)  # few tokens: the whole vocabulary
    assert tile_shape(100_000, 49152) == (8192, 512)  # many tokens: chunked, blocks no narrower than 512
    assert tile_shape(0, 49152)[0] == 1


# ------------------------------------------------------------------------------ real tiny models
def tiny_model(arch: str = "llama", tied: bool = True, **config):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, **config,
    )
    return model_cls(cfg).train()


def masked_batch(lengths: list[int], low: int, high: int) -> Batch:
    """Right-padded rows of `lengths` with token ids drawn from [low, high) (seed 0): prompt = first
    3 tokens, row 4 masked out."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(lengths)
    valid = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    ids = torch.randint(low, high, tuple(valid.shape), generator=g) * valid
    token_mask = valid.float()
    token_mask[:, :3] = 0
    sample_mask = torch.ones(len(lengths))
    sample_mask[4] = 0
    return Batch(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask)


def make_batch() -> Batch:
    """Rows of lengths 14, 5, 9, 7, 16, 3."""
    return masked_batch([14, 5, 9, 7, 16, 3], 1, 97)


PLANS = {
    "fixed": lambda b: fixed_size_microbatches(b, 4),
    "dynamic": lambda b: dynamic_microbatches(b, max_tokens=32, round_to=4),
    "packed": lambda b: packed_microbatches(b, max_tokens=20, algorithm="first_fit_decreasing"),
}


def run_plan(model, batch, plan, fused, temperature, loss_positions_only):
    """Logprobs `[B, S]` of every micro-batch and the parameters' gradients of sum(logprobs * w)
    over the loss positions (w fixed random weights)."""
    model.zero_grad(set_to_none=True)
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    loss_positions = logprob_positions(batch, loss_positions_only=True)
    out = torch.zeros(batch["input_ids"].shape)
    for mb in PLANS[plan](batch):
        logprobs = microbatch_logprobs(model, mb, CPU, torch.float32, temperature, fused=fused,
                                       loss_positions_only=loss_positions_only)
        width = logprobs.shape[1]
        if logprobs.requires_grad:
            (logprobs * weights[mb.index, :width] * loss_positions[mb.index, :width]).sum().backward()
        out[mb.index, :width] = logprobs.detach()
    return out, {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)])
def test_fused_microbatches_match_the_logits_path(plan, arch, tied):
    model, batch = tiny_model(arch, tied), make_batch()
    assert fused_logprobs_problem(model) is None
    expected, expected_grads = run_plan(model, batch, plan, fused=False, temperature=0.7, loss_positions_only=False)

    # Inference: every valid position, as the logits path.
    with torch.no_grad():
        every, _ = run_plan(model, batch, plan, fused=True, temperature=0.7, loss_positions_only=False)
    torch.testing.assert_close(every, expected, atol=1e-5, rtol=1e-5)

    # Training: only the loss positions; the rest is 0; gradients of every parameter agree.
    got, grads = run_plan(model, batch, plan, fused=True, temperature=0.7, loss_positions_only=True)
    loss_positions = logprob_positions(batch, loss_positions_only=True)
    assert loss_positions.sum() == 11 + 2 + 6 + 4 + 0 + 0  # lengths - 3; row 4 masked, row 5 all prompt
    torch.testing.assert_close(got, expected * loss_positions, atol=1e-5, rtol=1e-5)
    assert (got[~loss_positions] == 0).all()
    head = "lm_head.weight" if not tied else "model.embed_tokens.weight"  # tied: one parameter
    assert head in grads and grads[head].abs().sum() > 0
    for name, grad in expected_grads.items():
        assert relative_error(grads[name], grad) < 1e-5, name


def test_fused_microbatch_with_no_loss_position_gives_zeros_and_zero_gradients():
    model, batch = tiny_model(), make_batch()
    batch["token_mask"].zero_()
    (mb,) = fixed_size_microbatches(batch, 6)
    logprobs = microbatch_logprobs(model, mb, CPU, torch.float32, fused=True, loss_positions_only=True)
    assert logprobs.shape == (6, 16) and (logprobs == 0).all()
    logprobs.sum().backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters())


def test_which_models_may_use_the_fused_path():
    from peft import LoraConfig, get_peft_model

    assert fused_logprobs_problem(tiny_model()) is None
    # Logit soft-capping on an otherwise plain model: refused.
    assert "final_logit_softcapping" in fused_logprobs_problem(tiny_model(final_logit_softcapping=30.0))
    # A head with a bias: refused.
    biased = tiny_model(tied=False)
    biased.lm_head = torch.nn.Linear(32, 97, bias=True)
    assert "with bias" in fused_logprobs_problem(biased)
    # LoRA on the attention only: the head is still plain, the path is used (through the wrapper).
    lora = get_peft_model(tiny_model(tied=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert fused_logprobs_problem(lora) is None
    # LoRA on the head itself: refused.
    lora_head = get_peft_model(tiny_model(tied=False), LoraConfig(r=4, target_modules=["lm_head"]))
    assert "plain nn.Linear" in fused_logprobs_problem(lora_head)
    # An architecture not known to be plain (Gemma2 soft-caps its logits).
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert "gemma2" in fused_logprobs_problem(gemma2)


def test_fused_lora_gradients_reach_the_adapters_only():
    from peft import LoraConfig, get_peft_model

    batch = make_batch()
    results = []
    for fused in (False, True):
        model = get_peft_model(tiny_model(tied=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # B starts at 0; make the adapters matter
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(3))
        results.append(run_plan(model, batch, "fixed", fused=fused, temperature=1.0, loss_positions_only=fused))
    (plain, plain_grads), (fused_values, fused_grads) = results
    torch.testing.assert_close(fused_values, plain * logprob_positions(batch, True), atol=1e-5, rtol=1e-5)
    assert fused_grads["base_model.model.lm_head.weight"] is None  # frozen: no weight-gradient matmul
    for name, grad in plain_grads.items():
        if grad is not None:
            assert relative_error(fused_grads[name], grad) < 1e-5, name


def test_clipped_pg_is_finite_when_logprobs_outside_the_mask_are_zero():
    """The fused path leaves 0 outside the loss mask while prev_logprobs there can be very
    negative: exp(0 - prev) must not overflow into the loss (inf * 0 = NaN)."""
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(2, 6, generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.float)
    batch = Batch(
        token_mask=mask, sample_mask=torch.ones(2), advantages=torch.tensor([[1.0] * 6, [-0.5] * 6]),
        prev_logprobs=logprobs - 0.1, generation_logprobs=logprobs * mask,
    )
    loss_fn = ClippedPGLoss(LossConfig())
    full, _ = loss_fn(logprobs.clone().requires_grad_(), batch, 2, mask[:, 1:].sum())
    # A very unlikely prompt token outside the mask: exp(0 - (-200)) overflows float32.
    batch["prev_logprobs"] = torch.where(mask > 0, logprobs - 0.1, torch.tensor(-200.0))
    zeroed = (logprobs * mask).requires_grad_()
    loss, _ = loss_fn(zeroed, batch, 2, mask[:, 1:].sum())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(zeroed.grad).all()
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    assert (zeroed.grad[mask == 0] == 0).all()
