"""Gemma 3 in the native engine's fast decode path (`gemma3_decoder.Gemma3Decoder`), on a tiny Gemma 3
whose window cuts early: 3 layers (two sliding ones of a 4-column window, then a global one), GQA,
QK-norm, random norm weights (so that each of the four norms per layer counts). Its decode steps,
`extend` / `rewind` and bfloat16 steps give the model's forward logits past the window, with rows of
different prompt lengths; the engine's output equals the model-forward decoder's, also with
continuous batching and speculative decoding; what it does not reproduce is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models import tiny
from posttrain.models.generation import decoders
from posttrain.models.generation.decoders import LlamaLikeDecoder, ModelForwardDecoder, unsupported_reason
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.gemma3_decoder import Gemma3Decoder, fast_decoder
from posttrain.models.generation.speculative import make_drafter

from decoder_checks import check_extend_then_rewind, steps_beside_the_forward

PAD, EOS = 0, 3
WINDOW = 4
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def gemma(softcap=None, seed: int = 1):
    """The tiny Gemma 3 preset's config with 3 layers, a window of `WINDOW` and `final_logit_softcapping`."""
    config = tiny.tiny_config("tiny", "gemma3")
    config.num_hidden_layers, config.layer_types, config.sliding_window = len(LAYER_TYPES), LAYER_TYPES, WINDOW
    config.final_logit_softcapping = softcap
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:  # Gemma's norms scale by 1 + weight, and weight starts at 0
                    parameter.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return gemma()


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def random_rows(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 100, (n,), generator=g).tolist() for n in lengths]


def engine_for(model, **options) -> NativeGenerationEngine:
    return NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS, **options)


def assert_same_generation(out: dict, reference: dict) -> None:
    for key in ("output_ids", "generation_lengths", "truncated"):
        assert torch.equal(out[key], reference[key]), key
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- support
def test_gemma3_gets_its_decoder_and_what_it_cannot_reproduce_is_refused_in_one_line(model):
    assert unsupported_reason(model) is None
    decoder = fast_decoder(model)
    assert type(decoder) is Gemma3Decoder and decoder.windows == [WINDOW, WINDOW, None]
    assert decoder.self_check() is None  # a step and an extend, the windows cut (to 3 columns)
    assert model.config.sliding_window == WINDOW and model.model.layers[0].self_attn.sliding_window == WINDOW  # restored
    assert type(engine_for(model)._decoder()) is Gemma3Decoder
    with pytest.raises(ValueError, match=r"LlamaLikeDecoder does not reproduce decoder layers \['Gemma3DecoderLayer'\]"):
        LlamaLikeDecoder(model)
    for key, value, reason in (("attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0 (not reproduced)"),
                               ("use_bidirectional_attention", True, "use_bidirectional_attention")):
        other = gemma()
        setattr(other.config, key, value)
        assert reason in unsupported_reason(other)
        assert type(engine_for(other)._decoder()) is ModelForwardDecoder


def test_the_self_check_catches_windows_and_rotary_bases_on_the_wrong_layers(model):
    wrong_windows = Gemma3Decoder(model)
    wrong_windows.windows = [None, WINDOW, WINDOW]
    assert "differs from the model's forward" in wrong_windows.self_check()
    wrong_rotary = Gemma3Decoder(model)
    wrong_rotary.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    assert "differs from the model's forward" in wrong_rotary.self_check()


# ---------------------------------------------------------------------------- decode steps
def steps_against_the_forward(model, steps: int):
    """The Gemma 3 decoder's and the model-forward decoder's logits over `steps` decode steps of 4 prompts of
    6, 2, 11 and 3 tokens (left-padded), rows 1 and 3 dropped after step 3: `[(decoder, ours, theirs)]`."""
    ids, lengths = right_padded(random_rows((6, 2, 11, 3), seed=4))
    engine = engine_for(model, share_prompts=False)
    ours, theirs = Gemma3Decoder(model), ModelForwardDecoder(model, supports_logits_to_keep=True)
    tokens = torch.randint(7, 100, (steps, 4), generator=torch.Generator().manual_seed(5))
    return steps_beside_the_forward(engine, ours, theirs, ids, lengths, tokens, drop_rows_at=3)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-softcap", "final-softcap"])
def test_decode_steps_equal_the_forward_past_the_window(softcap):
    """Up to 11 + 14 positions per row against a 4-column window; float32 rounding apart (the decoder
    attends over the window's columns, the forward over all of them, masked)."""
    steps = steps_against_the_forward(gemma(softcap), steps=14)
    assert steps[-1][0].length > 5 * WINDOW
    for _, ours, theirs in steps:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    if softcap is not None:
        assert steps[-1][2].abs().max() < softcap


def test_bfloat16_steps_attend_over_the_window_with_two_matmuls_within_rounding():
    for decoder, ours, theirs in steps_against_the_forward(gemma().to(torch.bfloat16), steps=10):
        assert decoder.cpu_16bit
        ours, theirs = ours.float(), theirs.float()
        assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_grouped_decode_attention_from_a_window_start_is_sdpa_over_those_columns():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 1, 8, generator=g)
    keys, values = torch.randn(3, 2, 12, 8, generator=g), torch.randn(3, 2, 12, 8, generator=g)
    bias = torch.zeros(3, 1, 1, 12)
    bias[1, ..., :5] = float("-inf")  # row 1's padding reaches into the window
    ours = decoders.grouped_decode_attention(q, keys, values, 9, bias, 0.3, start=4)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, keys[:, :, 4:9], values[:, :, 4:9], attn_mask=bias[..., 4:9], scale=0.3, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_extend_and_rewind_equal_one_forward_over_each_whole_sequence(model):
    """Speculative sampling's multi-token steps: 4 tokens per row, rows keep 1, 4, 2, 3 of them, then each
    row's next 4; the logits are those of one forward over prompt + kept tokens (no cache)."""
    rows = random_rows((5, 2, 9, 4), seed=6)
    ids, lengths = right_padded(rows)
    fed = torch.randint(7, 100, (4, 8), generator=torch.Generator().manual_seed(7))
    decoder = Gemma3Decoder(model)
    with torch.inference_mode():
        _, start = engine_for(model, share_prompts=False)._prefill(ids, lengths, decoder, capacity=ids.shape[1] + 12)
        whole, whole_lengths = right_padded([row + fed[r].tolist() for r, row in enumerate(rows)])
        valid = (torch.arange(whole.shape[1]) < whole_lengths.unsqueeze(1)).long()
        reference = model(input_ids=whole, attention_mask=valid).logits  # [4, S + 8, V]
        at = lengths.unsqueeze(1) + torch.arange(8)  # the fed tokens' columns in `whole`
        expected = reference.gather(1, at.unsqueeze(2).expand(-1, -1, reference.shape[2]))
        check_extend_then_rewind(decoder, fed, start, expected)
    assert int(decoder.fill.max()) > 3 * WINDOW


# ---------------------------------------------------------------------------- the engine
def grpo_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 prompts of 7, 2, 10 and 4 tokens, each twice in a row."""
    return right_padded([row for row in random_rows((7, 2, 10, 4), seed=8) for _ in range(2)])


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_the_engine_generates_what_it_does_with_the_models_forward(model, greedy):
    ids, lengths = grpo_batch()
    kwargs = dict(max_new_tokens=4 * WINDOW, temperature=0.9, greedy=greedy, seeds=torch.arange(8) + 3,
                  stop_token_ids=[] if greedy else list(range(20, 30)))
    reference = engine_for(model, llama_like_decoder=False).generate(ids, lengths, **kwargs)
    engine = engine_for(model)
    out = engine.generate(ids, lengths, **kwargs)
    assert type(engine._decoder()) is Gemma3Decoder
    assert_same_generation(out, reference)
    assert int(out["generation_lengths"].max()) == 4 * WINDOW
    if not greedy:
        assert len(set(out["generation_lengths"].tolist())) > 1  # rows finished and left the batch


class CountingDecoder(Gemma3Decoder):
    """Counts the rows admitted after the start (continuous batching)."""

    admitted = 0

    def admit(self, prefill_cache, prompt_mask, row_map):
        self.admitted += row_map.numel()
        super().admit(prefill_cache, prompt_mask, row_map)


@pytest.mark.parametrize("mode", ["continuous", "ngram", "early-exit", "draft-itself"])
def test_continuous_batching_and_speculative_decoding_generate_plain_decodings_output(model, mode):
    ids, lengths = grpo_batch()
    kwargs = dict(max_new_tokens=3 * WINDOW, temperature=1.0, seeds=torch.arange(8) * 7,
                  stop_token_ids=list(range(20, 30)))
    reference = engine_for(model).generate(ids, lengths, **kwargs)
    if mode == "continuous":
        engine = engine_for(model)
        engine._llama_like, engine._llama_like_checked = CountingDecoder(model), True
        out = engine.generate(ids, lengths, max_running_rows=3, **kwargs)
        assert engine._llama_like.admitted == 5  # every row after the first 3 took a finished row's place
    else:
        drafter = {"ngram": lambda: make_drafter("ngram", num_draft_tokens=3, ngram_size=2),
                   "early-exit": lambda: make_drafter("early_exit", num_draft_tokens=2, draft_layers=1),
                   "draft-itself": lambda: make_drafter("draft_model", num_draft_tokens=3,
                                                        draft_engine=NativeGenerationEngine(
                                                            model, pad_token_id=PAD, eos_token_id=None))}[mode]()
        out = engine_for(model, speculative=drafter).generate(ids, lengths, **kwargs)
        assert int(out["speculative_draft_tokens"].sum()) > 0
    assert_same_generation(out, reference)
