"""`policy.generation.val_temperature` reaches the generation engine (it was read only as `is None`)."""

from __future__ import annotations

import torch

from posttrain.config.schema import GenerationConfig
from posttrain.data.processors import build_prompt_message_log
from posttrain.distributed.batch import Batch
from posttrain.environments.interface import Environment, EnvironmentReturn
from posttrain.evals.eval import evaluate, validation_sampling
from posttrain.models.tiny import build_tokenizer


class RecordingGeneration:
    """Appends one token to every row and records how it was asked to sample."""

    def __init__(self):
        self.calls = []
        self.events = []

    def prepare_for_generation(self):
        self.events.append("prepare")

    def finish_generation(self):
        self.events.append("finish")

    def generate_shards(self, batch, greedy=False, params=None):
        yield list(range(batch.size)), self.generate(batch, greedy, params)

    def generate(self, batch, greedy=False, params=None):
        self.calls.append((greedy, params))
        self.events.append("generate")
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        out = torch.cat([ids, torch.full((ids.shape[0], 1), 20)], dim=1)
        for row, n in enumerate(lengths.tolist()):
            out[row, n] = 20
        b = ids.shape[0]
        return Batch(output_ids=out, generation_lengths=torch.ones(b, dtype=torch.long),
                     logprobs=torch.zeros(out.shape), truncated=torch.zeros(b, dtype=torch.bool))


class AlwaysRight(Environment):
    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, list(metadata), [None] * n,
                                 torch.ones(n), torch.ones(n, dtype=torch.bool), ["1"] * n)


def test_validation_sampling_rule():
    assert validation_sampling(GenerationConfig(), 1) == (True, None)
    assert validation_sampling(GenerationConfig(), 4) == (False, None)  # training temperature
    assert validation_sampling(GenerationConfig(val_temperature=0.6), 1) == (False, 0.6)
    assert validation_sampling(GenerationConfig(val_temperature=0.6), 4) == (False, 0.6)


def test_evaluate_samples_at_the_validation_temperature():
    tokenizer = build_tokenizer()
    datums = [build_prompt_message_log({"prompt": "1+1=", "answer": "2", "task_name": "t"}, tokenizer, 64, idx=i)
              for i in range(3)]
    generation = RecordingGeneration()
    greedy, temperature = validation_sampling(GenerationConfig(val_temperature=0.6), 2)
    metrics = evaluate(generation, datums, tokenizer, {"t": AlwaysRight()}, k=2, greedy=greedy,
                       temperature=temperature)
    assert generation.calls == [(False, {"temperature": 0.6})]
    assert metrics["validation/accuracy_sampled"] == 1.0 and metrics["validation/pass@2"] == 1.0
    assert "validation/accuracy" not in metrics and "validation/accuracy_greedy" not in metrics
    metrics = evaluate(generation, datums, tokenizer, {"t": AlwaysRight()}, k=1, greedy=True)
    assert generation.calls[-1] == (True, None)
    assert metrics["validation/accuracy_greedy"] == 1.0 and "validation/accuracy_sampled" not in metrics


def test_per_task_accuracy_and_counts():
    from posttrain.utils.metrics import per_task_means

    values = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert per_task_means(values, ["a", "b", "a", "b"], "validation/accuracy", ["a", "b"]) == {
        "validation/accuracy/a": 1.0, "validation/accuracy_count/a": 2.0,
        "validation/accuracy/b": 0.5, "validation/accuracy_count/b": 2.0,
    }
    # A task of the run that this batch lacks: count 0, no mean.
    assert per_task_means(values, ["a"] * 4, "r", ["a", "c"]) == {"r/a": 0.75, "r_count/a": 4.0, "r_count/c": 0.0}
    assert per_task_means(values, ["a"] * 4, "validation/accuracy", ["a"]) == {}  # one task: the overall metric only


def test_rollouts_tell_the_engine_when_generation_begins_and_ends():
    """`prepare_for_generation` / `finish_generation` bracket every rollout (they were never called:
    a colocated GPU engine could not free its memory for training), also when an environment fails."""
    from posttrain.rollouts import run_multi_turn_rollout

    tokenizer = build_tokenizer()
    datums = [build_prompt_message_log({"prompt": "1+1=", "answer": "2", "task_name": "t"}, tokenizer, 64, idx=0)]
    generation = RecordingGeneration()
    run_multi_turn_rollout(generation, datums, tokenizer, {"t": AlwaysRight()}, max_seq_len=64)
    assert generation.events == ["prepare", "generate", "finish"]

    class Broken(Environment):
        def step(self, message_logs, metadata):
            raise RuntimeError("environment down")

    generation.events.clear()
    try:
        run_multi_turn_rollout(generation, datums, tokenizer, {"t": Broken()}, max_seq_len=64)
    except RuntimeError:
        pass
    assert generation.events == ["prepare", "generate", "finish"]


def test_environments_step_each_shard_as_soon_as_it_is_generated():
    """Per-sample multi-turn progress: a shard's samples reach their environment while the other
    shards still generate (not after the slowest one), over two turns, and the rollout reports
    how long samples waited."""
    from posttrain.rollouts import run_multi_turn_rollout

    events = []

    class TwoShards(RecordingGeneration):
        def generate_shards(self, batch, greedy=False, params=None):
            out = self.generate(batch, greedy, params)
            half = batch.size // 2
            for rows in (list(range(half)), list(range(half, batch.size))):
                events.append(("generated", len(rows)))
                yield rows, out.select(torch.tensor(rows))

    class TwoTurns(Environment):
        def step(self, message_logs, metadata):
            events.append(("stepped", len(message_logs)))
            n = len(message_logs)
            done = [len(log) >= 4 for log in message_logs]  # user, assistant, observation, assistant
            return EnvironmentReturn([{"role": "environment", "content": "again"}] * n, list(metadata), [None] * n,
                                     torch.ones(n), torch.tensor(done), ["1"] * n)

    tokenizer = build_tokenizer()
    datums = [build_prompt_message_log({"prompt": "1+1=", "answer": "2", "task_name": "t"}, tokenizer, 64, idx=i)
              for i in range(4)]
    result = run_multi_turn_rollout(TwoShards(), datums, tokenizer, {"t": TwoTurns()}, max_seq_len=64,
                                    max_rollout_turns=3)
    assert events == [("generated", 2), ("stepped", 2), ("generated", 2), ("stepped", 2)] * 2
    assert result.rewards.tolist() == [2.0] * 4  # rewards of both turns, every sample back in its place
    assert all(len(d.message_log) == 4 and d.reward == 2.0 for d in datums)
    assert 0.0 <= result.timings["env_step_wait"] < 1.0 and result.timings["generation_shard_spread"] >= 0.0


def test_evaluate_shows_the_first_prompts_completions(capsys):
    tokenizer = build_tokenizer()
    datums = [build_prompt_message_log({"prompt": f"{i}+1=", "answer": "2", "task_name": "t"}, tokenizer, 64, idx=i)
              for i in range(4)]
    logged = []
    evaluate(RecordingGeneration(), datums, tokenizer, {"t": AlwaysRight()}, k=2, greedy=False,
             num_samples_to_print=3, log_samples=logged.append)
    response = tokenizer.decode([20])
    # One row per prompt (the first of its k samples), the prompt without the chat template's tokens.
    assert logged == [[{"prompt": f"{i}+1=", "response": response, "reward": 1.0} for i in range(3)]]
    assert capsys.readouterr().out == ""

    evaluate(RecordingGeneration(), datums, tokenizer, {"t": AlwaysRight()}, k=1, num_samples_to_print=2)
    out = capsys.readouterr().out.splitlines()  # without a logger: printed, one short line each
    assert out == ["[posttrain] validation samples:", f"  reward 1.00 | '0+1=' -> {response!r}",
                   f"  reward 1.00 | '1+1=' -> {response!r}"]

class RightEveryOtherTime(Environment):
    """Rewards 1, 0, 1, 0, ... in the order of the rows it scores."""

    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, list(metadata), [None] * n,
                                 torch.tensor([float(i % 2 == 0) for i in range(n)]), torch.ones(n, dtype=torch.bool),
                                 ["1"] * n)


def test_sampled_accuracy_is_the_mean_over_every_sample():
    """pass@1 over all k samples of a prompt (not the first sample's reward alone)."""
    tokenizer = build_tokenizer()
    datums = [build_prompt_message_log({"prompt": "1+1=", "answer": "2", "task_name": "t"}, tokenizer, 64, idx=i)
              for i in range(3)]
    metrics = evaluate(RecordingGeneration(), datums, tokenizer, {"t": RightEveryOtherTime()}, k=2, greedy=False)
    # Rows [p0 s0, p0 s1, p1 s0, ...] get rewards 1, 0, 1, 0, ...: the first samples all 1, half overall.
    assert metrics["validation/accuracy_sampled"] == 0.5 and metrics["validation/mean_reward"] == 0.5
