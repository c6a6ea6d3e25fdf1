"""Reward functions (TRL's signature) as an environment: arguments, async, weights, errors, config."""

from __future__ import annotations

import asyncio
import threading

import pytest

from posttrain.config import load_config
from posttrain.config.loader import ConfigError
from posttrain.environments.registry import resolve_env
from posttrain.environments.reward_fn_env import PROMPT_KEY, RewardFunctionError, reward_fn_section


def conversation(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": f"<|user|>{prompt}<|end|><|assistant|>"}, {"role": "assistant", "content": response}]


LOGS = [conversation("12+34=", " 46"), conversation("3+4=", "8")]
META = [{PROMPT_KEY: "12+34=", "ground_truth": "46", "a": 12, "level": "easy"},
        {PROMPT_KEY: [{"role": "user", "content": "3+4="}], "ground_truth": "7", "a": 3, "level": "hard"}]


def env_of(functions, weights=None):
    cls, cfg = resolve_env("rewards", reward_fn_section(functions, weights))
    return cls(cfg)


def test_arguments_follow_trls_signature():
    seen = {}

    def everything(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [1.0, 0.0]

    def named_only(completions, answer):  # no **kwargs: gets only the columns it names
        seen["named_only"] = (completions, answer)
        return [0.0, 0.0]

    result = env_of([everything, named_only]).step(LOGS, META)
    assert seen["prompts"] == ["12+34=", [{"role": "user", "content": "3+4="}]]  # as the data gave them
    # A chat-message prompt gets chat-message completions (TRL's conversational format).
    assert seen["completions"] == [" 46", [{"role": "assistant", "content": "8"}]]
    assert seen["answer"] == ["46", "7"] and seen["a"] == [12, 3] and seen["level"] == ["easy", "hard"]
    assert "ground_truth" not in seen and PROMPT_KEY not in seen
    assert seen["named_only"] == ([" 46", [{"role": "assistant", "content": "8"}]], ["46", "7"])
    assert result.rewards.tolist() == [1.0, 0.0] and result.terminateds.tolist() == [True, True]
    assert result.answers == ["46", "8"]


def test_a_parameter_no_column_fills_is_one_clear_error():
    def needs_solution(prompts, completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"reward function .*needs_solution takes solution, but .*'a', 'answer'"):
        env_of(needs_solution).step(LOGS, META)


def test_weights_sum_and_none_adds_nothing():
    def exact(completions, answer, **_):
        return [float(str(c).strip() == a) for c, a in zip(completions, answer)]

    def length(completions, **_):
        return [3, None]  # None: does not apply to the second completion

    result = env_of([exact, length], weights=[2.0, 0.5]).step([conversation("x", "46"), conversation("y", "8")],
                                                               [{PROMPT_KEY: "x", "ground_truth": "46"},
                                                                {PROMPT_KEY: "y", "ground_truth": "7"}])
    assert result.rewards.tolist() == [2.0 * 1 + 0.5 * 3, 0.0]


def test_async_functions_run_concurrently():
    event = asyncio.Event()

    async def waits(completions, **_):  # listed first: run one after the other, this would never end
        await asyncio.wait_for(event.wait(), timeout=60)
        return [1.0] * len(completions)

    async def sets(completions, **_):
        event.set()
        return [0.25] * len(completions)

    assert env_of([waits, sets]).step(LOGS, META).rewards.tolist() == [1.25, 1.25]


@pytest.mark.parametrize("returned, message", [
    ([1.0], r"reward function .*too_short\S* returned 1 rewards for 2 completions"),
    (["high", 0.0], r"reward function .*too_short\S* returned 'high' at index 0, not a number or None"),
    (0.5, r"reward function .*too_short\S* returned float, not a list of 2 rewards"),
])
def test_a_function_returning_the_wrong_thing_is_named(returned, message):
    def too_short(prompts, completions, **_):
        return returned

    with pytest.raises(RewardFunctionError, match=message):
        env_of(too_short).step(LOGS, META)


def test_a_function_that_raises_is_named():
    def broken(prompts, completions, **_):
        raise KeyError("score")

    with pytest.raises(RewardFunctionError, match=r"reward function .*broken raised KeyError: 'score'"):
        env_of(broken).step(LOGS, META)


def test_lambdas_get_distinct_names():
    first, second = (lambda prompts, completions, **_: [1.0] * len(completions),
                     lambda prompts, completions, **_: [2.0] * len(completions))
    section = reward_fn_section([first, second])
    assert section["reward_fn"][0] != section["reward_fn"][1]
    assert env_of([first, second]).step(LOGS, META).rewards.tolist() == [3.0, 3.0]


def test_reward_fn_from_yaml_names_a_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(prompts, completions, **columns):\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n"
    )
    cfg = load_config("grpo", overrides=[f"env.rewards.reward_fn={tmp_path}/my_rewards.py:has_digit",
                                         "env.rewards.weights=[2.0]", "data.env_name=rewards"])
    cls, env_cfg = resolve_env("rewards", cfg.env.section("rewards"))
    logs = [conversation("q", "no"), conversation("q", "a1")]
    assert cls(env_cfg).step(logs, [{PROMPT_KEY: "q"}] * 2).rewards.tolist() == [0.0, 2.0]


@pytest.mark.parametrize("override, message", [
    ("env.rewards.reward_fn=not_a_path", r"env.rewards.reward_fn='not_a_path' must be 'module:function'"),
    ("env.rewards={class_path: a:B, reward_fn: a:f}", r"env.rewards: give class_path .* or reward_fn .*not both"),
])
def test_bad_reward_fn_config_fails_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("grpo", overrides=[override])


def test_a_missing_function_names_the_key():
    with pytest.raises(ValueError, match=r"env.rewards.reward_fn: .*no_such_module_xyz"):
        resolve_env("rewards", {"reward_fn": "no_such_module_xyz:f"})
    with pytest.raises(ValueError, match=r"^env.rewards.weights: 2 weights for 1 reward functions"):
        resolve_env("rewards", {"reward_fn": "posttrain.environments.reward_fn_env:columns", "weights": [1, 2]})


def test_an_unpicklable_function_is_named_for_ray():
    lock = threading.Lock()

    def holds_a_lock(prompts, completions, **_):
        with lock:
            return [0.0] * len(completions)

    _, cfg = resolve_env("rewards", reward_fn_section(holds_a_lock))
    problem = cfg.pickling_problem()
    assert problem.startswith("reward function ") and "holds_a_lock cannot be sent to a Ray worker" in problem
    assert "lock" in problem
    _, plain = resolve_env("rewards", reward_fn_section(lambda prompts, completions, **_: [0.5] * len(completions)))
    assert plain.pickling_problem() is None  # cloudpickle sends lambdas by value
    from ray import cloudpickle

    sent = cloudpickle.loads(cloudpickle.dumps(plain))  # what a Ray actor receives: the functions themselves
    assert sent.functions[0](prompts=["p"], completions=["c"]) == [0.5]


def test_trl_chat_prompts_become_the_conversation(tmp_path):
    from posttrain.data.datasets import load_records
    from posttrain.config.schema import DataConfig

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}], "k": 1}\n')
    (record,) = load_records(DataConfig(dataset="jsonl", train_path=str(path), env_name="rewards"), "train")
    assert record["prompt"] == "2+2=" and record["messages"][0] == {"role": "system", "content": "Be brief."}
    path.write_text('{"prompt": [{"role": "robot", "content": "hi"}]}\n')
    from posttrain.data.datasets import DataError

    with pytest.raises(DataError, match=r"rows.jsonl:1: prompt must be a non-empty list of \{role, content\} messages"):
        load_records(DataConfig(dataset="jsonl", train_path=str(path), env_name="rewards"), "train")


def test_rows_of_a_reward_env_carry_their_prompt(tmp_path):
    from posttrain.environments.row_fields import add_env_fields

    cfg = load_config("grpo", overrides=["env.rewards.reward_fn=posttrain.environments.reward_fn_env:columns",
                                         "data.env_name=rewards"])
    messages = [{"role": "user", "content": "hi"}]
    records = [{"prompt": "1+1=", "task_name": "rewards"}, {"prompt": "hi", "messages": messages, "task_name": "rewards"},
               {"prompt": "2+2=", "answer": "4", "task_name": "math"}]
    add_env_fields(cfg, records)
    assert records[0][PROMPT_KEY] == "1+1=" and records[1][PROMPT_KEY] == messages and PROMPT_KEY not in records[2]
