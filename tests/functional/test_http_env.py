"""The `http` environment against our own NeMo-Gym-compatible resources server on loopback: a whole
episode (seed_session cookie, a tool call, verify with reward components), unknown tools, routing
by the row's agent_ref, a server that times out or answers 500 (reward 0, counted), episodes stopped by
the rollout verified all the same (partial credit), and a server that is down (a warning, then an
error naming its URL)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from posttrain.distributed.batch import Batch  # noqa: E402
from posttrain.environments.http_env import HttpEnvConfig, HttpEnvironment, ServerDown, responses_object  # noqa: E402
from posttrain.environments.resources_server import ServerThread, free_port, make_app  # noqa: E402

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
    assert out.reward_components == [{"correct": 1.0, "used_tool": 1.0}]  # per episode: GDPO's input
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


class AlwaysCallsTheTool:
    """A generation stand-in whose every turn is the same calculator call."""

    def __init__(self, tokenizer):
        self.reply = tokenizer(CALL + "<|end|>", add_special_tokens=False)["input_ids"]

    def prepare_for_generation(self):
        return True

    def finish_generation(self):
        return True

    def generate_shards(self, batch, greedy=False, params=None):
        b, n = batch.size, len(self.reply)
        out = torch.cat([batch["input_ids"], torch.zeros(b, n, dtype=torch.long)], dim=1)
        for row, length in enumerate(batch["input_lengths"].tolist()):
            out[row, length: length + n] = torch.tensor(self.reply)
        yield list(range(b)), Batch(output_ids=out, generation_lengths=torch.full((b,), n), logprobs=torch.zeros(out.shape),
                                    truncated=torch.zeros(b, dtype=torch.bool))


def test_episodes_the_rollout_stops_are_verified_with_partial_credit():
    """NeMo-Gym verifies every episode: one cut by max_rollout_turns (or the token limit) goes to
    /verify as it stands, the server's partial credit (here 0.5 for having used the tool) is its
    reward, the components are a mean per episode, and its session is closed."""
    from posttrain.data.processors import build_prompt_message_log
    from posttrain.models.tiny import build_tokenizer
    from posttrain.rollouts import run_multi_turn_rollout

    app = make_app(tool_weight=0.5)
    tokenizer = build_tokenizer()
    with ServerThread(app) as url:
        env = HttpEnvironment({"servers": {"calc": url}, "retries": 0})
        rows = [build_prompt_message_log({"prompt": "What is 6*7?", "expected_answer": "42", "tools": TOOLS,
                                          "task_name": "gym"}, tokenizer, 2048, idx=i) for i in range(2)]
        result = run_multi_turn_rollout(AlwaysCallsTheTool(tokenizer), rows, tokenizer, {"gym": env},
                                        max_seq_len=2048, max_rollout_turns=2)
        assert result.metrics["max_turns_reached_rate"] == 1.0
        assert app.state.verify_calls == 2 and result.rewards.tolist() == [0.5, 0.5]
        assert result.metrics["env/gym/unfinished_episodes"] == 2 and result.metrics["env/gym/tool_calls"] == 4
        assert result.metrics["env/gym/reward/used_tool"] == 1.0 and result.metrics["env/gym/reward/correct"] == 0.0
        assert env.sessions == {}
        # The token limit: the second turn's tool result no longer fits; verified the same way.
        rows = [build_prompt_message_log({"prompt": "What is 6*7?", "expected_answer": "42", "tools": TOOLS,
                                          "task_name": "gym"}, tokenizer, 2048, idx=0)]
        limit = len(rows[0].message_log[0]["token_ids"]) + len(AlwaysCallsTheTool(tokenizer).reply) + 3
        result = run_multi_turn_rollout(AlwaysCallsTheTool(tokenizer), rows, tokenizer, {"gym": env},
                                        max_seq_len=limit, max_rollout_turns=4)
        assert result.truncated.tolist() == [True] and app.state.verify_calls == 3 and result.rewards.tolist() == [0.5]
        assert env.sessions == {}


def test_a_server_that_is_down_warns_then_stops_the_run_naming_its_url(servers, caplog):
    port = free_port()
    down = f"http://127.0.0.1:{port}"  # nothing listens there (until the server below starts)
    env = HttpEnvironment({"servers": {"calc": servers["good"], "gone": down}, "default_server": "calc", "retries": 0,
                           "max_consecutive_seed_failures": 3})
    rows = [{"expected_answer": "42"}, {"expected_answer": "42", "agent_ref": {"name": "gone"}}]
    with caplog.at_level(logging.WARNING, logger="posttrain.environments.http_env"):
        out = env.step([log(("assistant", "42"))] * 2, rows)
    assert out.rewards.tolist() == [1.0, 0.0] and out.metrics["seed_failures"] == 1
    assert "1 of 2 episodes score 0" in caplog.text and down in caplog.text  # on the console, not only in metrics
    env.step([log(("assistant", "42"))], rows[1:])  # 2 failures in a row: still going
    with ServerThread(make_app(), port=port):  # back up: a success resets the count
        assert env.step([log(("assistant", "42"))], rows[1:]).rewards.tolist() == [1.0]
    for _ in range(2):
        assert env.step([log(("assistant", "42"))], rows[1:]).metrics["seed_failures"] == 1
    with pytest.raises(ServerDown, match=f"the last 3 /seed_session requests to {down} failed"):
        env.step([log(("assistant", "42"))], rows[1:])
