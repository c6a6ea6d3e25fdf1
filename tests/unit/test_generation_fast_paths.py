"""The native engine's optimisations each give the unoptimised engine's output: shared-prompt
prefill, the llama-like decoder (preallocated KV cache) on every tiny arch, finished rows kept in
the batch and dropped in groups, and reused sampling buffers."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from posttrain.models import tiny
from posttrain.models.generation import decoders
from posttrain.models.generation.decoders import LlamaLikeDecoder, ModelForwardDecoder, unsupported_reason
from posttrain.models.generation.engine import UNOPTIMISED, NativeGenerationEngine, distinct_prompts
from posttrain.models.generation.sampling import SamplingBuffers, process_logits, sample

from decoder_checks import steps_beside_the_forward

PAD, EOS = 0, 1
ARCHS = ["llama", "qwen2", "qwen3_moe", "mixtral"]


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def grpo_rows(num_prompts: int, generations: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """`generations` copies of each of `num_prompts` random prompts, copies of a prompt next to each other."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(num_prompts)]
    return [p for p in prompts for _ in range(generations)]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    model, _ = tiny.make_tiny_model("tiny", request.param, seed=1)
    return request.param, model.eval()


def engine_for(model, **options) -> NativeGenerationEngine:
    return NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS, **options)


def assert_same_generation(out: dict, reference: dict) -> None:
    assert torch.equal(out["output_ids"], reference["output_ids"])
    assert torch.equal(out["generation_lengths"], reference["generation_lengths"])
    assert torch.equal(out["truncated"], reference["truncated"])
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- shared-prompt prefill
def test_distinct_prompts_groups_only_identical_prompts():
    # Rows 0 and 2 are the same prompt with different padding beyond it; row 3 is row 0's prefix.
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [5, 6, 7, 3], [5, 6, 0, 0], [8, 9, 0, 0]])
    lengths = torch.tensor([3, 2, 3, 2, 2])
    first_rows, row_map = distinct_prompts(ids, lengths)
    assert len(first_rows) == 3
    assert row_map[0] == row_map[2] and row_map[1] == row_map[4]
    assert len({int(row_map[0]), int(row_map[1]), int(row_map[3])}) == 3
    # Each group's first row holds that group's prompt.
    for row in range(5):
        assert int(first_rows[row_map[row]]) <= row and row_map[first_rows[row_map[row]]] == row_map[row]


def test_shared_prompt_prefill_gives_the_output_of_one_prefill_per_row(arch_model):
    _, model = arch_model
    rows = grpo_rows(3, 4, [7, 3, 5], vocab=100, seed=1)
    ids, lengths = right_padded(rows)
    kwargs = dict(max_new_tokens=10, temperature=0.9, seeds=torch.arange(12) + 7, stop_token_ids=[40, 41, 42])
    shared = engine_for(model, share_prompts=True, llama_like_decoder=False).generate(ids, lengths, **kwargs)
    per_row = engine_for(model, share_prompts=False, llama_like_decoder=False).generate(ids, lengths, **kwargs)
    assert_same_generation(shared, per_row)
    # Generations of one prompt differ (their seeds differ), so the prompts' caches were copied, not aliased.
    assert len({tuple(shared["output_ids"][i].tolist()) for i in range(4)}) > 1


# ---------------------------------------------------------------------------- llama-like decoder
def test_every_tiny_arch_is_llama_like_and_passes_the_self_check(arch_model):
    _, model = arch_model
    assert unsupported_reason(model) is None
    assert LlamaLikeDecoder(model).self_check() is None
    assert isinstance(engine_for(model)._decoder(), LlamaLikeDecoder)


@pytest.mark.parametrize("prompt_lengths", [[6, 2, 9, 4], [5, 5, 5, 5]], ids=["left-padded", "no-padding"])
@pytest.mark.parametrize("greedy", [True, False])
def test_optimised_engine_gives_the_unoptimised_output(arch_model, prompt_lengths, greedy):
    """Prompt sharing, the llama-like decoder, lazily dropped finished rows and reused buffers
    together: same tokens and logprobs, GRPO-shaped batch with rows stopping at different steps."""
    _, model = arch_model
    rows = grpo_rows(4, 3, prompt_lengths, vocab=100, seed=2)
    ids, lengths = right_padded(rows)
    kwargs = dict(max_new_tokens=14, temperature=0.8, greedy=greedy, seeds=torch.arange(12) * 3 + 1,
                  stop_token_ids=list(range(30, 45)))
    reference = engine_for(model, **UNOPTIMISED).generate(ids, lengths, **kwargs)
    out = engine_for(model).generate(ids, lengths, **kwargs)
    assert_same_generation(out, reference)
    if not greedy:  # the stop ids end some rows early and others not
        assert len(set(reference["generation_lengths"].tolist())) > 1


def decoder_and_forward_steps(model) -> list[tuple[LlamaLikeDecoder, torch.Tensor, torch.Tensor]]:
    """The llama-like decoder's and the model forward's logits over 6 decode steps of 4 left-padded
    prompts, rows 1 and 3 dropped after step 2: `[(decoder, ours, theirs)]` per step."""
    g = torch.Generator().manual_seed(4)
    ids, lengths = right_padded([torch.randint(2, 100, (n,), generator=g).tolist() for n in (5, 2, 7, 3)])
    engine = engine_for(model, share_prompts=False)
    ours, theirs = LlamaLikeDecoder(model), ModelForwardDecoder(model, supports_logits_to_keep=True)
    tokens = torch.randint(2, 100, (6, 4), generator=g)
    return steps_beside_the_forward(engine, ours, theirs, ids, lengths, tokens, drop_rows_at=2)  # rows 1, 3 finish


def test_llama_like_decoder_steps_match_the_model_forward_across_dropped_rows(arch_model):
    for _, ours, theirs in decoder_and_forward_steps(arch_model[1]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padded", [True, False])
def test_grouped_decode_attention_is_sdpa_over_the_filled_columns(padded):
    """The CPU 16-bit decode attention reads the whole cache buffers: columns from `length` on (NaN keys,
    zero values, as in a fresh cache) change nothing."""
    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, d, capacity, length = 5, 6, 2, 8, 12, 7
    q = torch.randn(rows, heads, 1, d, generator=g)
    keys, values = torch.randn(rows, kv_heads, capacity, d, generator=g), torch.randn(rows, kv_heads, capacity, d, generator=g)
    keys[:, :, length:], values[:, :, length:] = float("nan"), 0.0
    bias = torch.zeros(rows, 1, 1, capacity)
    if padded:
        bias[1, ..., :3] = bias[4, ..., :1] = float("-inf")
    ours = decoders.grouped_decode_attention(q, keys, values, length, bias if padded else None, 0.3)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, keys[:, :, :length], values[:, :, :length], attn_mask=bias[..., :length] if padded else None, scale=0.3,
        enable_gqa=True)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bfloat16_decoder_steps_track_the_model_forward(arch):
    """In bfloat16 on CPU the decoder attends with `grouped_decode_attention`: its logits stay within
    bfloat16 rounding of the model's own forward, across left padding and dropped rows."""
    model, _ = tiny.make_tiny_model("tiny", arch, seed=1)
    for decoder, ours, theirs in decoder_and_forward_steps(model.to(torch.bfloat16).eval()):
        assert decoder.cpu_16bit
        ours, theirs = ours.float(), theirs.float()
        assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_when_finished_rows_are_dropped_does_not_change_the_output(fraction):
    model, _ = tiny.make_tiny_model("tiny", "llama", seed=1)
    rows = grpo_rows(2, 5, [6, 3], vocab=100, seed=5)
    ids, lengths = right_padded(rows)
    kwargs = dict(max_new_tokens=16, temperature=1.0, seeds=torch.arange(10) + 100, stop_token_ids=list(range(20, 40)))
    reference = engine_for(model, **UNOPTIMISED).generate(ids, lengths, **kwargs)
    assert len(set(reference["generation_lengths"].tolist())) > 2  # rows finish at several steps
    assert_same_generation(engine_for(model, finished_rows_fraction=fraction).generate(ids, lengths, **kwargs),
                           reference)


@pytest.mark.parametrize("rows", [[[5, 9, 13]], [[4], [7, 8], [9, 10, 11], [12, 13, 14, 15]]],
                         ids=["one-row", "all-distinct"])
def test_batch_of_one_and_all_distinct_prompts(rows):
    model, _ = tiny.make_tiny_model("tiny", "qwen2", seed=1)
    ids, lengths = right_padded(rows)
    kwargs = dict(max_new_tokens=9, temperature=1.1, seeds=torch.arange(len(rows)) + 5)
    assert_same_generation(engine_for(model).generate(ids, lengths, **kwargs),
                           engine_for(model, **UNOPTIMISED).generate(ids, lengths, **kwargs))


def test_a_rows_tokens_do_not_depend_on_the_rest_of_the_batch():
    model, _ = tiny.make_tiny_model("tiny", "llama", seed=1)
    engine = engine_for(model)
    rows = grpo_rows(3, 4, [6, 3, 8], vocab=100, seed=6)
    ids, lengths = right_padded(rows)
    seeds = torch.arange(12) + 50
    kwargs = dict(max_new_tokens=12, temperature=1.0, stop_token_ids=list(range(20, 35)))
    batched = engine.generate(ids, lengths, seeds=seeds, **kwargs)
    for row in (0, 5, 11):
        alone = engine.generate(ids[row : row + 1, : lengths[row]], lengths[row : row + 1], seeds=seeds[row : row + 1],
                                **kwargs)
        n = int(alone["unpadded_sequence_lengths"][0])
        assert batched["output_ids"][row, :n].tolist() == alone["output_ids"][0, :n].tolist()
        torch.testing.assert_close(batched["logprobs"][row, :n], alone["logprobs"][0, :n], atol=1e-5, rtol=0)


def test_stop_strings_end_rows_kept_in_the_batch():
    model, tokenizer = tiny.make_tiny_model("tiny", "llama", seed=1)
    rows = grpo_rows(2, 3, [5, 8], vocab=100, seed=7)
    ids, lengths = right_padded(rows)
    kwargs = dict(max_new_tokens=16, temperature=1.0, seeds=torch.arange(6),
                  stop_strings=[["e"], ["a", "o"], None, ["i"], ["e"], None])
    make = lambda **o: NativeGenerationEngine(model, tokenizer, pad_token_id=PAD, eos_token_id=EOS, **o)  # noqa: E731
    out = make(finished_rows_fraction=1.0).generate(ids, lengths, **kwargs)
    assert_same_generation(out, make(**UNOPTIMISED).generate(ids, lengths, **kwargs))
    assert not out["truncated"].all()


# ---------------------------------------------------------------------------- support and fallback
def test_unsupported_models_say_why():
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)
    eager = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="eager"))
    assert "eager" in unsupported_reason(eager)
    sliding = MistralForCausalLM(MistralConfig(**common, sliding_window=16))
    assert "sliding" in unsupported_reason(sliding)
    assert isinstance(engine_for(eager)._decoder(), ModelForwardDecoder)


def test_self_check_catches_a_wrong_layer_and_the_engine_falls_back(monkeypatch, caplog):
    model, _ = tiny.make_tiny_model("tiny", "llama", seed=1)
    decoder = LlamaLikeDecoder(model)
    decoder.apply_rotary = lambda q, k, cos, sin: (q, k)  # as if a release changed the rotary embedding
    assert "differs" in decoder.self_check()

    monkeypatch.setattr(decoders.LlamaLikeDecoder, "self_check", lambda self: "differs (simulated)")
    engine = engine_for(model)
    with caplog.at_level(logging.WARNING):
        chosen = engine._decoder()
    assert isinstance(chosen, ModelForwardDecoder) and "simulated" in caplog.text
    ids, lengths = right_padded([[5, 6, 7], [8, 9]])
    kwargs = dict(max_new_tokens=5, greedy=True)
    assert_same_generation(engine.generate(ids, lengths, **kwargs),
                           engine_for(model, **UNOPTIMISED).generate(ids, lengths, **kwargs))


# ---------------------------------------------------------------------------- sampling buffers
@pytest.mark.parametrize("top_k,top_p", [(None, 1.0), (5, 1.0), (None, 0.8), (7, 0.9)])
def test_sampling_with_reused_buffers_is_bit_identical(top_k, top_p):
    torch.manual_seed(0)
    buffers = SamplingBuffers(8, 50, torch.device("cpu"))
    for rows in (8, 5, 1):  # fewer rows than the buffers hold, as when rows finish
        logits = torch.randn(rows, 50) * 3
        seeds, steps = torch.arange(rows) + 11, torch.full((rows,), 4)
        plain = process_logits(logits, 0.7, top_k, top_p)
        reused = process_logits(logits, 0.7, top_k, top_p, buffers=buffers)
        assert torch.equal(plain, reused)
        for greedy in (False, True):
            expected = sample(plain, seeds, steps, greedy=greedy)
            got = sample(reused, seeds, steps, greedy=greedy, buffers=buffers)
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
