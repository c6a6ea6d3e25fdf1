"""The `http` environment against our own NeMo-Gym-compatible resources server on loopback: a whole
episode (seed_session cookie, a tool call, verify with reward components), unknown tools, routing
by the row's agent_ref, and a server that times out or answers 500 (reward 0, counted)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from posttrain.environments.http_env import HttpEnvConfig, HttpEnvironment, responses_object  # noqa: E402
from posttrain.environments.resources_server import ServerThread, make_app  # noqa: E402

pytestmark = pytest.mark.functional

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
TOOLS = [{"type": "function", "name": "calculator", "parameters": {"type": "object"}}]


def log(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": "user", "content": "What is 6*7?"}] + [{"role": r, "content": c} for r, c in turns]


@pytest.fixture(scope="module")
def servers():
    good, slow, broken = make_app(tool_weight=0.5), make_app(delay_s=2.0), make_app(fail_status=500)
    with ServerThread(good) as good_url, ServerThread(slow) as slow_url, ServerThread(broken) as broken_url:
        yield {"good": good_url, "slow": slow_url, "broken": broken_url, "app": good}


def test_episode_seeds_a_session_calls_a_tool_and_verifies(servers):
    env = HttpEnvironment({"servers": {"calc": servers["good"]}, "retries": 0})
    meta = {"expected_answer": "42", "tools": TOOLS, "agent_ref": {"type": "responses_api_agents", "name": "calc"}}
    out = env.step([log(("assistant", CALL))], [meta])
    assert out.observations[0] == {"role": "tool", "content": "42", "chat_template": True}
    assert out.terminateds.tolist() == [False] and out.metrics["tool_calls"] == 1
    # The tool call was made in the episode's session: the server counted it for this cookie only.
    sessions = servers["app"].state.sessions
    seeded = [s for s in sessions.values() if s.get("row", {}).get("expected_answer") == "42"]
    assert len(seeded) == 1 and seeded[0]["tool_calls"] == 1 and "ground_truth" not in seeded[0]["row"]
    out = env.step([log(("assistant", CALL), ("tool", "42"), ("assistant", "It is 42."))], out.metadata)
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [1.5]  # correct + 0.5 * used_tool
    assert out.metrics["reward/correct"] == 1.0 and out.metrics["reward/used_tool"] == 1.0
    assert env.sessions == {}  # closed at the end of the episode
    # A new episode that answers without a tool and wrongly
    out = env.step([log(("assistant", "It is 41."))], [meta])
    assert out.rewards.tolist() == [0.0] and out.metrics["reward/used_tool"] == 0.0


def test_unknown_tools_and_malformed_calls_are_error_observations(servers):
    env = HttpEnvironment({"servers": {"calc": servers["good"]}, "retries": 0, "max_tool_calls": 2})
    meta = {"expected_answer": "42", "tools": TOOLS}
    out = env.step([log(("assistant", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><tool_call>{x</tool_call>'))],
                   [meta])
    text = out.observations[0]["content"]
    assert "unknown tool 'rm_rf'" in text and "not valid JSON" in text
    assert out.metrics["tool_errors"] == 2 and not out.terminateds[0]
    out = env.step([log(("assistant", CALL))], out.metadata)  # over the budget of 2
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [0.0] and out.metrics["over_budget"] == 1


def test_rows_route_to_the_server_they_name(servers):
    env = HttpEnvironment({"servers": {"calc": servers["good"], "down": servers["broken"]}, "retries": 0,
                           "default_server": "calc"})
    out = env.step([log(("assistant", "42")), log(("assistant", "42")), log(("assistant", "42"))],
                   [{"expected_answer": "42", "agent_ref": {"name": "calc"}}, {"expected_answer": "42", "agent_ref": {"name": "down"}},
                    {"expected_answer": "42"}])
    assert out.rewards.tolist() == [1.0, 0.0, 1.0]
    assert out.metrics["seed_failures"] == 1  # the broken server failed at /seed_session
    with pytest.raises(ValueError, match="names server 'nowhere'"):
        env.step([log(("assistant", "42"))], [{"agent_ref": {"name": "nowhere"}}])


def test_timeouts_and_http_500_score_zero_and_are_counted(servers):
    slow = HttpEnvironment({"servers": {"s": servers["slow"]}, "timeout_s": 0.3, "retries": 1, "retry_backoff_s": 0.0})
    out = slow.step([log(("assistant", "42"))], [{"expected_answer": "42"}])
    assert out.rewards.tolist() == [0.0] and out.terminateds.tolist() == [True]
    assert out.metrics["timeouts"] == 2 and out.metrics["seed_failures"] == 1  # one try + one retry
    broken = HttpEnvironment({"servers": {"b": servers["broken"]}, "retries": 2, "retry_backoff_s": 0.0})
    out = broken.step([log(("assistant", "42"))], [{"expected_answer": "42"}])
    assert out.rewards.tolist() == [0.0] and out.metrics["http_errors"] == 3


def test_config_and_responses_object():
    with pytest.raises(ValueError, match="not an http"):
        HttpEnvConfig(servers={"a": "localhost:80"})
    with pytest.raises(ValueError, match="default_server 'b'"):
        HttpEnvConfig(servers={"a": "http://x"}, default_server="b")
    obj = responses_object(log(("assistant", CALL), ("tool", "42"), ("assistant", "42")), r"<tool_call>\s*(.*?)\s*</tool_call>")
    assert [item["type"] for item in obj["output"]] == ["function_call", "function_call_output", "message"]
    assert obj["output"][0]["call_id"] == obj["output"][1]["call_id"] and obj["object"] == "response"
    assert obj["output"][2]["content"][0]["text"] == "42"
