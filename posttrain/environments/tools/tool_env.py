"""The `tools` environment: multi-turn tool use with a reward on the final answer.

Every prompt describes the configured tools (`prompt_tools`, rendered through the chat template,
see `posttrain.data.chat`). Each turn:
- the model's message has tool calls (`<tool_call>{json}</tool_call>`, or `tool_call_pattern`):
  each is run and the results come back as one `tool` message (never trained on). A malformed
  call, an unknown tool, bad arguments or a tool that raises give an error text in that message,
  never a crash. At most `max_tool_calls` calls per episode are run; a message that calls a tool
  after the budget is spent ends the episode with reward 0.
- it has none: it is the final answer, graded like the math environment (`env.tools.math`:
  `\\boxed{}` / last number, math-verify) against the row's answer; reward 1 or 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.math_env import MathEnvConfig, MathEnvironment
from posttrain.environments.registry import register_env
from posttrain.environments.tools.builtin import TOOLS, ToolError
from posttrain.environments.tools.parsing import DEFAULT_TOOL_CALL_PATTERN, compile_pattern, parse_tool_calls
from posttrain.utils.registry import resolve


class ToolEnvConfig(BaseModel):
    """`env.tools.*`."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        ["calculator"],
        description="Tools offered: built-in names (calculator, search) or 'module:Class' / 'file.py:Class' paths.",
    )
    max_tool_calls: int = Field(4, ge=0, description="Tool calls run per episode; one more ends it with reward 0. Default 4.")
    tool_call_pattern: str = Field(
        DEFAULT_TOOL_CALL_PATTERN, description="Regex whose first group is a call's JSON {name, arguments}.",
    )
    max_result_chars: int = Field(2000, ge=50, description="Longest tool result sent back (cut at the end). Default 2000.")
    documents: Optional[str] = Field(None, description="Documents of the search tool: a .jsonl of {text, title} or a .txt.")
    search_top_k: int = Field(3, ge=1, description="Passages the search tool returns. Default 3.")
    math: MathEnvConfig = Field(default_factory=MathEnvConfig, description="How the final answer is graded.")

    @field_validator("tool_call_pattern")
    @classmethod
    def _pattern(cls, pattern: str) -> str:
        compile_pattern(pattern)
        return pattern

    @field_validator("documents")
    @classmethod
    def _documents(cls, path: Optional[str]) -> Optional[str]:
        # Absolute here (in the driver): the environment actor may run in another directory.
        if path is None:
            return None
        resolved = Path(path).expanduser().resolve()
        if not resolved.is_file():
            raise ValueError(f"no such file {path!r}")
        return str(resolved)

    @field_validator("tools")
    @classmethod
    def _known(cls, tools: list[str]) -> list[str]:
        from posttrain.utils.registry import ImportPathError

        for name in tools:
            try:
                tool = resolve(TOOLS, name, "tool")
            except (KeyError, ImportPathError) as e:
                raise ValueError(e.args[0]) from None
            if not isinstance(getattr(tool, "schema", None), dict) or not callable(tool):
                raise ValueError(f"tool {name!r} needs a 'schema' (OpenAI function schema) and __call__")
        if len(set(tools)) != len(tools):
            raise ValueError(f"a tool is listed twice: {tools}")
        return tools


def build_tools(cfg: ToolEnvConfig) -> dict[str, Any]:
    """Tool name (from its schema) -> tool instance."""
    tools = {}
    for name in cfg.tools:
        tool = resolve(TOOLS, name, "tool")(cfg)
        tools[tool.schema["function"]["name"]] = tool
    return tools


@register_env("tools")
class ToolEnvironment(Environment):
    """Tool calling with a graded final answer. Config: `ToolEnvConfig`."""

    config_class = ToolEnvConfig

    def __init__(self, cfg: ToolEnvConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, ToolEnvConfig) else ToolEnvConfig.model_validate(cfg or {})
        self.tools = build_tools(self.cfg)
        self.pattern = compile_pattern(self.cfg.tool_call_pattern)
        self.grader: Optional[MathEnvironment] = None  # started on the first final answer
        self.counts = {"tool_calls": 0, "tool_errors": 0, "over_budget": 0}

    @classmethod
    def prompt_tools(cls, cfg) -> list[dict]:
        cfg = cfg if isinstance(cfg, ToolEnvConfig) else ToolEnvConfig.model_validate(cfg or {})
        return [resolve(TOOLS, name, "tool").schema for name in cfg.tools]

    def call(self, name: Optional[str], arguments: dict, error: Optional[str]) -> tuple[str, bool]:
        """`(result text, ok)` of one parsed call."""
        if error is not None:
            return f"Error: {error}", False
        tool = self.tools.get(name)
        if tool is None:
            return f"Error: unknown tool {name!r} (tools: {', '.join(self.tools)})", False
        try:
            result = tool(**arguments)
        except ToolError as e:
            return f"Error: {e}", False
        except TypeError as e:  # wrong or missing arguments
            return f"Error: bad arguments for {name}: {e}", False
        except Exception as e:  # a tool's own failure is reported, not raised
            return f"Error: {name} failed: {type(e).__name__}: {str(e)[:200]}", False
        result = result if isinstance(result, str) else json.dumps(result)
        if len(result) > self.cfg.max_result_chars:
            result = result[: self.cfg.max_result_chars] + " ...(cut)"
        return result, True

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        n = len(message_logs)
        observations: list[dict] = [{}] * n
        out_meta, rewards, done, answers = list(metadata), [0.0] * n, [False] * n, [None] * n
        final, counts = [], {"tool_calls": 0, "tool_errors": 0, "over_budget": 0}
        for i, (log_, meta) in enumerate(zip(message_logs, metadata, strict=True)):
            calls = parse_tool_calls(last_assistant_text(log_), self.pattern)
            if not calls:
                final.append(i)
                continue
            used = int(meta.get("tool_calls_used", 0))
            if used >= self.cfg.max_tool_calls:
                counts["over_budget"] += 1
                observations[i] = {"role": "tool", "content": "Error: tool call budget spent.", "chat_template": True}
                done[i] = True
                continue
            results = []
            for call in calls[: self.cfg.max_tool_calls - used]:
                text, ok = self.call(call.name, call.arguments, call.error)
                counts["tool_calls"] += 1
                counts["tool_errors"] += int(not ok)
                results.append(text)
            if len(calls) > self.cfg.max_tool_calls - used:
                results.append(f"Error: tool call budget ({self.cfg.max_tool_calls}) spent; give your final answer.")
            observations[i] = {"role": "tool", "content": "\n".join(results), "chat_template": True}
            out_meta[i] = {**meta, "tool_calls_used": min(used + len(calls), self.cfg.max_tool_calls)}
        if final:
            if self.grader is None:
                self.grader = MathEnvironment(self.cfg.math)
            graded = self.grader.step([message_logs[i] for i in final], [metadata[i] for i in final])
            for j, i in enumerate(final):
                rewards[i] = float(graded.rewards[j])
                answers[i] = graded.answers[j]
                done[i] = True
                observations[i] = graded.observations[j]
        for key, value in counts.items():
            self.counts[key] += value
        return EnvironmentReturn(
            observations=observations, metadata=out_meta, next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32), terminateds=torch.tensor(done, dtype=torch.bool),
            answers=answers, metrics=counts,
        )

    def metrics(self) -> dict[str, int]:
        """Counts since start: tool calls run, those that returned an error, episodes over budget."""
        return dict(self.counts)

    def shutdown(self) -> None:
        if self.grader is not None:
            self.grader.shutdown()
