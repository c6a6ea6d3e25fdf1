"""The `http` environment: tools and verification by a NeMo-Gym-compatible resources server.

Per episode (one sample) the environment opens an HTTP session (its own cookie jar) and
- at the first step `POST /seed_session` with the data row (the server sets its session cookie);
- each turn with tool calls (`<tool_call>{json}</tool_call>` or `tool_call_pattern`): `POST
  /<tool name>` with the call's arguments; the response body goes back to the model as a `tool`
  message (loss mask 0). Unknown tools (not in the row's `tools`, when it has some), malformed
  calls and HTTP failures become error messages; at most `max_tool_calls` calls per episode;
- at the turn without tool calls (the final answer): `POST /verify` with `{**row, "response":
  <Responses API object of the whole episode>}`; the reward is the answer's `reward`, and its
  `reward_components` are logged as `train/env/<task>/reward/<name>`, their mean per episode;
- an episode the rollout stops first (token limit, `grpo.max_rollout_turns`) is verified too, as
  it stands (`finish`; counted as `unfinished_episodes`): as in NeMo-Gym every episode is
  verified, and the server may give partial credit. Its session is closed after its verify.

Timeouts and failures: each request waits at most `timeout_s`; connection errors, timeouts and
HTTP 5xx are retried `retries` times (`retry_backoff_s` apart). A verify that still fails scores 0
and ends the episode. A failed `/seed_session` ends the episode with reward 0 at once and prints a
warning; `max_consecutive_seed_failures` failures in a row on one server (it is down) stop the run
with an error naming its URL. Counts per rollout (`train/env/<task>/<key>`): `http_errors`,
`timeouts`, `seed_failures`, `verify_failures`, `tool_calls`, `tool_errors`, `over_budget`,
`unfinished_episodes`.

Servers: `servers` maps names to base URLs; a row's `agent_ref.name` (NeMo-Gym's routing key)
or `resources_server` picks one; rows naming none use `default_server`. NeMo-Gym rows come to this
environment with `data.env_name: http` (or a blend component with `env: http`).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import uuid
from collections import OrderedDict
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.data.chat import tool_names
from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, ended
from posttrain.environments.registry import register_env
from posttrain.environments.tools.parsing import DEFAULT_TOOL_CALL_PATTERN, compile_pattern, parse_tool_calls
from posttrain.errors import UserError

log = logging.getLogger(__name__)

# Metadata keys this environment adds (not sent to the server).
_EPISODE_KEY = "_http_episode"
_PRIVATE = (_EPISODE_KEY, "ground_truth", "tool_calls_used")


class HttpEnvConfig(BaseModel):
    """`env.http.*`."""

    model_config = ConfigDict(extra="forbid")

    servers: dict[str, str] = Field(..., description="Server name -> base URL (http://host:port) of a resources server.")
    default_server: Optional[str] = Field(None, description="Server of rows that name none (default: the only one).")
    timeout_s: float = Field(30.0, gt=0, description="Longest wait for one HTTP request. Default 30.")
    retries: int = Field(2, ge=0, description="Retries after a connection error, timeout or HTTP 5xx. Default 2.")
    retry_backoff_s: float = Field(0.5, ge=0, description="Pause before each retry. Default 0.5.")
    max_tool_calls: int = Field(8, ge=0, description="Tool calls per episode; one more ends it with reward 0. Default 8.")
    tool_call_pattern: str = Field(DEFAULT_TOOL_CALL_PATTERN, description="Regex whose first group is a call's JSON.")
    max_result_chars: int = Field(4000, ge=50, description="Longest tool result sent back (cut at the end). Default 4000.")
    max_live_sessions: int = Field(4096, ge=1, description="Open episode sessions kept; older abandoned ones are dropped.")
    max_parallel_requests: int = Field(32, ge=1, description="Episodes whose requests run at once (threads). Default 32.")
    max_consecutive_seed_failures: int = Field(
        16, ge=1, description="Failed /seed_session requests in a row to one server that stop the run (it is down). Default 16.")

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: dict[str, str]) -> dict[str, str]:
        if not servers:
            raise ValueError("name at least one server: {name: http://host:port}")
        for name, url in servers.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server {name!r}: {url!r} is not an http(s) URL")
        return {name: url.rstrip("/") for name, url in servers.items()}

    @field_validator("tool_call_pattern")
    @classmethod
    def _pattern(cls, pattern: str) -> str:
        compile_pattern(pattern)
        return pattern

    @model_validator(mode="after")
    def _default(self):
        if self.default_server is None and len(self.servers) == 1:
            self.default_server = next(iter(self.servers))
        if self.default_server is not None and self.default_server not in self.servers:
            raise ValueError(f"default_server {self.default_server!r} is not one of servers ({', '.join(self.servers)})")
        return self


def server_of(row: dict) -> Optional[str]:
    """The server a row names: `agent_ref.name` (NeMo-Gym) or `resources_server`."""
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and isinstance(ref.get("name"), str):
        return ref["name"]
    return row.get("resources_server") if isinstance(row.get("resources_server"), str) else None


def responses_object(message_log: MessageLog, pattern) -> dict:
    """The episode as a Responses API object: assistant text as `message` items, tool calls as
    `function_call` items, and `tool` messages as their `function_call_output` items."""
    output: list[dict] = []
    pending: list[str] = []
    for message in message_log:
        role, content = message.get("role"), str(message.get("content", ""))
        if role == "assistant":
            calls = parse_tool_calls(content, pattern)
            pending = []
            for call in calls:
                call_id = f"call_{uuid.uuid4().hex[:12]}"
                pending.append(call_id)
                output.append({"type": "function_call", "name": call.name or "", "call_id": call_id,
                               "arguments": json.dumps(call.arguments)})
            if not calls:
                output.append({"type": "message", "role": "assistant", "status": "completed", "id": f"msg_{uuid.uuid4().hex[:12]}",
                               "content": [{"type": "output_text", "text": content, "annotations": []}]})
        elif role == "tool" and pending:
            for call_id in pending:  # one tool message answers all calls of a turn
                output.append({"type": "function_call_output", "call_id": call_id, "output": content})
            pending = []
    return {"id": f"resp_{uuid.uuid4().hex[:12]}", "created_at": int(time.time()), "model": "posttrain-policy",
            "object": "response", "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


class ServerDown(UserError):
    """`max_consecutive_seed_failures` episodes in a row could not start on a resources server."""


class _Failed(Exception):
    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@register_env("http")
class HttpEnvironment(Environment):
    """Drives NeMo-Gym-compatible resources servers (module docstring). Config: `HttpEnvConfig`."""

    config_class = HttpEnvConfig
    live_episode_state = True  # the HTTP sessions (and the server's episode state) live here

    def __init__(self, cfg: HttpEnvConfig | dict | None = None):
        try:
            import requests
        except ImportError:
            raise ImportError("env.http needs the http extra: pip install 'posttrain[http]'") from None
        self.requests = requests
        self.cfg = cfg if isinstance(cfg, HttpEnvConfig) else HttpEnvConfig.model_validate(cfg or {})
        self.pattern = compile_pattern(self.cfg.tool_call_pattern)
        self.sessions: OrderedDict[str, Any] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._seed_failures_in_a_row: dict[str, int] = {}  # server URL -> failed seeds since its last success

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        name = server_of(metadata)
        if name is not None and not isinstance(name, str):
            return "agent_ref.name must be a server name"
        return None

    # ------------------------------------------------------------------------------------ requests
    def _post(self, session, url: str, body: Any, counts: dict) -> str:
        """POST `body` as JSON; the response text. Retries (see module doc); raises `_Failed`."""
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.cfg.retry_backoff_s)
            try:
                response = session.post(url, json=body, timeout=self.cfg.timeout_s)
            except self.requests.Timeout:
                counts["timeouts"] += 1
                last, timed_out = f"timed out after {self.cfg.timeout_s}s", True
                continue
            except self.requests.RequestException as e:
                counts["http_errors"] += 1
                last, timed_out = f"{type(e).__name__}", False
                continue
            if response.status_code >= 500:
                counts["http_errors"] += 1
                last, timed_out = f"HTTP {response.status_code}", False
                continue
            if response.status_code >= 400:
                counts["http_errors"] += 1
                raise _Failed(f"HTTP {response.status_code}: {response.text[:200]}")
            return response.text
        raise _Failed(last, timed_out)

    @staticmethod
    def row(meta: dict) -> dict:
        """The data row as the server sees it: a NeMo-Gym row whole (`nemo_gym_row`, kept by the
        loader), else the row's fields (our own bookkeeping keys left out)."""
        if isinstance(meta.get("nemo_gym_row"), dict):
            return dict(meta["nemo_gym_row"])
        return {k: v for k, v in meta.items() if k not in _PRIVATE}

    def _end(self, key: str) -> None:
        with self._lock:
            state = self.sessions.pop(key, None)
        if state is not None:
            state["session"].close()

    # ------------------------------------------------------------------------------------ step
    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        """Episodes are independent: their requests run in parallel (`max_parallel_requests`)."""
        n = len(message_logs)
        for meta in metadata:  # a row naming an unknown server is a data error, raised before any request
            name = server_of(meta) or self.cfg.default_server
            if name not in self.cfg.servers:
                raise ValueError(f"http environment: row names server {name!r} but env.http.servers has {sorted(self.cfg.servers)}")
        with self._lock:  # episode keys and the session table are shared
            episodes = [self._episode_key(meta) for meta in metadata]
        results = self._each_episode(self._step_one, message_logs, metadata, episodes)
        counts = _summed([r[4] for r in results])
        if counts["seed_failures"]:  # on the console, not only in the metrics
            errors = sorted({r[0]["content"] for r in results if r[4]["seed_failures"]})
            log.warning("http environment: %d of %d episodes score 0: %s", counts["seed_failures"], n, " ".join(errors))
        return EnvironmentReturn(
            observations=[r[0] for r in results], metadata=[r[1] for r in results], next_stop_strings=[None] * n,
            rewards=torch.tensor([r[2] for r in results], dtype=torch.float32),
            terminateds=torch.tensor([r[3] for r in results], dtype=torch.bool), answers=[None] * n, metrics=counts,
            reward_components=[_reward_components(r[4]) for r in results],
        )

    def finish(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        """Verify episodes the rollout stopped (module docstring) and close their sessions."""
        with self._lock:
            episodes = [self._episode_key(meta) for meta in metadata]
        results = self._each_episode(self._finish_one, message_logs, metadata, episodes)
        return ended(len(message_logs), metadata, rewards=[r[0] for r in results], metrics=_summed([r[1] for r in results]),
                     reward_components=[_reward_components(r[1]) for r in results])

    def _each_episode(self, work, message_logs: list[MessageLog], metadata: list[dict], episodes: list) -> list:
        """`work(log, meta, episode)` of every episode; they are independent, so their requests run
        in parallel (`max_parallel_requests`)."""
        with ThreadPoolExecutor(max_workers=max(1, min(len(message_logs), self.cfg.max_parallel_requests))) as pool:
            return list(pool.map(work, message_logs, metadata, episodes))

    def _episode_key(self, meta: dict) -> tuple[str, bool]:
        """`(key, new)`: the episode's session key, registering a new session at its first step."""
        key = meta.get(_EPISODE_KEY)
        if key in self.sessions:
            return key, False
        key = f"{next(self._ids)}"
        name = server_of(meta) or self.cfg.default_server
        self.sessions[key] = {"session": self.requests.Session(), "url": self.cfg.servers[name], "seeded": False}
        while len(self.sessions) > self.cfg.max_live_sessions:
            _, old = self.sessions.popitem(last=False)
            old["session"].close()
        return key, True

    def _step_one(self, log_: MessageLog, meta: dict, episode: tuple[str, bool]):
        """`(observation, metadata, reward, done, counts)` of one sample's turn."""
        counts = _new_counts()
        key, new = episode
        state = self.sessions[key]
        meta = {**meta, _EPISODE_KEY: key}
        if new:
            try:
                self._post(state["session"], state["url"] + "/seed_session", self.row(meta), counts)
                self._seeded(state["url"], None)
            except _Failed as e:
                counts["seed_failures"] += 1
                self._end(key)
                self._seeded(state["url"], e)
                text = f"Error: could not start the episode on {state['url']} ({e})."
                return {"role": "environment", "content": text}, meta, 0.0, True, counts
        last = next((m for m in reversed(log_) if m.get("role") == "assistant"), {"content": ""})
        calls = parse_tool_calls(str(last.get("content", "")), self.pattern)
        if calls:
            used = int(meta.get("tool_calls_used", 0))
            if used >= self.cfg.max_tool_calls:
                counts["over_budget"] += 1
                self._end(key)
                return {"role": "tool", "content": "Error: tool call budget spent.", "chat_template": True}, meta, 0.0, True, counts
            allowed = tool_names(meta.get("tools")) or None
            results = []
            for call in calls[: self.cfg.max_tool_calls - used]:
                counts["tool_calls"] += 1
                if call.error is not None:
                    text = f"Error: {call.error}"
                elif allowed is not None and call.name not in allowed:
                    text = f"Error: unknown tool {call.name!r} (tools: {', '.join(allowed)})"
                else:
                    try:
                        text = self._post(state["session"], f"{state['url']}/{call.name}", call.arguments, counts)
                    except _Failed as e:
                        text = f"Error: tool {call.name} failed: {e}"
                counts["tool_errors"] += float(text.startswith("Error:"))
                if len(text) > self.cfg.max_result_chars:
                    text = text[: self.cfg.max_result_chars] + " ...(cut)"
                results.append(text)
            if len(calls) > self.cfg.max_tool_calls - used:
                results.append(f"Error: tool call budget ({self.cfg.max_tool_calls}) spent; give your final answer.")
            meta["tool_calls_used"] = min(used + len(calls), self.cfg.max_tool_calls)
            return {"role": "tool", "content": "\n".join(results), "chat_template": True}, meta, 0.0, False, counts
        # The final answer: verify the whole episode.
        reward, text = self._verify(key, log_, meta, counts)
        return {"role": "environment", "content": text}, meta, reward, True, counts

    def _finish_one(self, log_: MessageLog, meta: dict, episode: tuple[str, bool]) -> tuple[float, dict]:
        """`(reward, counts)` of an episode the rollout stopped: verified as it stands."""
        counts = _new_counts()
        counts["unfinished_episodes"] += 1
        key, _ = episode
        reward, _ = self._verify(key, log_, {**meta, _EPISODE_KEY: key}, counts)
        return reward, counts

    def _verify(self, key: str, log_: MessageLog, meta: dict, counts: dict) -> tuple[float, str]:
        """`(reward, text)`: `POST /verify` of the episode in its session, which is then closed; a
        failed verify scores 0 (counted). Reward components are added to `counts` (`reward/<name>`)."""
        state = self.sessions[key]
        body = {**self.row(meta), "response": responses_object(log_, self.pattern)}
        try:
            verdict = json.loads(self._post(state["session"], state["url"] + "/verify", body, counts))
            reward = float(verdict["reward"])
            for name, value in (verdict.get("reward_components") or {}).items():
                counts[f"reward/{name}"] = counts.get(f"reward/{name}", 0.0) + float(value)
            text = f"Reward: {reward:g}"
        except (_Failed, ValueError, KeyError, TypeError) as e:  # bad JSON or no numeric reward: 0
            counts["verify_failures"] += 1
            reward, text = 0.0, f"Error: verify failed ({e})"
        self._end(key)
        return reward, text

    def _seeded(self, url: str, error: Optional[_Failed]) -> None:
        """Record a `/seed_session` outcome on `url`; raise `ServerDown` at the
        `max_consecutive_seed_failures`-th failure in a row."""
        with self._lock:
            failures = 0 if error is None else self._seed_failures_in_a_row.get(url, 0) + 1
            self._seed_failures_in_a_row[url] = failures
        if failures >= self.cfg.max_consecutive_seed_failures:
            raise ServerDown(f"http environment: the last {failures} /seed_session requests to {url} failed "
                             f"(last: {error}); is the resources server running there? (env.http.servers; "
                             f"env.http.max_consecutive_seed_failures={self.cfg.max_consecutive_seed_failures})")

    def shutdown(self) -> None:
        for key in list(self.sessions):
            self._end(key)


_COUNTS = ("tool_calls", "tool_errors", "http_errors", "timeouts", "seed_failures", "verify_failures", "over_budget",
           "unfinished_episodes")


def _new_counts() -> dict[str, float]:
    return dict.fromkeys(_COUNTS, 0.0)


def _reward_components(counts: dict[str, float]) -> dict[str, float]:
    """An episode's reward components (its `reward/<name>` counts) by name: GDPO's input."""
    return {key[len("reward/"):]: value for key, value in counts.items() if key.startswith("reward/")}


def _summed(per_episode: list[dict[str, float]]) -> dict[str, float]:
    totals = _new_counts()
    for counts in per_episode:
        for key, value in counts.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals
