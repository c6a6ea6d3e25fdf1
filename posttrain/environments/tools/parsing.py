"""Tool calls in model output: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen,
Hermes and most open chat templates) or any regex whose first group holds that JSON object.

Model output is data: a call that is not valid JSON, has no string `name` or whose `arguments`
are not an object becomes a `ToolCall` with `error` set, which the environment reports back to
the model instead of raising.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

DEFAULT_TOOL_CALL_PATTERN = r"<tool_call>\s*(.*?)\s*</tool_call>"


@dataclass
class ToolCall:
    name: Optional[str]
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None  # why the call could not be read; None for a well-formed call


def compile_pattern(pattern: str) -> re.Pattern:
    """`pattern` compiled (DOTALL); it must have at least one group (the call's JSON)."""
    compiled = re.compile(pattern, re.DOTALL)
    if compiled.groups < 1:
        raise ValueError(f"tool-call pattern {pattern!r} needs a group holding the call's JSON")
    return compiled


def parse_tool_calls(text: str, pattern: re.Pattern | str = DEFAULT_TOOL_CALL_PATTERN, max_chars: int = 20_000) -> list[ToolCall]:
    """Every tool call in `text`, in order (an empty list when there is none).

    `arguments` may be an object or a JSON string holding one (OpenAI's form). A call's JSON longer
    than `max_chars` is an error, not parsed.
    """
    pattern = compile_pattern(pattern) if isinstance(pattern, str) else pattern
    calls = []
    for match in pattern.finditer(text):
        body = match.group(1)
        if len(body) > max_chars:
            calls.append(ToolCall(None, error=f"tool call longer than {max_chars} characters"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"tool call is not valid JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall(None, error='tool call must be a JSON object with a string "name"'))
            continue
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                calls.append(ToolCall(obj["name"], error='"arguments" is a string but not a JSON object'))
                continue
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls
