"""How episodes end in the rollout loop: an episode stopped by `max_rollout_turns` or by the token
limit is handed to its environment's `finish` (which may score it), every episode exactly once;
environments' reward components are logged as a mean per episode, on the scale of the reward."""

from __future__ import annotations

import torch

from posttrain.data.processors import build_prompt_message_log
from posttrain.environments.interface import Environment, EnvironmentReturn, ended
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts import run_multi_turn_rollout

from fake_generation import OneTokenGeneration


class NeverDone(Environment):
    """Never ends an episode; reward 0.125 per turn; row "long" gets an observation too long to fit.
    `finish` gives partial credit 0.25 and the answer "partial"; reward components 1 and 0 per step."""

    def __init__(self):
        self.finished: list[list[str]] = []

    def step(self, message_logs, metadata):
        n = len(message_logs)
        observations = [{"role": "environment", "content": "x" * (500 if m["row"] == "long" else 1)} for m in metadata]
        return EnvironmentReturn(observations, list(metadata), [None] * n, torch.full((n,), 0.125),
                                 torch.zeros(n, dtype=torch.bool), [None] * n,
                                 metrics={"reward/correct": float(n), "reward/format": 0.0, "steps": float(n)})

    def finish(self, message_logs, metadata):
        self.finished.append([m["row"] for m in metadata])
        return ended(len(message_logs), metadata, rewards=[0.25] * len(metadata), answers=["partial"] * len(metadata),
                     metrics={"finished": float(len(metadata))})


def samples(tokenizer, *rows: str):
    return [build_prompt_message_log({"prompt": "go", "row": row, "task_name": "t"}, tokenizer, 256, idx=i)
            for i, row in enumerate(rows)]


def test_episodes_stopped_by_the_turn_or_token_limit_end_in_finish():
    tokenizer = build_tokenizer()
    env = NeverDone()
    result = run_multi_turn_rollout(OneTokenGeneration(), samples(tokenizer, "short", "long"), tokenizer, {"t": env},
                                    max_seq_len=256, max_rollout_turns=3)
    assert env.finished == [["short", "long"]]  # once each, both ways of being stopped
    assert result.truncated.tolist() == [False, True] and result.metrics["max_turns_reached_rate"] == 0.5
    assert result.rewards.tolist() == [3 * 0.125 + 0.25, 0.125 + 0.25]
    assert result.answers == ["partial", "partial"] and result.metrics["env/t/finished"] == 2.0


def test_environments_without_a_verifier_score_unfinished_episodes_zero():
    class Plain(NeverDone):
        finish = Environment.finish

    tokenizer = build_tokenizer()
    result = run_multi_turn_rollout(OneTokenGeneration(), samples(tokenizer, "short"), tokenizer, {"t": Plain()},
                                    max_seq_len=256, max_rollout_turns=2)
    assert result.rewards.tolist() == [2 * 0.125] and result.answers == [None]


def test_reward_components_are_a_mean_per_episode_and_counts_stay_sums():
    tokenizer = build_tokenizer()
    result = run_multi_turn_rollout(OneTokenGeneration(), samples(tokenizer, "a", "b", "c", "d"), tokenizer, {"t": NeverDone()},
                                    max_seq_len=256, max_rollout_turns=2)
    # each episode got component "correct" 1 per turn (2 turns): 2 per episode, not 8 for the step
    assert result.metrics["env/t/reward/correct"] == 2.0 and result.metrics["env/t/reward/format"] == 0.0
    assert result.metrics["env/t/steps"] == 8.0


def test_per_sample_reward_components_are_summed_over_turns_and_finish():
    """GDPO's input: each sample's components, summed over its turns and its `finish`; NaN (does not
    apply) adds nothing, and a component that never applied is absent."""

    class Components(NeverDone):
        def step(self, message_logs, metadata):
            out = super().step(message_logs, metadata)
            return out._replace(reward_components=[{"correct": 1.0, "format": 0.5 if m["row"] == "a" else float("nan")}
                                                   for m in metadata], reward_component_weights={"format": 0.2})

        def finish(self, message_logs, metadata):
            out = super().finish(message_logs, metadata)
            return out._replace(reward_components=[{"correct": 0.25} for _ in metadata])

    tokenizer = build_tokenizer()
    rolled = samples(tokenizer, "a", "b")
    run_multi_turn_rollout(OneTokenGeneration(), rolled, tokenizer, {"t": Components()}, max_seq_len=256,
                           max_rollout_turns=2)
    assert rolled[0].reward_components == {"correct": 2.25, "format": 1.0}
    assert rolled[1].reward_components == {"correct": 2.25}
    assert rolled[0].reward_component_weights == {"format": 0.2}
