"""Continuous batching in the native engine (`max_running_rows`, `running_batch.py`): a call with more
rows than the decoder runs at once gives every row the tokens and logprobs it gets in one batch of
all rows, whether its place is taken at the start or after other rows finish, with the cache
compacted on the way; decoders and modes that cannot admit rows generate in pieces instead."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import tiny
from posttrain.models.generation.decoders import LlamaLikeDecoder
from posttrain.models.generation.engine import NativeGenerationEngine, shared_prefix_length
from posttrain.models.generation.running_batch import RunningBatch
from posttrain.models.generation.speculative import make_drafter

PAD, EOS = 0, 1


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def mixed_rows(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 2 to 11 tokens, each twice in a row (GRPO's generations of one prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 100, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(count // 2)]
    return [p for p in prompts for _ in range(2)]


def assert_same_generation(out: dict, reference: dict) -> None:
    for key in ("output_ids", "generation_lengths", "truncated"):
        assert torch.equal(out[key], reference[key]), key
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)


class CountingDecoder(LlamaLikeDecoder):
    """Counts the rows admitted after the start and the columns compaction moved."""

    def __init__(self, model):
        super().__init__(model)
        self.admitted, self.shifted = 0, 0

    def admit(self, prefill_cache, prompt_mask, row_map):
        self.admitted += row_map.numel()
        super().admit(prefill_cache, prompt_mask, row_map)

    def keep_rows(self, keep, shift=0):
        self.shifted += shift
        super().keep_rows(keep, shift)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request):
    return tiny.make_tiny_model("tiny", request.param, seed=1)[0].eval()


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("running", [1, 3, 7])
def test_rows_admitted_as_others_finish_generate_what_one_batch_does(model, running, greedy, fraction):
    ids, lengths = right_padded(mixed_rows(14, seed=running))
    kwargs = dict(max_new_tokens=16, temperature=1.0, greedy=greedy, seeds=torch.arange(14) + 7)
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS, finished_rows_fraction=fraction)
    if greedy:  # stop at tokens some rows make at different steps
        free = engine.generate(ids, lengths, **kwargs)["output_ids"]
        kwargs["stop_token_ids"] = sorted({int(free[row, lengths[row] + 2 + row % 9]) for row in (0, 5, 9)})
    else:
        kwargs["stop_token_ids"] = list(range(20, 36))
    reference = engine.generate(ids, lengths, **kwargs)
    # Rows finish at several steps (greedy, a tiny random model repeats itself: at the first or the last).
    assert len(set(reference["generation_lengths"].tolist())) > (1 if greedy else 2)
    counting = CountingDecoder(model)
    engine._llama_like, engine._llama_like_checked = counting, True
    out = engine.generate(ids, lengths, max_running_rows=running, **kwargs)
    assert_same_generation(out, reference)
    assert counting.admitted == 14 - running  # every row after the first batch joined a running batch
    assert counting.shifted > 0  # rows admitted late: the cache was compacted


@pytest.mark.parametrize("margin", [0, 2])
def test_a_full_cache_is_compacted_while_rows_generate(margin, monkeypatch):
    """The longest prompt starts at column 0 and runs to its budget, while rows that stop at once make
    room for rows that run long too: when it ends, the cache is full (prompt + max_new_tokens + `margin`
    columns; with margin 0) with rows still generating beside it, so compaction drops it and moves them left, and
    decoding goes on to the tokens of one batch."""
    model = tiny.make_tiny_model("tiny", "llama", seed=1)[0].eval()
    monkeypatch.setattr(NativeGenerationEngine, "compaction_margin", margin)
    g = torch.Generator().manual_seed(11)
    # Admitted longest first: row 0 (16 tokens) with rows 1-3 (10 tokens), then rows 4-9 (3 tokens).
    ids, lengths = right_padded([torch.randint(2, 100, (n,), generator=g).tolist() for n in [16] + [10] * 3 + [3] * 6])
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=None, finished_rows_fraction=0.5)
    kwargs = dict(max_new_tokens=12, greedy=True)
    free = engine.generate(ids, lengths, **kwargs)["output_ids"]
    # Rows 1-3 stop at their first token; row 0 and rows 4-9 run to the budget.
    running_long = {token for row in [0, *range(4, 10)] for token in free[row, lengths[row]:].tolist()}
    kwargs["stop_token_ids"] = sorted({int(free[row, lengths[row]]) for row in range(1, 4)} - running_long)
    reference = engine.generate(ids, lengths, **kwargs)
    assert reference["generation_lengths"].tolist() == [12, 1, 1, 1] + [12] * 6
    counting = CountingDecoder(model)
    engine._llama_like, engine._llama_like_checked = counting, True
    full = []
    original_keep = counting.keep_rows
    monkeypatch.setattr(counting, "keep_rows", lambda keep, shift=0: (
        full.append(counting.length >= counting.keys[0].shape[2]), original_keep(keep, shift)))
    out = engine.generate(ids, lengths, max_running_rows=4, **kwargs)
    assert_same_generation(out, reference)
    if margin == 0:  # compacted because the cache was full, not because enough rows finished
        assert any(full)


def test_stop_strings_with_continuous_batching():
    model, tokenizer = tiny.make_tiny_model("tiny", "llama", seed=1)
    ids, lengths = right_padded(mixed_rows(8, seed=3))
    stops = [["e"], ["a", "o"], None, ["i"], ["e"], None, ["u"], ["t"]]
    kwargs = dict(max_new_tokens=16, temperature=1.0, seeds=torch.arange(8), stop_strings=stops)
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=PAD, eos_token_id=EOS)
    out = engine.generate(ids, lengths, max_running_rows=3, **kwargs)
    assert_same_generation(out, engine.generate(ids, lengths, **kwargs))
    assert not out["truncated"].all()


@pytest.mark.parametrize("mode", ["model-forward", "speculative"])
def test_engines_that_cannot_admit_rows_generate_in_pieces(mode):
    model, _ = tiny.make_tiny_model("tiny", "qwen2", seed=1)
    model.eval()
    options = dict(llama_like_decoder=False) if mode == "model-forward" else dict(
        speculative=make_drafter("ngram", num_draft_tokens=3))
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS, **options)
    ids, lengths = right_padded(mixed_rows(10, seed=4))
    kwargs = dict(max_new_tokens=10, temperature=1.0, seeds=torch.arange(10), stop_token_ids=list(range(20, 30)))
    out = engine.generate(ids, lengths, max_running_rows=4, **kwargs)
    assert_same_generation(out, engine.generate(ids, lengths, **kwargs))


def test_admit_refuses_prompts_that_do_not_fit():
    model = tiny.make_tiny_model("tiny", "llama", seed=1)[0].eval()
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    decoder = LlamaLikeDecoder(model)
    with torch.inference_mode():
        engine._prefill(*right_padded([[5, 6, 7]]), decoder, capacity=10)
        with pytest.raises(ValueError, match="cannot admit 1 rows of 5 positions"):
            engine._prefill(*right_padded([[5, 6, 7, 8, 9]]), decoder, capacity=10, admit=True)
        with pytest.raises(ValueError, match="shift 2 would drop"):
            decoder.keep_rows(torch.tensor([0]), shift=2)
    with pytest.raises(ValueError, match="max_running_rows"):
        engine.generate(*right_padded([[5, 6]]), max_new_tokens=2, max_running_rows=0)


def test_running_batch_bookkeeping():
    running = RunningBatch.empty(torch.tensor([3, 0, 1, 2, 4]), max_running_rows=2)
    first = running.take_waiting()
    assert first.tolist() == [3, 0] and running.waiting.tolist() == [1, 2, 4]
    running.add(first, torch.tensor([4, 6]))
    assert running.live() is None
    fed = running.advance(None, torch.tensor([11, 12]), torch.tensor([False, True]), pad_token_id=PAD)
    assert fed.tolist() == [11, 12] and running.num_finished == 1 and running.live().tolist() == [0]
    fed = running.advance(running.live(), torch.tensor([13]), torch.tensor([False]), pad_token_id=PAD)
    assert fed.tolist() == [13, PAD] and running.steps.tolist() == [2, 1]
    running.keep(torch.tensor([0]))
    assert running.size == 1 and running.num_finished == 0 and running.take_waiting().tolist() == [1]
    assert not running.done


@pytest.mark.parametrize("llama_like", [True, False], ids=["llama-like", "model-forward"])
@pytest.mark.parametrize("running", [None, 3], ids=["one-batch", "continuous"])
def test_a_shared_prompt_prefix_prefilled_once_gives_the_same_generation(model, llama_like, running, monkeypatch):
    """Prompts that start alike (a system prompt): the prefix prefilled for one row and copied, the rest
    after it with the padding in the middle, generate what a plain prefill does."""
    monkeypatch.setattr(NativeGenerationEngine, "min_shared_prefix_tokens", 1)
    prefix = list(range(40, 52))
    rows = [prefix + tail for tail in mixed_rows(10, seed=8)]
    ids, lengths = right_padded(rows)
    assert shared_prefix_length(ids, lengths) == len(prefix)
    kwargs = dict(max_new_tokens=12, temperature=1.0, seeds=torch.arange(10), stop_token_ids=list(range(20, 36)),
                  max_running_rows=running)
    make = lambda share: NativeGenerationEngine(  # noqa: E731
        model, None, pad_token_id=PAD, eos_token_id=EOS, llama_like_decoder=llama_like, share_prompt_prefix=share)
    assert_same_generation(make(True).generate(ids, lengths, **kwargs), make(False).generate(ids, lengths, **kwargs))


def test_shared_prefix_length_leaves_every_prompt_its_last_token():
    ids, lengths = right_padded([[5, 6, 7, 8], [5, 6, 7], [5, 6, 9, 9, 9]])
    assert shared_prefix_length(ids, lengths) == 2
    assert shared_prefix_length(*right_padded([[5, 6, 7], [5, 6, 7]])) == 2  # not the whole prompt
    assert shared_prefix_length(*right_padded([[5, 6, 7]])) == 0  # one prompt: nothing to share
    assert shared_prefix_length(*right_padded([[5, 6], [4, 6]])) == 0


def test_continued_turns_keep_their_random_streams_when_admitted_late(model):
    """Partial rollouts continue a turn with `start_steps` (tokens of it already generated): rows admitted
    after others finish draw from their streams at the same counters as in one batch."""
    ids, lengths = right_padded(mixed_rows(12, seed=5))
    kwargs = dict(max_new_tokens=10, temperature=1.0, seeds=torch.arange(12) + 3, stop_token_ids=list(range(20, 32)),
                  start_steps=torch.minimum(torch.arange(12) % 4, lengths - 1))
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    reference = engine.generate(ids, lengths, **kwargs)
    assert_same_generation(engine.generate(ids, lengths, max_running_rows=3, **kwargs), reference)
    without = engine.generate(ids, lengths, **{**kwargs, "start_steps": None})
    assert not torch.equal(without["output_ids"], reference["output_ids"])  # the counters matter
