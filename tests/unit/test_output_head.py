"""A decode step's output head in slices of its weight (`output_head.py`): the same product, used
only where it gave the whole product's bits, and the decoders' logits unchanged by it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models.generation import output_head
from posttrain.models.generation.decoders import LlamaLikeDecoder, ModelForwardDecoder
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.output_head import MIN_VOCAB, PROBE_ROWS, head_logits, sliced_linear

from decoder_checks import steps_beside_the_forward


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(output_head, "_choices", {})


def big_head(bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, MIN_VOCAB + 300, bias=bias)  # not a whole number of slices


@pytest.mark.parametrize("bias", [False, True])
def test_sliced_linear_is_the_whole_product(bias):
    head = big_head(bias)
    x = torch.randn(2, 5, 48)  # a 3-D input, as `extend` feeds
    with torch.no_grad():
        torch.testing.assert_close(sliced_linear(x, head.weight, head.bias), head(x), atol=1e-6, rtol=0)
        assert sliced_linear(x, head.weight, head.bias).shape == (2, 5, MIN_VOCAB + 300)


def test_the_head_gives_the_modules_bits_whichever_product_it_picks():
    """Slices or not (which is faster depends on the machine), the logits are the module's own, bit for
    bit, at the row counts the choice was checked on; the choice is made once per head shape."""
    head = big_head()
    with torch.no_grad():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, 48)
            assert torch.equal(head_logits(head, x), head(x))
    assert len(output_head._choices) == 1


def test_slices_that_change_the_bits_are_not_used(monkeypatch):
    exact = output_head.sliced_linear
    monkeypatch.setattr(output_head, "sliced_linear", lambda x, w, b=None: exact(x, w, b) * (1 + 1e-6))
    head = big_head()
    assert not output_head.slices_pay_off(head.weight.detach())
    x = torch.randn(8, 48)
    with torch.no_grad():
        assert torch.equal(head_logits(head, x), head(x))
    assert list(output_head._choices.values()) == [False]


def test_small_heads_and_heads_of_their_own_are_called_as_they_are():
    class Scaled(torch.nn.Linear):  # a head with its own forward (a wrapped or quantized one, say)
        def forward(self, x):
            return super().forward(x) * 2

    small = torch.nn.Linear(48, 100)
    scaled = Scaled(48, MIN_VOCAB)
    x = torch.randn(4, 48)
    with torch.no_grad():
        assert torch.equal(head_logits(small, x), small(x))
        assert torch.equal(head_logits(scaled, x), scaled(x))
    assert output_head._choices == {}


def test_a_decoder_with_a_large_vocabulary_steps_as_the_model_forward():
    """The llama-like decoder over a vocabulary large enough for slices: its logits are the forward's
    across decode steps with rows dropped (the head's choice made on the first step)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=MIN_VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    engine = NativeGenerationEngine(model, None, pad_token_id=0, eos_token_id=1, share_prompts=False)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(2, MIN_VOCAB, (n,), generator=g).tolist() for n in (5, 2, 7, 3)]
    ids = torch.tensor([r + [0] * (7 - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.randint(2, MIN_VOCAB, (4, 4), generator=g)
    steps = steps_beside_the_forward(engine, LlamaLikeDecoder(model), ModelForwardDecoder(model, True), ids, lengths,
                                     tokens, drop_rows_at=2)
    for _, ours, theirs in steps:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert len(output_head._choices) == 1
