"""The fields a row's environment adds to it before its prompt is built (the tools it offers, the
prompt itself for reward functions), for the job's data and for the preflight's length check alike."""

from __future__ import annotations

from typing import Any

from posttrain.environments.registry import resolve_env
from posttrain.environments.reward_fn_env import PROMPT_KEY


def add_env_fields(cfg: Any, records: list[dict]) -> None:
    """What a record's environment asks for beyond the row's fields: the tools it offers
    (`Environment.prompt_tools`, for records without `tools` of their own), so the prompt
    describes them; and, for an environment class with `receives_prompt` (reward functions), the
    prompt as the data gave it (text, or chat messages) under `reward_fn_env.PROMPT_KEY`."""
    env_of_name: dict[str, Any] = {}
    for record in records:
        name = record.get("env_name") or record.get("task_name") or cfg.data.env_name
        if name not in env_of_name:
            try:
                cls, env_cfg = resolve_env(name, cfg.env.section(name))
            except (KeyError, ValueError):  # preflight names the problem
                env_of_name[name] = (None, False)
            else:
                env_of_name[name] = (cls.prompt_tools(env_cfg), getattr(cls, "receives_prompt", False))
        tools, receives_prompt = env_of_name[name]
        if tools and not record.get("tools"):
            record["tools"] = tools
        if receives_prompt:
            record[PROMPT_KEY] = record.get("messages") or record["prompt"]
