"""LLM-as-judge and GenRM pairwise: score parsing, the tie-break, circular vs all-pairs
comparisons, mean aggregation, the length bonus, and unparsable judgements (reward 0, counted);
one real judgement by the tiny model through our generation engine."""

from __future__ import annotations

import pytest

from posttrain.judges.judge_env import JudgeEnvConfig, JudgeEnvironment, comparison_pairs, parse_pairwise


def logs(prompt: str, *responses: str) -> list[list[dict]]:
    return [[{"role": "user", "content": prompt}, {"role": "assistant", "content": r}] for r in responses]


@pytest.fixture(scope="module")
def judge_env():
    return JudgeEnvironment({"judge_model": "tiny", "max_new_tokens": 4})


def test_parse_pairwise_tie_break_and_ranges():
    assert parse_pairwise("score_1: 4, score_2: 2, ranking: 1") == (4.0, 2.0)
    assert parse_pairwise("Score_1 = 3; score_2: 3; ranking: 2") == (4.5, 1.5)  # tie: +-(3.5 - 2)
    assert parse_pairwise("score_1: 3, score_2: 3, ranking: 5") == (1.5, 4.5)
    assert parse_pairwise("score_1: 9, score_2: 3, ranking: 2") is None  # out of range
    assert parse_pairwise("score_1: 3, ranking: 2") is None


def test_comparison_pairs():
    assert comparison_pairs(4, "circular") == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert len(comparison_pairs(4, "all_pairs")) == 6
    assert comparison_pairs(2, "circular") == [(0, 1)] and comparison_pairs(1, "circular") == []


def test_pairwise_means_over_comparisons_per_prompt_group(judge_env, monkeypatch):
    judge_env.cfg = JudgeEnvConfig(judge_model="tiny", mode="pairwise", comparison_strategy="circular")
    seen = []

    def scripted(prompts):
        seen.extend(prompts)
        # group "q": (0,1) 5 vs 1, (1,2) unparsable, (2,0) tie 3/3 ranking 1 -> 5.5 / 0.5 ; group "r": (3,4) 2 vs 4
        return ["score_1: 5, score_2: 1, ranking: 1", "no idea", "score_1: 3, score_2: 3, ranking: 1",
                "score_1: 2, score_2: 4, ranking: 5"]

    monkeypatch.setattr(judge_env, "judge", scripted)
    out = judge_env.step(logs("q", "a", "b", "c") + logs("r", "x", "y"), [{}] * 5)
    assert len(seen) == 4 and "Response 1: a" in seen[0] and "Response 2: b" in seen[0]
    expected = [(5 + 0.5) / 2 / 5, 1 / 2 / 5, 5.5 / 2 / 5, 2 / 1 / 5, 4 / 1 / 5]
    assert out.rewards.tolist() == pytest.approx(expected)
    assert out.metrics == {"judgements": 4.0, "unparsed": 1.0}


def test_length_bonus_favours_shorter_responses_zero_sum(judge_env, monkeypatch):
    judge_env.cfg = JudgeEnvConfig(judge_model="tiny", mode="pairwise", length_bonus_alpha=0.5)
    monkeypatch.setattr(judge_env, "judge", lambda prompts: ["score_1: 3, score_2: 3, ranking: 3.5"] * len(prompts))
    out = judge_env.step(logs("q", "aa", "aaaaaa"), [{}] * 2)
    base = 3 / 5
    assert out.rewards.tolist() == pytest.approx([base + 0.5 * (4 - 2) / 6, base + 0.5 * (4 - 6) / 6])
    # no judgement, no bonus: a failing judge must not train on length alone
    monkeypatch.setattr(judge_env, "judge", lambda prompts: ["?"] * len(prompts))
    assert judge_env.step(logs("q", "aa", "aaaaaa"), [{}] * 2).rewards.tolist() == [0.0, 0.0]


def test_pointwise_scores_and_unparsable_judgements(judge_env, monkeypatch):
    judge_env.cfg = JudgeEnvConfig(judge_model="tiny", score_min=1, score_max=10)
    monkeypatch.setattr(judge_env, "judge", lambda prompts: ["Score: 10", "I think... Score: 5.5", "great answer"])
    out = judge_env.step(logs("q", "a", "b", "c"), [{}] * 3)
    assert out.rewards.tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert out.metrics == {"judgements": 3.0, "unparsed": 1.0} and out.answers == ["10.0", "5.5", None]


def test_the_tiny_judge_generates_with_our_engine(judge_env):
    judge_env.cfg = JudgeEnvConfig(judge_model="tiny", max_new_tokens=4)
    judgements = judge_env.judge(["Question: 1+1\nResponse: 2", "Question: 2+2\nResponse: 4"])
    assert len(judgements) == 2 and all(isinstance(j, str) and len(j) <= 4 for j in judgements)
    out = judge_env.step(logs("q", "a"), [{}])  # an untrained judge writes no "Score:": reward 0, counted
    assert out.metrics == {"judgements": 1.0, "unparsed": 1.0} and out.rewards.tolist() == [0.0]
