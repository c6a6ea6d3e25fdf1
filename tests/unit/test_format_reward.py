"""R1-Zero's format reward (`reward_shaping.format_reward`) against hand-computed values."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.experience import score_groups, training_batch
from posttrain.algorithms.format_reward import format_flags, format_metrics, in_format
from posttrain.config import load_config
from posttrain.data.sample import Sample

ANSWER_LINE = r"^\s*-?\d+\s*$"  # the whole answer is one number


def test_in_format_by_pattern_or_by_the_environments_answer():
    assert in_format(" 73", "73", ANSWER_LINE)
    assert not in_format(" 37 + 48 = 73", "73", ANSWER_LINE)  # the verifier reads it; the format asks for the number alone
    assert not in_format("", None, ANSWER_LINE)
    assert in_format("I think \\boxed{5}.", None, r"\\boxed\{[^}]+\}")  # a pattern ignores the extraction
    # No pattern: in format when the environment extracted an answer.
    assert in_format("anything", "B", None)
    assert not in_format("anything", None, None)


def _sample(text: str, answer=None, task: str = "math", reward: float = 0.0) -> Sample:
    return Sample(message_log=[{"role": "user", "content": "Q", "token_ids": torch.zeros(3, dtype=torch.long)},
                               {"role": "assistant", "content": text, "token_ids": torch.ones(2, dtype=torch.long),
                                "generation_logprobs": torch.zeros(2)}],
                  prompt_length=3, task_name=task, answer=answer, reward=reward)


def test_format_flags_use_each_tasks_pattern():
    cfg = load_config("grpo", overrides=[
        "reward_shaping.format_reward.weight=0.2", f"reward_shaping.format_reward.pattern={ANSWER_LINE}",
        "reward_shaping.format_reward.task_patterns={quiz: 'Answer: [A-D]'}"]).reward_shaping.format_reward
    samples = [_sample(" 12", "12"), _sample(" 7 + 5 = 12", "12"), _sample("Answer: C", "C", "quiz"),
               _sample("C", "C", "quiz")]
    flags = format_flags(cfg, samples)
    assert flags.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert format_metrics(flags, [s.task_name for s in samples], ["math", "quiz"]) == {
        "train/format_rate": 0.5, "train/format_rate/math": 0.5, "train/format_rate/quiz": 0.5}
    assert format_metrics(flags[:2], ["math", "math"], ["math"]) == {"train/format_rate": 0.5}


def test_a_bad_pattern_names_its_key():
    with pytest.raises(Exception, match=r"reward_shaping.format_reward.task_patterns.math='\(' is not a regular expression"):
        load_config("grpo", overrides=["reward_shaping.format_reward.task_patterns={math: '('}"])


def _grpo(*overrides):
    return load_config("grpo", overrides=[
        "sft_warmup=null", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=8", "grpo.normalize_rewards=false", *overrides])


def _rollout(samples):
    n = len(samples)
    return SimpleNamespace(samples=samples, rewards=torch.tensor([s.reward for s in samples]),
                           overlong=torch.zeros(n, dtype=torch.bool), timed_out=torch.zeros(n, dtype=torch.bool))


def test_grpo_adds_the_format_reward_before_the_advantages_and_logs_the_rate():
    """Group 0: every answer wrong (reward 0), two of four in format: the shaped rewards are
    [0.1, 0, 0.1, 0] (mean 0.05), a signal where the environment's rewards gave none. Group 1: one
    correct answer in format, one in format and wrong, two out of format: [1.1, 0.1, 0, 0]."""
    cfg = _grpo("reward_shaping.format_reward.weight=0.1", f"reward_shaping.format_reward.pattern={ANSWER_LINE}")
    texts = [" 12", " 12 apples", " 9", "Mia has", " 30", " 31", "30 + 1", " the answer is 30"]
    rewards = [0, 0, 0, 0, 1, 0, 0, 0]
    samples = [_sample(t, reward=float(r)) for t, r in zip(texts, rewards)]
    ctx = SimpleNamespace(cfg=cfg, step=1, envs={"math": None}, tokenizer=SimpleNamespace(pad_token_id=0))
    groups = score_groups(ctx, _rollout(samples), 2, version=1)
    shaped = [0.1, 0.0, 0.1, 0.0, 1.1, 0.1, 0.0, 0.0]
    assert [s.shaped_reward for g in groups for s in g.samples] == pytest.approx(shaped)
    means = [0.05] * 4 + [0.3] * 4
    assert [s.advantage for g in groups for s in g.samples] == pytest.approx([r - m for r, m in zip(shaped, means)])
    assert [g.has_signal for g in groups] == [True, True]  # group 0 by its format alone
    _, metrics = training_batch(ctx, groups, groups, [{}])
    assert metrics["train/format_rate"] == pytest.approx(4 / 8)
    assert metrics["train/reward"] == pytest.approx(1 / 8)  # the environment's reward, without the format's


def test_off_by_default():
    cfg = _grpo()
    assert cfg.reward_shaping.format_reward.weight == 0.0
    samples = [_sample(" 12") for _ in range(8)]
    ctx = SimpleNamespace(cfg=cfg, step=1, envs={"math": None}, tokenizer=SimpleNamespace(pad_token_id=0))
    groups = score_groups(ctx, _rollout(samples), 2, version=1)
    assert [s.shaped_reward for g in groups for s in g.samples] == [0.0] * 8
    assert [g.has_signal for g in groups] == [False, False]
    assert "train/format_rate" not in training_batch(ctx, groups, groups, [{}])[1]
