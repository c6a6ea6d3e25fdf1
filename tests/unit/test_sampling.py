import math

import pytest
import torch

from posttrain.models.generation.sampling import counter_uniform, process_logits, sample

NEG_INF = float("-inf")


def test_process_logits_is_log_softmax_of_filtered_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # temperature 2 -> [1, .5, 0, -.5]; top_k=3 drops the last token.
    got = process_logits(logits, temperature=2.0, top_k=3)
    kept = torch.tensor([1.0, 0.5, 0.0])
    log_z = math.log(sum(math.exp(v) for v in kept.tolist()))
    expected = torch.tensor([[1.0 - log_z, 0.5 - log_z, 0.0 - log_z, NEG_INF]])
    torch.testing.assert_close(got, expected)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    kept = torch.isfinite(process_logits(logits, top_k=2))
    assert kept.tolist() == [[False, True, False, True, False], [True, True, False, False, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # Sorted: .5, .3, .15, .05. Mass before: 0, .5, .8, .95.
    assert torch.isfinite(process_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(process_logits(logits, top_p=0.6)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(process_logits(logits, top_p=0.9)).tolist() == [[True, False, True, True]]
    # The kept tokens are renormalised: .5 / .8 and .3 / .8.
    got = process_logits(logits, top_p=0.6).exp()
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.0, 0.375, 0.0]]))


def test_top_k_then_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top_k=3 renormalises to .444, .333, .222; top_p=.7 then keeps the first two (mass .444 < .7).
    kept = torch.isfinite(process_logits(probs.log(), top_k=3, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]


def test_process_logits_works_on_3d_and_rejects_bad_options():
    logits = torch.randn(2, 3, 7)
    torch.testing.assert_close(process_logits(logits), torch.log_softmax(logits, dim=-1))
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits, top_p=1.5)


def test_greedy_is_argmax_and_returns_its_logprob():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]]), dim=-1)
    ids, lps = sample(logprobs, greedy=True)
    assert ids.tolist() == [1, 0]
    torch.testing.assert_close(lps, logprobs[[0, 1], [1, 0]])


def test_sampling_never_picks_filtered_tokens():
    logprobs = process_logits(torch.randn(64, 50), top_k=3)
    seeds = torch.arange(64)
    for step in range(5):
        ids, lps = sample(logprobs, seeds, torch.full((64,), step))
        assert torch.isfinite(lps).all()


def test_sample_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logprobs = probs.log().expand(n, -1)
    ids, _ = sample(logprobs, torch.arange(n) * 7919, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(ids, minlength=4).float() / n
    # Standard error is at most sqrt(.25 / 20000) = .0035; allow ~4 sigma.
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_counter_uniform_is_deterministic_and_in_range():
    seeds = torch.tensor([0, 1, -5, 2**62, 123456789])
    steps = torch.tensor([0, 0, 3, 7, 1])
    u1, u2 = counter_uniform(seeds, steps), counter_uniform(seeds, steps)
    assert torch.equal(u1, u2)
    assert ((u1 >= 0) & (u1 < 1)).all()
    assert len(set(u1.tolist())) == 5
    # Changing the step changes the draw.
    assert not torch.equal(u1, counter_uniform(seeds, steps + 1))
    many = counter_uniform(torch.arange(10000), torch.zeros(10000, dtype=torch.long))
    assert abs(many.mean().item() - 0.5) < 0.02


def test_fixed_seed_is_independent_of_batch_composition():
    torch.manual_seed(0)
    row = torch.log_softmax(torch.randn(1, 100), dim=-1)
    others = torch.log_softmax(torch.randn(7, 100), dim=-1)
    alone, _ = sample(row, torch.tensor([42]), torch.tensor([3]))
    batch = torch.cat([others[:4], row, others[4:]])
    seeds = torch.tensor([1, 2, 3, 4, 42, 5, 6, 7])
    together, _ = sample(batch, seeds, torch.full((8,), 3))
    assert together[4] == alone[0]
    # Different seeds give different samples on a flat distribution.
    flat = torch.zeros(32, 1000)
    ids, _ = sample(flat, torch.arange(32), torch.zeros(32, dtype=torch.long))
    assert len(set(ids.tolist())) > 20
