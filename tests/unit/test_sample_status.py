"""A sample's rollout state (`Sample.status` and its counts): how each ending sets its status (the
environment ends it, the token limit, the turn limit, the deadline), what the counts hold, and the
`RolloutResult` tensors read from them."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.data.processors import build_prompt_message_log
from posttrain.data.sample import SampleStatus
from posttrain.distributed import actors
from posttrain.environments.interface import Environment, EnvironmentReturn, ended
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts import run_multi_turn_rollout

from fake_generation import OneTokenGeneration


class Scripted(Environment):
    """Each row says how its episode goes: "done" ends at the first step (reward 1, answer "42"),
    "long" gets an observation too long to fit, "more" goes on (observation "x", next stop string
    "</x>"). Every step rewards 0.5 but "done"'s; `finish` gives 0.25 and the answer "fin"."""

    def step(self, message_logs, metadata):
        rows = [m["row"] for m in metadata]
        observations = [{"role": "environment", "content": "x" * (500 if row == "long" else 1)} for row in rows]
        return EnvironmentReturn(observations, list(metadata), [["</x>"]] * len(rows),
                                 torch.tensor([1.0 if row == "done" else 0.5 for row in rows]),
                                 torch.tensor([row == "done" for row in rows]),
                                 ["42" if row == "done" else None for row in rows])

    def finish(self, message_logs, metadata):
        return ended(len(metadata), metadata, rewards=[0.25] * len(metadata), answers=["fin"] * len(metadata))


class Handle:
    """`env` as an actor handle whose calls have answered already, but for `hangs` (a method name),
    which never answers: a deadline that has passed finds exactly that one late."""

    def __init__(self, env: Environment, hangs: str = ""):
        self.env, self.hangs = env, hangs

    def __getattr__(self, method):
        handle = self

        class Remote:
            @staticmethod
            def remote(message_logs, metadata):
                ref = actors.LocalRef(None, method)
                if method != handle.hangs:
                    ref.future.set_result(getattr(handle.env, method)(message_logs, metadata))
                return ref

        return Remote


class HitsMaxNewTokens(OneTokenGeneration):
    """Every generation stops at max_new_tokens."""

    def generate_shards(self, batch, greedy=False, params=None):
        for rows, out in super().generate_shards(batch, greedy, params):
            out["truncated"] = torch.ones(len(rows), dtype=torch.bool)
            yield rows, out


def samples(tokenizer, *rows: str, task: str = "t"):
    return [build_prompt_message_log({"prompt": "go", "row": row, "task_name": task}, tokenizer, 256, idx=i)
            for i, row in enumerate(rows)]


def test_each_ending_sets_its_status_and_the_counts():
    tokenizer = build_tokenizer()
    batch = samples(tokenizer, "done", "long", "more")
    assert all(s.status is SampleStatus.PENDING for s in batch)
    result = run_multi_turn_rollout(OneTokenGeneration(), batch, tokenizer, {"t": Scripted()},
                                    max_seq_len=256, max_rollout_turns=3)
    done, long, more = batch
    assert [s.status for s in batch] == [SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.TURN_LIMIT]
    assert [s.turns for s in batch] == [1, 1, 3] and [s.generated_tokens for s in batch] == [1, 1, 3]
    for s in batch:  # the observations appended; the last one of an episode never is
        assert s.observation_tokens == sum(len(m["token_ids"]) for m in s.message_log if m["role"] == "environment")
        assert s.turns == sum(m["role"] == "assistant" for m in s.message_log)
    assert done.observation_tokens == long.observation_tokens == 0 and more.observation_tokens > 0
    # "done" scored by its last step; the stopped two by `finish` too
    assert [s.reward for s in batch] == [1.0, 0.5 + 0.25, 3 * 0.5 + 0.25]
    assert [s.answer for s in batch] == ["42", "fin", "fin"]
    assert more.stop_strings == ["</x>"] and done.stop_strings is None  # the environment's, for the next turn
    assert not any(s.timed_out or s.hit_max_new_tokens for s in batch)


def test_the_result_is_read_from_the_samples():
    tokenizer = build_tokenizer()
    batch = samples(tokenizer, "done", "long", "more", "more")
    result = run_multi_turn_rollout(HitsMaxNewTokens(), batch, tokenizer, {"t": Scripted()},
                                    max_seq_len=256, max_rollout_turns=2)
    assert result.rewards.tolist() == [s.reward for s in batch] and result.answers == [s.answer for s in batch]
    assert result.truncated.tolist() == [s.status is SampleStatus.TRUNCATED for s in batch] == [False, True, False, False]
    assert all(s.hit_max_new_tokens for s in batch)  # so every one is overlong, for DAPO's filter
    assert result.overlong.tolist() == [s.overlong for s in batch] == [True] * 4
    assert result.timed_out.tolist() == [False] * 4
    m = result.metrics
    assert (m["natural_termination_rate"], m["truncation_rate"], m["max_turns_reached_rate"]) == (0.25, 0.25, 0.5)
    assert m["avg_turns_per_sample"] == sum(s.turns for s in batch) / 4 == 1.5
    assert m["mean_gen_tokens_per_sample"] == 1.5 and m["max_new_tokens_hit_rate"] == 1.0
    assert m["mean_env_tokens_per_sample"] == sum(s.observation_tokens for s in batch) / 4


def test_an_environment_that_misses_the_deadline_in_a_step_ends_the_episode_timed_out():
    tokenizer = build_tokenizer()
    batch = samples(tokenizer, "done", "more") + samples(tokenizer, "more", task="slow")
    result = run_multi_turn_rollout(OneTokenGeneration(), batch, tokenizer,
                                    {"t": Handle(Scripted()), "slow": Handle(Scripted(), hangs="step")},
                                    max_seq_len=256, max_rollout_turns=2, deadline=time.monotonic())
    late = batch[2]
    assert [s.status for s in batch] == [SampleStatus.COMPLETED, SampleStatus.TURN_LIMIT, SampleStatus.TIMED_OUT]
    assert late.timed_out and late.turns == 1 and late.reward == 0.0 and late.answer is None
    assert result.timed_out.tolist() == [False, False, True] and result.truncated.tolist() == [False] * 3
    assert [s.reward for s in batch[:2]] == [1.0, 2 * 0.5 + 0.25]  # the others are scored as usual


def test_an_environment_that_misses_the_deadline_in_finish_keeps_the_ending_and_drops_the_sample():
    tokenizer = build_tokenizer()
    batch = samples(tokenizer, "more") + samples(tokenizer, "more", "long", task="slow")
    result = run_multi_turn_rollout(OneTokenGeneration(), batch, tokenizer,
                                    {"t": Handle(Scripted()), "slow": Handle(Scripted(), hangs="finish")},
                                    max_seq_len=256, max_rollout_turns=1, deadline=time.monotonic())
    assert [s.status for s in batch] == [SampleStatus.TURN_LIMIT, SampleStatus.TURN_LIMIT, SampleStatus.TRUNCATED]
    assert [s.timed_out for s in batch] == [False, True, True]
    assert [s.reward for s in batch] == [0.5 + 0.25, 0.5, 0.5] and [s.answer for s in batch] == ["fin", None, None]
    # both flags: stopped by the token limit, then dropped
    assert result.truncated.tolist() == [False, False, True] and result.timed_out.tolist() == [False, True, True]
    assert result.metrics["max_turns_reached_rate"] == pytest.approx(2 / 3)


def test_a_rollout_starts_from_a_fresh_state():
    tokenizer = build_tokenizer()
    batch = samples(tokenizer, "done")
    batch[0].reward, batch[0].turns, batch[0].answer, batch[0].timed_out = 9.0, 4, "old", True
    run_multi_turn_rollout(OneTokenGeneration(), batch, tokenizer, {"t": Scripted()}, max_seq_len=256)
    assert (batch[0].reward, batch[0].turns, batch[0].answer, batch[0].timed_out) == (1.0, 1, "42", False)
