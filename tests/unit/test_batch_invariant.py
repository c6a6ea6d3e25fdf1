"""Batch-invariant generation (`policy.batch_invariant`, `NativeGenerationEngine(batch_invariant=True)`):
a row's tokens and logprobs are bit-identical whatever other rows are generated beside it. The
policy's side is tested with real workers in tests/functional/test_policy.py."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.loader import ConfigError, load_config
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.hf import load_causal_lm, load_tokenizer

LENGTHS = [3, 9, 5, 12, 7, 16]


@pytest.fixture(scope="module")
def model():
    return load_causal_lm("small")


def prompts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 100, (len(LENGTHS), max(LENGTHS)), generator=g)
    for row, length in enumerate(LENGTHS):
        ids[row, length:] = 0
    return ids, torch.tensor(LENGTHS)


def row(out: dict, index: int) -> tuple[list[int], torch.Tensor, int, bool]:
    end = int(out["unpadded_sequence_lengths"][index])
    return (out["output_ids"][index, :end].tolist(), out["logprobs"][index, :end],
            int(out["generation_lengths"][index]), bool(out["truncated"][index]))


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_a_rows_generation_does_not_depend_on_the_rows_beside_it(model, greedy):
    ids, lengths = prompts()
    seeds = torch.arange(len(LENGTHS)) + 100
    # Token 40 ends a row (as eos would): rows finish at different steps.
    engine = NativeGenerationEngine(model, None, pad_token_id=0, eos_token_id=40, batch_invariant=True)
    everything = engine.generate(ids, lengths, max_new_tokens=12, seeds=seeds, greedy=greedy)
    order = [3, 0, 5]
    other_ids, other_lengths = prompts(seed=1)  # different companions, padded to the same width
    mixed_ids = torch.cat([ids[order], other_ids[:2]])
    mixed_lengths = torch.cat([lengths[order], other_lengths[:2]])
    mixed = engine.generate(mixed_ids, mixed_lengths, max_new_tokens=12, seeds=torch.cat([seeds[order], seeds[:2]]),
                            greedy=greedy)
    for position, source in enumerate(order):
        tokens, logprobs, generated, truncated = row(mixed, position)
        expected = row(everything, source)
        assert tokens == expected[0] and (generated, truncated) == expected[2:], source
        assert torch.equal(logprobs, expected[1]), source  # bit for bit
    # The definition: each row is what the plain engine generates for it alone, unpadded.
    plain = NativeGenerationEngine(model, None, pad_token_id=0, eos_token_id=40)
    for source in order:
        alone = plain.generate(ids[source : source + 1, : LENGTHS[source]], lengths[source : source + 1],
                               max_new_tokens=12, seeds=seeds[source : source + 1], greedy=greedy)
        tokens, logprobs, *_ = row(alone, 0)
        assert tokens == row(everything, source)[0] and torch.equal(logprobs, row(everything, source)[1])
    assert everything["output_ids"].shape[1] == max(LENGTHS) + int(everything["generation_lengths"].max())


def test_stop_strings_and_continued_turns_hold_row_by_row():
    tiny, tokenizer = load_causal_lm("tiny"), load_tokenizer("tiny")
    texts = ["12+7=", "3*4=", "100-1="]
    encoded = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (width - len(e)) for e in encoded])
    lengths = torch.tensor([len(e) for e in encoded])
    kwargs = dict(max_new_tokens=10, seeds=torch.tensor([1, 2, 3]), stop_strings=[["5"], None, ["0", "9"]],
                  start_steps=torch.tensor([0, 1, 0]))
    engines = [NativeGenerationEngine(tiny, tokenizer, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id, batch_invariant=invariant)
               for invariant in (True, False)]
    batched = engines[0].generate(ids, lengths, **kwargs)
    for index in range(3):  # the plain engine, each row alone
        alone = engines[1].generate(ids[index : index + 1, : int(lengths[index])], lengths[index : index + 1],
                                    max_new_tokens=10, seeds=kwargs["seeds"][index : index + 1],
                                    stop_strings=[kwargs["stop_strings"][index]],
                                    start_steps=kwargs["start_steps"][index : index + 1])
        assert row(batched, index)[0] == row(alone, 0)[0] and torch.equal(row(batched, index)[1], row(alone, 0)[1])
        assert row(batched, index)[2:] == row(alone, 0)[2:]


def test_the_key_reaches_the_engine_and_vllm_is_refused():
    from posttrain.models.generation.spec import GenerationSpec

    cfg = load_config("grpo", overrides=["sft_warmup=null", "policy.batch_invariant=true"])
    assert cfg.policy.batch_invariant and GenerationSpec.from_config(cfg).batch_invariant
    assert not GenerationSpec.from_config(load_config("grpo", overrides=["sft_warmup=null"])).batch_invariant
    with pytest.raises(ConfigError, match=r"policy.batch_invariant=true is the native engine's"):
        load_config("grpo", overrides=["policy.batch_invariant=true", "policy.generation.backend=vllm"])
