"""Partial rollouts (`grpo.partial_rollouts`, posttrain/algorithms/partial_rollouts.py): a
sequence generated in chunks, paused and continued (after a checkpoint round trip too) draws the
tokens and logprobs of one uninterrupted generation; a multi-turn episode paused inside a later
turn continues as one uninterrupted rollout would (same turns, observations, masks, rewards); each
token keeps the version and logprob that produced it and the loss weights each token by its own;
too-old groups are dropped and counted; the config refuses what cannot be exact, and multi-turn
runs refuse environments that keep episode state in their own memory."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.utils.metrics import valid_counts
from posttrain.algorithms.partial_rollouts import (PartialRollouts, SequenceProgress, environment_problem,
                                                   generate_in_chunks)
from posttrain.config.loader import load_config
from posttrain.data.message_log import append_message, flatten_message_logs
from posttrain.data.processors import build_prompt_message_log
from posttrain.data.sample import SampleStatus
from posttrain.distributed.batch import Batch
from posttrain.environments.interface import Environment, EnvironmentReturn
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts import run_multi_turn_rollout

from test_generation_engine import ListTokenizer, chain_model, random_llama

STOP_IDS = list(range(10, 20))  # about a tenth of the vocabulary ends a row: lengths vary


class EngineGeneration:
    """The native engine behind the `generate(batch, greedy, params)` interface, as a generation
    worker calls it (seeds, start_steps, stop strings from the batch)."""

    def __init__(self, engine, stop_token_ids=STOP_IDS, temperature=1.0, max_new_tokens=16):
        self.engine, self.stop_token_ids, self.temperature = engine, stop_token_ids, temperature
        self.max_new_tokens, self.calls = max_new_tokens, 0

    def generate(self, batch, greedy=False, params=None):
        self.calls += 1
        out = self.engine.generate(
            batch["input_ids"], batch["input_lengths"], max_new_tokens=params["max_new_tokens"],
            temperature=self.temperature, stop_token_ids=self.stop_token_ids, stop_strings=batch.get("stop_strings"),
            seeds=batch["seeds"], start_steps=batch.get("start_steps"),
        )
        return Batch(out)

    def generate_shards(self, batch, greedy=False, params=None):
        """The ordinary rollout's call: whole turns of `max_new_tokens`."""
        yield list(range(batch.size)), self.generate(batch, greedy, {"max_new_tokens": self.max_new_tokens, **(params or {})})

    def prepare_for_generation(self):
        return True

    def finish_generation(self):
        return True


def engine_and_tokenizer():
    tokenizer = build_tokenizer()
    model = random_llama(vocab_size=len(tokenizer), seed=3)
    return NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, eos_token_id=None), tokenizer


def prompts(tokenizer, n: int, task: str = "t"):
    return [build_prompt_message_log({"prompt": f"go {i}", "task_name": task}, tokenizer, 256, idx=i)
            for i in range(n)]


def groups_of(tokenizer, n_groups: int, group_size: int, seed: int = 100):
    return [[SequenceProgress(p.fresh_copy(), seed + g * group_size + j) for j in range(group_size)]
            for g, p in enumerate(prompts(tokenizer, n_groups))]


def uninterrupted(engine, p: SequenceProgress, max_new_tokens: int):
    """One generation of the whole turn: (tokens, logprobs)."""
    ids = p.prompt_ids()
    out = engine.generate(ids[None], torch.tensor([len(ids)]), max_new_tokens=max_new_tokens,
                          stop_token_ids=STOP_IDS, seeds=torch.tensor([p.seed]))
    n = int(out["generation_lengths"][0])
    return out["output_ids"][0, len(ids) : len(ids) + n], out["logprobs"][0, len(ids) : len(ids) + n]


def round_trip(partial: PartialRollouts) -> PartialRollouts:
    buffer = io.BytesIO()
    torch.save(partial.state_dict(), buffer)
    buffer.seek(0)
    restored = PartialRollouts(partial.cfg)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    return restored


# ---------------------------------------------------------------------------------- exactness
def test_paused_and_continued_sequences_equal_one_uninterrupted_generation():
    engine, tokenizer = engine_and_tokenizer()
    generation = EngineGeneration(engine)
    groups = groups_of(tokenizer, 6, 2)
    fraction, chunks = generate_in_chunks(generation, groups, version=0, max_new_tokens=16, chunk_tokens=5,
                                          min_complete_fraction=0.25, pad_token_id=tokenizer.pad_token_id)
    paused = [p for g in groups for p in g if p.sample.status is SampleStatus.PAUSED]
    assert paused and fraction >= 0.25 and fraction < 1.0  # stopped early, with sequences mid-generation
    assert all(0 < len(p.token_ids) < 16 and not p.done for p in paused)

    # Carried over through a checkpoint, then continued (same weights) to the end in other chunks.
    partial = PartialRollouts(SimpleNamespace())
    partial.carried = groups
    groups = round_trip(partial).carried
    fraction, _ = generate_in_chunks(generation, groups, version=1, max_new_tokens=16, chunk_tokens=3,
                                     min_complete_fraction=1.0, pad_token_id=tokenizer.pad_token_id)
    assert fraction == 1.0
    lengths = set()
    for p in (p for g in groups for p in g):
        tokens, logprobs = uninterrupted(engine, p, 16)
        assert p.token_ids.tolist() == tokens.tolist()
        torch.testing.assert_close(p.logprobs, logprobs, atol=1e-5, rtol=0)
        assert len(p.weight_versions) == len(p.token_ids) and set(p.weight_versions.tolist()) <= {0, 1}
        assert p.stopped == (len(tokens) < 16 or int(tokens[-1]) in STOP_IDS)
        lengths.add(len(tokens))
    assert len(lengths) > 1  # the case the chunks exist for: sequences of different lengths


def test_a_stop_string_across_a_chunk_boundary_ends_the_sequence():
    """Chain model: "a" -> b c d xy ...; the stop string "cd" ends the turn after "d" whether or
    not a chunk ends between "c" and "d"."""
    engine = NativeGenerationEngine(chain_model(), ListTokenizer(), pad_token_id=0, eos_token_id=1)
    generation = EngineGeneration(engine, stop_token_ids=[], temperature=0.05)
    whole = engine.generate(torch.tensor([[2]]), torch.tensor([1]), max_new_tokens=8, temperature=0.05,
                            stop_strings=["cd"], seeds=torch.tensor([7]))
    assert whole["output_ids"][0, 1:].tolist() == [3, 4, 5] and not bool(whole["truncated"][0])
    sample = SimpleNamespace(message_log=[{"token_ids": torch.tensor([2])}], stop_strings=["cd"], status=None)
    p = SequenceProgress(sample, 7)
    generate_in_chunks(generation, [[p]], version=0, max_new_tokens=8, chunk_tokens=2, min_complete_fraction=1.0,
                       pad_token_id=0)
    assert p.token_ids.tolist() == [3, 4, 5] and p.stopped and generation.calls == 2


# -------------------------------------------------------------------------------------- loss
def test_the_loss_weights_each_token_by_its_own_generation_logprob():
    """A message whose tokens come from two weight versions: the flattened batch keeps each
    token's generation logprob and the importance weights are exp(logp - logp_gen) per token."""
    log = append_message([], "user", "q", [5, 6])
    gen = torch.tensor([-1.0, -2.0, -0.5, -3.0])  # tokens 0-1 from version 0, 2-3 from version 1
    append_message(log, "assistant", "abcd", [7, 8, 9, 10], generation_logprobs=gen, weight_version=0)
    log[-1]["weight_versions"] = torch.tensor([0, 0, 1, 1])
    batch = flatten_message_logs([log], pad_token_id=0)
    assert batch["generation_logprobs"][0, 2:6].tolist() == gen.tolist()
    batch["sample_mask"] = torch.ones(1)
    batch["advantages"] = torch.full((1, 6), 2.0)
    delta = torch.tensor([0.1, -0.2, 0.3, 0.0])  # current minus generating logprob, per token
    logprobs = batch["generation_logprobs"].clone()
    logprobs[0, 2:6] += delta
    logprobs.requires_grad_(True)
    seqs, toks = valid_counts(batch)
    loss, metrics = ClippedPGLoss(use_importance_sampling_correction=True, token_level_loss=True)(
        logprobs, batch, seqs, toks)
    # One optimizer step: ratio 1, so each token's loss is -A x its importance weight exp(delta).
    assert loss.item() == pytest.approx(-2.0 * delta.exp().mean().item(), rel=1e-6)
    assert metrics["sampling_importance_ratio"] == pytest.approx(delta.exp().mean().item(), rel=1e-6)
    assert metrics["token_mult_prob_error"] == pytest.approx(delta.abs().exp().mean().item(), rel=1e-6)


# ------------------------------------------------------------------------- the step's rollout
class LengthEnv(Environment):
    """Reward: the answer's length in characters, so groups have signal; one step ends it."""

    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, list(metadata), [None] * n,
                                 torch.tensor([float(len(log[-1]["content"])) for log in message_logs]),
                                 torch.ones(n, dtype=torch.bool), [None] * n)


def grpo_cfg(*extra: str):
    return load_config("grpo", overrides=[
        "sft_warmup=null", "policy.model_name=tiny", "grpo.num_prompts_per_step=6", "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=12", "policy.generation.max_new_tokens=16",
        "loss_fn.use_importance_sampling_correction=true", "grpo.partial_rollouts.enabled=true",
        "grpo.partial_rollouts.chunk_tokens=4", "grpo.partial_rollouts.min_complete_fraction=0.5", *extra,
    ])


def test_a_step_trains_complete_groups_carries_the_rest_and_drops_too_old_ones():
    engine, tokenizer = engine_and_tokenizer()
    ctx = SimpleNamespace(cfg=grpo_cfg(), step=0, generation=EngineGeneration(engine), tokenizer=tokenizer,
                          envs={"t": LengthEnv()})
    partial = PartialRollouts(ctx.cfg)
    timer = SimpleNamespace(add=lambda *a: None)

    trained, m0 = partial.roll_out(ctx, prompts(tokenizer, 6), seed_key=1, timer=timer)
    assert m0["partial_rollouts/complete_fraction_at_stop"] >= 0.5 and len(trained) >= 2
    assert m0["partial_rollouts/carried_over_groups"] == len(partial.carried) > 0
    assert m0["partial_rollouts/carried_over_sequences"] == sum(
        p.sample.status is SampleStatus.PAUSED for g in partial.carried for p in g) > 0
    for group in trained:
        for s in group.samples:
            message = s.message_log[-1] if "generation_logprobs" in s.message_log[-1] else s.message_log[1]
            assert message["weight_versions"].tolist() == [0] * len(message["token_ids"])
            assert len(message["generation_logprobs"]) == len(message["token_ids"])

    ctx.step = 1  # the next step, under new weights (here the same model: versions still tell them apart)
    carried_ids = {id(g[0].sample) for g in partial.carried}
    trained, m1 = partial.roll_out(ctx, prompts(tokenizer, 6), seed_key=2, timer=timer)
    assert m1["partial_rollouts/resumed_sequences"] == m0["partial_rollouts/carried_over_sequences"]
    assert m1["partial_rollouts/mixed_version_sequences"] > 0
    mixed = [s for g in trained for s in g.samples
             if len(set(next(m for m in s.message_log if "weight_versions" in m)["weight_versions"].tolist())) == 2]
    assert len(mixed) == m1["partial_rollouts/mixed_version_sequences"]
    assert all(g.weight_version == 0 for g in trained if id(g.samples[0]) in carried_ids)

    # Carried groups whose oldest token is more than max_age_steps (1) versions old are dropped.
    ctx.step = 3
    old = [g for g in partial.carried if min(p.oldest_version for p in g if p.oldest_version is not None) < 2]
    assert old
    _, m3 = partial.roll_out(ctx, prompts(tokenizer, 6), seed_key=3, timer=timer)
    assert m3["partial_rollouts/dropped_too_old_groups"] == len(old)
    assert m3["partial_rollouts/dropped_too_old_sequences"] == sum(len(g) for g in old)


def test_the_carry_over_survives_a_checkpoint_round_trip():
    engine, tokenizer = engine_and_tokenizer()
    cfg = grpo_cfg()
    timer = SimpleNamespace(add=lambda *a: None)
    runs = []
    for restore in (False, True):
        ctx = SimpleNamespace(cfg=cfg, step=0, generation=EngineGeneration(engine), tokenizer=tokenizer,
                              envs={"t": LengthEnv()})
        partial = PartialRollouts(cfg)
        partial.roll_out(ctx, prompts(tokenizer, 6), seed_key=1, timer=timer)
        if restore:
            partial = round_trip(partial)
        ctx.step = 1
        trained, metrics = partial.roll_out(ctx, prompts(tokenizer, 6), seed_key=2, timer=timer)
        runs.append(([[s.message_log[1]["token_ids"].tolist() for s in g.samples] for g in trained],
                     [[s.reward for s in g.samples] for g in trained], metrics))
    assert runs[0] == runs[1]
    assert runs[0][2]["partial_rollouts/resumed_sequences"] > 0


# ------------------------------------------------------------------------------- multi-turn
class CountingEnv(Environment):
    """Multi-turn, its state in the sample's metadata: after each assistant turn an observation
    (never trained on) and the episode goes on, until the `turns`-th turn (metadata `seen` counts
    them) ends it, rewarded with the length of each answer. It checks that the conversation it
    is given agrees with the metadata, so a carry-over that lost either would fail here."""

    OBSERVATION = "<|user|>more<|end|><|assistant|>"

    def __init__(self, turns: int = 3):
        self.turns = turns

    def step(self, message_logs, metadata):
        seen = [int(meta.get("seen", 0)) + 1 for meta in metadata]
        for log, n in zip(message_logs, seen):
            assert sum(m["role"] == "assistant" for m in log) == n
        n = len(message_logs)
        return EnvironmentReturn(
            [{"role": "environment", "content": self.OBSERVATION}] * n, [{**m, "seen": k} for m, k in zip(metadata, seen)],
            [None] * n, torch.tensor([float(len(log[-1]["content"])) for log in message_logs]),
            torch.tensor([k >= self.turns for k in seen]), [None] * n)


def multi_turn_ctx(*extra: str):
    engine, tokenizer = engine_and_tokenizer()
    cfg = grpo_cfg("grpo.max_rollout_turns=3", "policy.max_total_sequence_length=512", *extra)
    return SimpleNamespace(cfg=cfg, step=0, generation=EngineGeneration(engine), tokenizer=tokenizer,
                           envs={"t": CountingEnv()})


def paused_in_a_later_turn(partial: PartialRollouts) -> list[SequenceProgress]:
    return [p for g in partial.carried for p in g
            if p.sample.status is SampleStatus.PAUSED and p.sample.turns >= 1 and len(p.token_ids) > 0]


def test_a_multi_turn_episode_paused_in_a_later_turn_continues_as_one_uninterrupted_rollout():
    ctx = multi_turn_ctx()
    timer = SimpleNamespace(add=lambda *a: None)
    partial = PartialRollouts(ctx.cfg)
    _, m0 = partial.roll_out(ctx, prompts(ctx.tokenizer, 6), seed_key=1, timer=timer)
    paused = paused_in_a_later_turn(partial)
    assert paused and m0["partial_rollouts/carried_over_later_turn_sequences"] >= len(paused)
    # The paused episodes' state so far: earlier turns (version 0) and observations in the log.
    for p in paused:
        roles = [m["role"] for m in p.sample.message_log]
        assert roles == ["user"] + ["assistant", "environment"] * p.sample.turns
        assert p.sample.extra_env_info["seen"] == p.sample.turns

    # Through a checkpoint, then continued under version 1 (the same weights) until every carried
    # group is complete; no new prompts.
    partial = round_trip(partial)
    seeds = {id(p.sample): p.seed for g in partial.carried for p in g}
    paused_ids = {id(p.sample) for p in paused_in_a_later_turn(partial)}
    ctx.step, ctx.cfg = 1, grpo_cfg("grpo.max_rollout_turns=3", "policy.max_total_sequence_length=512",
                                    "grpo.partial_rollouts.min_complete_fraction=1.0")
    trained, m1 = partial.roll_out(ctx, [], seed_key=2, timer=timer)
    assert not partial.carried and m1["partial_rollouts/resumed_sequences"] == m0["partial_rollouts/carried_over_sequences"]
    continued = [s for g in trained for s in g.samples]
    assert paused_ids <= {id(s) for s in continued}

    # The same prompts rolled out uninterrupted with the same seeds.
    fresh = [prompts(ctx.tokenizer, 6)[s.idx].fresh_copy() for s in continued]
    run_multi_turn_rollout(ctx.generation, fresh, ctx.tokenizer, ctx.envs, max_seq_len=512, max_rollout_turns=3,
                           seeds=torch.tensor([seeds[id(s)] for s in continued]), group_size=2)
    batch = flatten_message_logs([s.message_log for s in continued], pad_token_id=ctx.tokenizer.pad_token_id)
    for row, (s, ref) in enumerate(zip(continued, fresh)):
        assert [m["role"] for m in s.message_log] == [m["role"] for m in ref.message_log]
        for m, r in zip(s.message_log, ref.message_log):
            assert m["token_ids"].tolist() == r["token_ids"].tolist() and m["content"] == r["content"]
            if m["role"] == "assistant":
                torch.testing.assert_close(m["generation_logprobs"], r["generation_logprobs"], atol=1e-5, rtol=0)
                assert len(m["weight_versions"]) == len(m["token_ids"])
                assert m["weight_version"] == int(m["weight_versions"].min())
            else:
                assert "generation_logprobs" not in m
        assert (s.turns, s.status, s.reward, s.generated_tokens, s.observation_tokens, s.extra_env_info) == (
            ref.turns, ref.status, ref.reward, ref.generated_tokens, ref.observation_tokens, ref.extra_env_info)
        # Only the generated tokens are trained on; the observations and the prompt are masked.
        expected = torch.cat([torch.full((len(m["token_ids"]),), float(m["role"] == "assistant")) for m in s.message_log])
        assert batch["token_mask"][row, : len(expected)].tolist() == expected.tolist()
        assert batch["token_mask"][row, len(expected):].sum() == 0
        if id(s) in paused_ids:  # paused inside a later turn: that turn spans versions 0 and 1
            assert s.turns == 3 and s.status is SampleStatus.COMPLETED
            versions = [m["weight_versions"].tolist() for m in s.message_log if m["role"] == "assistant"]
            assert versions[0] == [0] * len(versions[0])
            assert any(v[0] == 0 and v[-1] == 1 for v in versions[1:])
    assert m1["partial_rollouts/mixed_version_sequences"] >= len(paused_ids)
    assert m1["avg_turns_per_sample"] == 3.0


def test_a_multi_turn_carry_over_survives_a_checkpoint_round_trip():
    timer = SimpleNamespace(add=lambda *a: None)
    runs = []
    for restore in (False, True):
        ctx = multi_turn_ctx()
        partial = PartialRollouts(ctx.cfg)
        partial.roll_out(ctx, prompts(ctx.tokenizer, 6), seed_key=1, timer=timer)
        assert paused_in_a_later_turn(partial)
        if restore:
            partial = round_trip(partial)
        ctx.step = 1
        trained, metrics = partial.roll_out(ctx, prompts(ctx.tokenizer, 6), seed_key=2, timer=timer)
        runs.append(([[[m["token_ids"].tolist() for m in s.message_log] for s in g.samples] for g in trained],
                     [[(s.reward, s.turns, s.status, s.extra_env_info) for s in g.samples] for g in trained],
                     [g.weight_version for g in trained], metrics,
                     [[(p.sample.turns, p.token_ids.tolist(), p.sample.extra_env_info) for p in g] for g in partial.carried]))
    assert runs[0] == runs[1]
    assert runs[0][3]["partial_rollouts/resumed_sequences"] > 0


def test_multi_turn_partial_rollouts_refuse_environments_with_live_episode_state():
    cfg = grpo_cfg("grpo.max_rollout_turns=3")
    problem = environment_problem(cfg, ["math", "textarena"])
    assert problem is not None and "env.textarena" in problem and "\n" not in problem
    http = grpo_cfg("grpo.max_rollout_turns=3", "env.http.servers.main=http://127.0.0.1:1")
    assert "env.http" in environment_problem(http, ["http"])
    assert environment_problem(cfg, ["math", "tools", "sliding_puzzle", "mcqa"]) is None  # state in the metadata
    assert environment_problem(grpo_cfg(), ["textarena"]) is None  # single-turn: nothing outlives a step


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("extra, message", [
    (["loss_fn.use_importance_sampling_correction=false"], "loss_fn.use_importance_sampling_correction=true"),
    (["grpo.use_dynamic_sampling=true"], "grpo.use_dynamic_sampling"),
    (["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"], "grpo.async_grpo.enabled"),
    (["policy.generation.backend=vllm"], "policy.generation.backend"),
    (["loss_fn.force_on_policy_ratio=true"], "loss_fn.force_on_policy_ratio"),
])
def test_the_config_refuses_what_cannot_be_exact(extra, message):
    with pytest.raises(Exception, match="grpo.partial_rollouts.enabled") as error:
        grpo_cfg(*extra)
    assert message in str(error.value)


def test_partial_rollouts_are_off_by_default_and_the_defaults_hold():
    p = load_config("grpo", overrides=["sft_warmup=null"]).grpo.partial_rollouts
    assert (p.enabled, p.min_complete_fraction, p.chunk_tokens, p.max_age_steps) == (False, 0.75, 256, 1)
    assert grpo_cfg().grpo.partial_rollouts.enabled
