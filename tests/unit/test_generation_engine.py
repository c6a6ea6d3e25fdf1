import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models.generation.engine import NativeGenerationEngine, right_to_left_padding
from posttrain.models.generation.sampling import process_logits

PAD, EOS = 0, 1


def random_llama(vocab_size: int = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


# Known-output model: token i is always followed by NEXT[i]. Embeddings are one-hot, every block
# writes zero into the residual stream (o_proj and down_proj are 0), so the final hidden state is
# RMSNorm(one-hot(i)) = 4 * one-hot(i) and lm_head maps it to a logit of 4 on NEXT[i], 0 elsewhere.
VOCAB = ["<pad>", "<eos>", "a", "b", "c", "d", "xy", "z", "q", "r", "s", "t", "u", "v", "w", "k"]
NEXT = {i: (i + 1) % len(VOCAB) for i in range(len(VOCAB))}
NEXT.update({8: EOS, 15: 2})  # "q" -> eos; "k" wraps to "a"
CHOSEN_LOGPROB = 4.0 - math.log(math.exp(4.0) + len(VOCAB) - 1)


def chain_model() -> LlamaForCausalLM:
    size = len(VOCAB)
    config = LlamaConfig(
        vocab_size=size, hidden_size=size, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-12,
        pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, j in NEXT.items():
            model.lm_head.weight[j, i] = 1.0
    return model


class ListTokenizer:
    """Decodes ids by concatenating VOCAB strings (what the engine needs for stop strings)."""

    def batch_decode(self, sequences, skip_special_tokens=False):
        return ["".join(VOCAB[i] for i in seq) for seq in sequences]


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    return ids, torch.tensor([len(r) for r in rows])


def generated(out: dict, row: int) -> list[int]:
    start = int(out["unpadded_sequence_lengths"][row] - out["generation_lengths"][row])
    return out["output_ids"][row, start : int(out["unpadded_sequence_lengths"][row])].tolist()


def test_right_to_left_padding():
    ids, lengths = right_padded([[5, 6, 7], [8]])
    left, mask, pos = right_to_left_padding(ids, lengths, PAD)
    assert left.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos[:, -1].tolist() == [2, 0]


def test_chain_model_output_layout_and_eos():
    engine = NativeGenerationEngine(chain_model(), ListTokenizer(), pad_token_id=PAD, eos_token_id=EOS)
    # Row 0 "a" -> b c d xy z q <eos> (7 tokens, stops); row 1 "s t" -> u v w (budget of 3 hit).
    ids, lengths = right_padded([[2], [10, 11]])
    out = engine.generate(ids, lengths, max_new_tokens=7, greedy=True)
    assert generated(out, 0) == [3, 4, 5, 6, 7, 8, EOS]
    assert generated(out, 1) == [12, 13, 14, 15, 2, 3, 4]
    assert out["generation_lengths"].tolist() == [7, 7]
    assert out["truncated"].tolist() == [False, True]

    out = engine.generate(ids, lengths, max_new_tokens=3, greedy=True)
    # Generated tokens follow each prompt directly; rows are right-padded to S + T = 2 + 3.
    assert out["output_ids"].tolist() == [[2, 3, 4, 5, PAD], [10, 11, 12, 13, 14]]
    assert out["unpadded_sequence_lengths"].tolist() == [4, 5]
    assert out["truncated"].tolist() == [True, True]
    expected_lp = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]) * CHOSEN_LOGPROB
    torch.testing.assert_close(out["logprobs"], expected_lp)


def test_stop_token_ids_end_the_row_and_are_kept():
    engine = NativeGenerationEngine(chain_model(), ListTokenizer(), pad_token_id=PAD, eos_token_id=EOS)
    ids, lengths = right_padded([[2], [12]])
    out = engine.generate(ids, lengths, max_new_tokens=10, greedy=True, stop_token_ids=[5])
    assert generated(out, 0) == [3, 4, 5]
    assert generated(out, 1) == [13, 14, 15, 2, 3, 4, 5]
    assert out["truncated"].tolist() == [False, False]
    assert out["output_ids"].shape == (2, 1 + 7)


def test_stop_strings_cut_after_the_completing_token():
    engine = NativeGenerationEngine(chain_model(), ListTokenizer(), pad_token_id=PAD, eos_token_id=None)
    ids, lengths = right_padded([[2], [2], [2], [2]])
    # Text generated from "a": b c d xy z q <eos> r ...
    stops = [["cd"], ["yz"], ["x", "nothing"], None]
    out = engine.generate(ids, lengths, max_new_tokens=5, greedy=True, stop_strings=stops)
    assert generated(out, 0) == [3, 4, 5]  # "cd" spans two tokens
    assert generated(out, 1) == [3, 4, 5, 6, 7]  # "yz" spans "xy" + "z", ends on the last budget token
    assert generated(out, 2) == [3, 4, 5, 6]  # "x" ends inside token "xy": the whole token is kept
    assert generated(out, 3) == [3, 4, 5, 6, 7]
    assert out["truncated"].tolist() == [False, False, False, True]

    # One list shared by all rows.
    out = engine.generate(ids[:2], lengths[:2], max_new_tokens=8, greedy=True, stop_strings=["bc"])
    assert [generated(out, i) for i in range(2)] == [[3, 4], [3, 4]]


def test_bad_inputs_raise_clear_errors():
    engine = NativeGenerationEngine(chain_model(), None, pad_token_id=PAD, eos_token_id=EOS)
    ids, lengths = right_padded([[2], [3, 4]])
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(ids, lengths, max_new_tokens=2, stop_strings=["x"])
    with pytest.raises(ValueError, match="input_lengths"):
        engine.generate(ids, torch.tensor([0, 2]), max_new_tokens=2)
    with pytest.raises(ValueError, match="per-sample stop_strings has 3"):
        engine.generate(ids, lengths, max_new_tokens=2, stop_strings=[["a"], None, None])


def test_mixed_length_batch_matches_rows_generated_alone():
    model = random_llama()
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(1)
    rows = [torch.randint(2, 64, (n,)).tolist() for n in (5, 1, 9, 3)]
    ids, lengths = right_padded(rows)
    batched = engine.generate(ids, lengths, max_new_tokens=12, greedy=True)
    for i, row in enumerate(rows):
        alone = engine.generate(torch.tensor([row]), torch.tensor([len(row)]), max_new_tokens=12, greedy=True)
        assert generated(batched, i) == generated(alone, 0)
        n = int(alone["unpadded_sequence_lengths"][0])
        torch.testing.assert_close(batched["logprobs"][i, :n], alone["logprobs"][0, :n], atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = random_llama()
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(2)
    rows = [torch.randint(2, 64, (n,)).tolist() for n in (4, 7, 2)]
    ids, lengths = right_padded(rows)
    seeds = torch.tensor([11, 22, 33])
    kwargs = dict(max_new_tokens=10, temperature=1.3)
    first = engine.generate(ids, lengths, seeds=seeds, **kwargs)
    again = engine.generate(ids, lengths, seeds=seeds, **kwargs)
    assert torch.equal(first["output_ids"], again["output_ids"])
    alone = engine.generate(torch.tensor([rows[1]]), torch.tensor([7]), seeds=seeds[1:2], **kwargs)
    assert generated(first, 1) == generated(alone, 0)
    other = engine.generate(ids, lengths, seeds=torch.tensor([1, 2, 3]), **kwargs)
    assert not torch.equal(first["output_ids"], other["output_ids"])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 20, 0.9)])
def test_logprobs_agree_with_full_forward_pass(temperature, top_k, top_p):
    model = random_llama()
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(3)
    rows = [torch.randint(2, 64, (n,)).tolist() for n in (6, 2, 11, 4, 8, 1)]
    ids, lengths = right_padded(rows)
    out = engine.generate(
        ids, lengths, max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p,
        seeds=torch.arange(6),
    )
    # Reference: one plain forward pass over the full right-padded sequences.
    seq, seq_len = out["output_ids"], out["unpadded_sequence_lengths"]
    mask = (torch.arange(seq.shape[1]).unsqueeze(0) < seq_len.unsqueeze(1)).long()
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask).logits
    reference = process_logits(logits[:, :-1], temperature, top_k, top_p).gather(-1, seq[:, 1:, None]).squeeze(-1)
    positions = torch.arange(1, seq.shape[1]).unsqueeze(0)
    prompt_len = seq_len - out["generation_lengths"]
    generated_mask = (positions >= prompt_len.unsqueeze(1)) & (positions < seq_len.unsqueeze(1))
    assert (out["logprobs"][:, 1:][~generated_mask] == 0).all()
    diff = (out["logprobs"][:, 1:] - reference)[generated_mask]
    assert torch.isfinite(diff).all()
    mult_prob_error = diff.abs().exp().mean().item()
    print(f"token_mult_prob_error={mult_prob_error:.8f}")
    assert mult_prob_error < 1.001, mult_prob_error


def test_empty_batch_returns_empty_outputs():
    engine = NativeGenerationEngine(chain_model(), None, pad_token_id=PAD, eos_token_id=EOS)
    out = engine.generate(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long), max_new_tokens=4)
    assert out["output_ids"].shape == (0, 3) and out["logprobs"].shape == (0, 3)
    assert out["truncated"].dtype == torch.bool and out["generation_lengths"].shape == (0,)


def test_a_generation_does_not_hold_its_kv_cache_after_it_returns():
    """The engine keeps its llama-like decoder between generations; the cache is the call's alone
    (held, it stayed allocated through training and the next generation's prefill)."""
    from posttrain.models.tiny import make_tiny_model

    model, tokenizer = make_tiny_model()
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    ids = torch.randint(3, 50, (4, 6))
    engine.generate(ids, torch.full((4,), 6), max_new_tokens=5, greedy=True)
    decoder = engine._llama_like
    assert decoder is not None and decoder.keys == [] and decoder.values == [] and decoder.attention_bias is None
    again = engine.generate(ids, torch.full((4,), 6), max_new_tokens=5, greedy=True)  # still decodes
    assert again["generation_lengths"].tolist() == [5, 5, 5, 5]
