"""Speculative sampling in the native engine (`speculative.py`): the multi-token decoder step equals
one-token steps, speculation emits plain decoding's tokens and logprobs (greedy and seeded sampling,
every drafter, stop tokens, stop strings, continued generations), its token distribution passes a
chi-square test against plain sampling with other seeds, its acceptance rate is p(draft) (the
standard rule for a one-hot draft), and the config, the worker's drafter and the rollout metrics."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.errors import UserError
from posttrain.models import tiny
from posttrain.models.generation.decoders import LlamaLikeDecoder, ModelForwardDecoder
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.speculative import SPECULATIVE_COUNTS, NgramDrafter, make_drafter
from posttrain.models.generation.worker import build_drafter, check_same_tokenizer
from posttrain.rollouts import add_speculative_counts, speculative_metrics
from decoder_checks import check_extend_then_rewind
from test_generation_engine import EOS, PAD, VOCAB, ListTokenizer, chain_model, right_padded

ARCHS = ["llama", "qwen2", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def policy():
    model, _ = tiny.make_tiny_model("tiny", "llama", seed=1)
    return model.eval()


@pytest.fixture(scope="module")
def other_tiny():
    model, _ = tiny.make_tiny_model("tiny", "llama", seed=2)
    return model.eval()


def engine(model, drafter=None, eos=EOS, **options) -> NativeGenerationEngine:
    return NativeGenerationEngine(model, options.pop("tokenizer", None), pad_token_id=PAD, eos_token_id=eos,
                                  speculative=drafter, **options)


def draft_engine(model, **options) -> NativeGenerationEngine:
    return NativeGenerationEngine(model, pad_token_id=PAD, eos_token_id=None, **options)


def prompts(seed: int = 3, vocab: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixed lengths, GRPO-style repeats, and one repetitive prompt that n-gram lookup drafts from."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 2, 9, 4)]
    rows += [rows[0], rows[0], rows[0][:3] * 4]
    return right_padded(rows)


def assert_same(out: dict, reference: dict) -> None:
    for key in ("output_ids", "generation_lengths", "truncated"):
        assert torch.equal(out[key], reference[key]), key
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- the multi-token step
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("decoder_class", [LlamaLikeDecoder, ModelForwardDecoder])
def test_extend_and_rewind_match_one_token_steps(arch, decoder_class):
    model, _ = tiny.make_tiny_model("tiny", arch, seed=1)
    model.eval()
    ids, lengths = right_padded([[5, 9, 13, 7, 2], [4, 8], [9, 10, 11, 12], [3, 3, 3]])
    plain = engine(model, share_prompts=False)
    g = torch.Generator().manual_seed(4)
    fed = torch.randint(2, 100, (4, 8), generator=g)
    ours = LlamaLikeDecoder(model) if decoder_class is LlamaLikeDecoder else ModelForwardDecoder(model, True)
    reference = LlamaLikeDecoder(model)
    with torch.inference_mode():
        _, start = plain._prefill(ids, lengths, ours, capacity=ids.shape[1] + 12)
        _, _ = plain._prefill(ids, lengths, reference, capacity=ids.shape[1] + 12)
        if decoder_class is LlamaLikeDecoder:  # unwritten cache columns are zeros: masked, they add nothing (0 x NaN)
            assert all(not buffer[:, :, ids.shape[1]:].any() for buffer in ours.keys + ours.values)
        expected = torch.stack([reference.step(fed[:, t], start + t) for t in range(8)], dim=1)  # [4, 8, V]
        check_extend_then_rewind(ours, fed, start, expected)


def test_extend_checks_and_self_check_cover_it(policy):
    decoder = LlamaLikeDecoder(policy)
    assert decoder.self_check() is None  # compares a two-token extend with the forward too
    with pytest.raises(ValueError, match="first layers needs LlamaLikeDecoder"):
        ModelForwardDecoder(policy, True).extend(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), num_layers=1)


# ---------------------------------------------------------------------------- plain decoding's tokens
DRAFTERS = {
    "ngram": lambda model, other: make_drafter("ngram", num_draft_tokens=4, ngram_size=3),
    "ngram-k1-n1": lambda model, other: make_drafter("ngram", num_draft_tokens=1, ngram_size=1),
    "draft-itself": lambda model, other: make_drafter("draft_model", num_draft_tokens=3, draft_engine=draft_engine(model)),
    "draft-other": lambda model, other: make_drafter("draft_model", num_draft_tokens=5, draft_engine=draft_engine(other)),
    "draft-model-forward": lambda model, other: make_drafter(
        "draft_model", num_draft_tokens=3, draft_engine=draft_engine(model, llama_like_decoder=False)),
    "early-exit": lambda model, other: make_drafter("early_exit", num_draft_tokens=3, draft_layers=1),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculation_emits_plain_decodings_tokens_and_logprobs(policy, other_tiny, name, greedy):
    ids, lengths = prompts()
    # A few frequent ids end rows at uneven lengths, through max_new_tokens too.
    options = dict(max_new_tokens=24, greedy=greedy, seeds=torch.arange(7) * 11, stop_token_ids=[17, 40, 77])
    reference = engine(policy).generate(ids, lengths, **options)
    out = engine(policy, DRAFTERS[name](policy, other_tiny)).generate(ids, lengths, **options)
    assert_same(out, reference)
    assert len(set(reference["generation_lengths"].tolist())) > 1
    drafted, accepted, forwards = (out[key] for key in SPECULATIVE_COUNTS)
    assert bool((accepted <= drafted).all()) and bool((forwards <= out["generation_lengths"]).all())
    if name == "draft-itself" and greedy:  # the policy drafting for itself: every draft is kept
        assert torch.equal(accepted, drafted) and int(forwards.sum()) < int(out["generation_lengths"].sum()) / 2


def test_model_forward_policy_decoder_and_finished_rows_dropped_at_once(policy):
    ids, lengths = prompts()
    options = dict(max_new_tokens=20, seeds=torch.arange(7), stop_token_ids=[17, 40, 77])
    reference = engine(policy).generate(ids, lengths, **options)
    for flags in (dict(llama_like_decoder=False), dict(finished_rows_fraction=0.0), dict(finished_rows_fraction=1.0)):
        drafter = make_drafter("draft_model", num_draft_tokens=3, draft_engine=draft_engine(policy, **flags))
        assert_same(engine(policy, drafter, **flags).generate(ids, lengths, **options), reference)


def test_early_exit_needs_the_llama_like_decoder_and_fewer_layers(policy):
    ids, lengths = prompts()
    with pytest.raises(ValueError, match="needs the llama-like decoder"):
        engine(policy, make_drafter("early_exit", draft_layers=1), llama_like_decoder=False).generate(
            ids, lengths, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_layers=2 must be below the model's 2 layers"):
        engine(policy, make_drafter("early_exit", draft_layers=2)).generate(ids, lengths, max_new_tokens=4)


def test_stop_strings_and_eos_end_rows_where_plain_decoding_does():
    # The chain model's text repeats, so n-gram drafts run past the stop string and past eos ("q" -> eos).
    model = chain_model()
    ids, lengths = right_padded([[2, 3, 4, 5, 2, 3], [9, 10, 11, 12, 13], [4, 5, 6, 7, 4], [14, 15, 2, 3]])
    for stops in (None, ["dxy"], [["c"], None, ["zq"], ["ab", "u"]]):
        options = dict(max_new_tokens=30, greedy=True, stop_strings=stops)
        reference = engine(model, tokenizer=ListTokenizer()).generate(ids, lengths, **options)
        for k in (1, 4, 8):
            drafter = NgramDrafter(k, max_size=2)
            out = engine(model, drafter, tokenizer=ListTokenizer()).generate(ids, lengths, **options)
            assert_same(out, reference)
            assert out["speculative_accepted_tokens"].sum() > 0
        if stops is None:
            assert not reference["truncated"][1]  # ended at eos after "q"


def test_a_generation_continued_in_chunks_equals_one_generation(policy):
    """Partial rollouts: a turn generated in two calls (the second with `start_steps`) draws the tokens
    of one uninterrupted generation, with speculation as without."""
    ids, lengths = prompts()
    seeds = torch.arange(7) + 5
    whole = engine(policy, eos=None).generate(ids, lengths, max_new_tokens=16, seeds=seeds)
    drafter = make_drafter("draft_model", num_draft_tokens=3, draft_engine=draft_engine(policy))
    speculative = engine(policy, drafter, eos=None)
    first = speculative.generate(ids, lengths, max_new_tokens=6, seeds=seeds)
    rest = speculative.generate(first["output_ids"], first["unpadded_sequence_lengths"], max_new_tokens=10, seeds=seeds,
                                start_steps=first["generation_lengths"])
    assert torch.equal(rest["output_ids"][:, : whole["output_ids"].shape[1]], whole["output_ids"])


# ---------------------------------------------------------------------------- the distribution
def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi_square(a: list, b: list) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two equal-size samples over their categories,
    categories with fewer than 10 draws in both together pooled."""
    categories = sorted(set(a) | set(b), key=str)
    counts = {c: (a.count(c), b.count(c)) for c in categories}
    rare = [c for c, (x, y) in counts.items() if x + y < 10]
    pooled = {c: v for c, v in counts.items() if c not in rare}
    if rare:
        pooled["rare"] = (sum(counts[c][0] for c in rare), sum(counts[c][1] for c in rare))
    statistic = sum((x - y) ** 2 / (x + y) for x, y in pooled.values() if x + y)
    return statistic, len(pooled) - 1


def test_speculative_sampling_has_plain_samplings_distribution_and_accepts_with_p_of_the_draft():
    """Chain model at temperature 1: the likely next token has p = e^4 / (e^4 + 15) = 0.784. The
    policy drafts for itself (greedy drafts: the likely chain), so drafts are kept and rejected
    often. Speculative draws (seeds 0..N-1) against plain draws (seeds N..2N-1): the third generated
    token, and the whole 4-token text, pass a chi-square test at p = 0.001; the acceptance rate is
    p(draft), as the standard rule says for a one-hot draft."""
    model = chain_model()
    n = 4000
    ids, lengths = right_padded([[2]] * n)
    spec = engine(model, make_drafter("draft_model", num_draft_tokens=3, draft_engine=draft_engine(model)))
    out = spec.generate(ids, lengths, max_new_tokens=4, seeds=torch.arange(n))
    plain = engine(model).generate(ids, lengths, max_new_tokens=4, seeds=torch.arange(n, 2 * n))
    texts = [[tuple(o["output_ids"][i, 1: 1 + int(o["generation_lengths"][i])].tolist()) for i in range(n)]
             for o in (out, plain)]
    third = [[t[2] if len(t) > 2 else "ended" for t in side] for side in texts]
    for a, b in (third, texts):
        statistic, df = two_sample_chi_square(a, b)
        assert df >= 5 and statistic < chi_square_critical(df), (statistic, df)
    assert out["speculative_forwards"].sum() < out["generation_lengths"].sum()
    # One draft per forward: each is kept with probability p(draft) = p_likely (every token's likely
    # successor has it). With more, later drafts count as drafted but are dropped after a rejection.
    one = engine(model, make_drafter("draft_model", num_draft_tokens=1, draft_engine=draft_engine(model)))
    out = one.generate(ids, lengths, max_new_tokens=4, seeds=torch.arange(n))
    p_likely = math.exp(4) / (math.exp(4) + len(VOCAB) - 1)
    rate = out["speculative_accepted_tokens"].sum().item() / out["speculative_draft_tokens"].sum().item()
    assert abs(rate - p_likely) < 0.02, rate


def test_chi_square_helper_rejects_a_different_distribution():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 6, (4000,), generator=g).tolist()
    b = (torch.randint(0, 6, (4000,), generator=g) * (torch.rand(4000, generator=g) > 0.1)).tolist()  # more zeros
    same = torch.randint(0, 6, (4000,), generator=g).tolist()
    assert two_sample_chi_square(a, same)[0] < chi_square_critical(5)
    assert two_sample_chi_square(a, b)[0] > chi_square_critical(5)


# ---------------------------------------------------------------------------- drafters
def test_ngram_drafter_proposes_what_followed_the_latest_occurrence():
    history = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 5, 6, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0],
                            [7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0], [3, 4, 5, 3, 4, 5, 3, 4, 0, 0, 0]])
    lengths = torch.tensor([9, 4, 4, 8])
    drafts, counts = NgramDrafter(3, max_size=2).propose(history, lengths, torch.tensor([3, 3, 3, 1]))
    # Row 0: "5 6" last seen at 4, followed by 9 5 6; row 1: no match; row 2: "7 7" last seen before
    # the suffix at 1, followed by one token of the context; row 3: "3 4" at 3 -> 5, limited to 1.
    assert counts.tolist() == [3, 0, 1, 1]
    assert drafts[0].tolist() == [9, 5, 6] and drafts[2, 0] == 7 and drafts[3, 0] == 5
    drafts, counts = NgramDrafter(2, max_size=3, min_size=3).propose(history, lengths, torch.full((4,), 2))
    assert counts.tolist() == [0, 0, 1, 2] and drafts[3].tolist() == [5, 3]  # row 3: "5 3 4" last at 2 -> 5 3
    with pytest.raises(ValueError, match="ngram_min_size"):
        NgramDrafter(2, max_size=1, min_size=2)


def test_build_drafter_from_config_and_tokenizer_check():
    config = load_config("grpo", overrides=["policy.generation.speculative.method=draft_model",
                                            "policy.generation.speculative.draft_model=tiny",
                                            "policy.generation.speculative.num_draft_tokens=2"]).policy.generation
    tokenizer = tiny.build_tokenizer()
    drafter = build_drafter(config.speculative, tokenizer, dtype=torch.float32, device=torch.device("cpu"))
    assert drafter.num_draft_tokens == 2 and drafter.draft_engine.model.config.num_hidden_layers == 2
    none = load_config("grpo").policy.generation.speculative
    assert none.method == "none" and build_drafter(none, tokenizer, dtype=torch.float32, device="cpu") is None

    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    check_same_tokenizer(Vocab({"a": 0, "b": 1}), Vocab({"a": 0, "b": 1}), "d")
    with pytest.raises(UserError, match=r"draft_model='d' has another tokenizer .*'b' is id 1 in only one"):
        check_same_tokenizer(Vocab({"a": 0, "b": 1}), Vocab({"a": 0, "c": 1}), "d")


def test_bad_speculative_config_is_one_line():
    cases = {
        "policy.generation.speculative.method=draft_model": "needs speculative.draft_model",
        "policy.generation.speculative.method=early_exit": "needs speculative.draft_layers",
        "policy.generation.speculative.ngram_min_size=4": "ngram_min_size=4 is above ngram_size=3",
        "policy.generation.speculative.method=beam": "expects one of 'none', 'ngram', 'draft_model' or 'early_exit'",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as excinfo:
            load_config("grpo", overrides=[override])
        assert "\n" not in str(excinfo.value)
    with pytest.raises(ConfigError, match="speculative.method='ngram' is for the native engine; "
                                          "policy.generation.backend='vllm' does not take it"):
        load_config("grpo", overrides=["policy.generation.backend=vllm", "policy.generation.speculative.method=ngram"])


def test_rollout_metrics_sum_the_rows_counts():
    totals: dict[str, float] = {}
    add_speculative_counts(totals, {"generation_lengths": torch.tensor([4, 1])})  # plain decoding: nothing
    assert speculative_metrics(totals) == {}
    for drafted, accepted, forwards, lengths in (([6, 0], [3, 0], [2, 1], [5, 1]), ([2, 2], [2, 1], [2, 2], [4, 3])):
        add_speculative_counts(totals, {"speculative_draft_tokens": torch.tensor(drafted),
                                        "speculative_accepted_tokens": torch.tensor(accepted),
                                        "speculative_forwards": torch.tensor(forwards),
                                        "generation_lengths": torch.tensor(lengths)})
    assert speculative_metrics(totals) == {"speculative/acceptance_rate": 6 / 10, "speculative/tokens_per_forward": 13 / 7}


def test_a_rollout_logs_acceptance_rate_and_tokens_per_forward(policy):
    """The native engine's counts reach the rollout's metrics (logged as train/speculative/...)."""
    from posttrain.distributed.batch import Batch
    from posttrain.rollouts import run_multi_turn_rollout
    from fake_generation import OneTokenGeneration
    from test_rollout_endings import NeverDone, samples

    class EngineGeneration(OneTokenGeneration):  # its prepare/finish hooks; generation by the engine
        def __init__(self, drafter):
            self.engine = NativeGenerationEngine(policy, pad_token_id=PAD, eos_token_id=EOS, speculative=drafter)

        def generate_shards(self, batch, greedy=False, params=None):
            out = self.engine.generate(batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=greedy)
            yield list(range(batch.size)), Batch(out)

    tokenizer = tiny.build_tokenizer()
    rollout = dict(max_seq_len=256, max_rollout_turns=1, greedy=True)
    plain = run_multi_turn_rollout(EngineGeneration(None), samples(tokenizer, "a", "b"), tokenizer, {"t": NeverDone()},
                                   **rollout)
    assert not any(key.startswith("speculative/") for key in plain.metrics)
    result = run_multi_turn_rollout(EngineGeneration(make_drafter("ngram", num_draft_tokens=3)),
                                    samples(tokenizer, "a", "b"), tokenizer, {"t": NeverDone()}, **rollout)
    assert 0 < result.metrics["speculative/acceptance_rate"] <= 1
    assert result.metrics["speculative/tokens_per_forward"] > 1
    assert [s.message_log[-1]["token_ids"].tolist() for s in result.samples] == \
        [s.message_log[-1]["token_ids"].tolist() for s in plain.samples]
