"""Chat-template rendering for multi-turn rollouts: tool descriptions in the prompt, and an
environment's reply (a `tool` or `user` message) rendered as the next turn of the conversation.

Templates differ in what they support. Two fallbacks keep every tokenizer working, and both are
what Qwen-style templates write themselves:
- tools: when `apply_chat_template(..., tools=...)` ignores the tools (the rendered text does not
  change) or fails, the tool schemas go into the system message as JSON, with instructions to
  answer with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`tools_system_text`).
- `tool` messages: when the template rejects the `tool` role, the result is sent as a `user`
  message `<tool_response>\\n...\\n</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

# Stands for an assistant message's content when rendering a template around it; never in real text.
_MARK = "\u2063posttrain-assistant-content\u2063"


def openai_function(tool: dict) -> dict:
    """A tool schema in chat-completions form `{"type": "function", "function": {name, description,
    parameters}}`, from that form or from the Responses API's flat one (`{"type": "function", "name", ...}`,
    as in NeMo-Gym rows)."""
    if "function" in tool:
        return {"type": "function", "function": dict(tool["function"])}
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def tool_names(tools: Optional[Sequence[dict]]) -> list[str]:
    return [openai_function(t)["function"]["name"] for t in tools or []]


def tools_system_text(tools: Sequence[dict]) -> str:
    """The fallback description of `tools` for templates without tool support."""
    lines = "\n".join(json.dumps(openai_function(t)["function"], sort_keys=True) for t in tools)
    return (
        "You may call tools. Available tools (JSON schemas):\n" + lines + "\n"
        'To call one, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and stop; '
        "its result comes back in the next message."
    )


def render_prompt(tokenizer, messages: list[dict], tools: Optional[Sequence[dict]] = None) -> str:
    """`messages` through the chat template, ending in the generation prompt, with `tools` described
    natively (`tools=`) where the template supports it and in the system message otherwise."""
    if not tools:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    schemas = [openai_function(t) for t in tools]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        native = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that raises on tools: use the fallback
        native = plain
    if native != plain:
        return native
    described = tools_system_text(schemas)
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": described}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _after_assistant(tokenizer, message: dict) -> str:
    """The template's text after an assistant message's content, when `message` follows it: the end
    of the assistant turn, `message`'s turn and the generation prompt."""
    convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}, message]
    full = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    return full[full.rindex(_MARK) + len(_MARK):]


def chat_turn_ids(tokenizer, message: dict, generated_ids: Sequence[int]) -> tuple[str, list[int]]:
    """`(text, token ids)` that continue a conversation whose last message was generated
    (`generated_ids`) with `message` (`{"role": "tool" | "user", "content"}`) as the next chat turn,
    ending in the generation prompt.

    The end of the assistant's turn (e.g. `<|im_end|>\\n`) is included except for the part the
    model already generated (its eos token), so the token stream is exactly what the template
    writes for the whole conversation. A template without a `tool` role gets the `user` fallback.
    """
    message = {"role": message["role"], "content": message["content"]}
    try:
        text = _after_assistant(tokenizer, message)
    except Exception:
        if message["role"] != "tool":
            raise
        text = _after_assistant(tokenizer, {"role": "user",
                                            "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
    # What the template writes to close an assistant turn, to skip the part generation produced.
    closing_text = after_assistant_closing(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    closing = tokenizer(closing_text, add_special_tokens=False)["input_ids"] if closing_text else []
    generated = list(generated_ids)
    done = 0
    for k in range(min(len(closing), len(generated)), 0, -1):
        if generated[-k:] == closing[:k] and ids[:k] == closing[:k]:
            done = k
            break
    ids = ids[done:]
    return tokenizer.decode(ids), ids


def after_assistant_closing(tokenizer) -> str:
    """The text the chat template puts after an assistant turn's content (its closing tokens)."""
    convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
    full = tokenizer.apply_chat_template(convo, tokenize=False)
    return full[full.rindex(_MARK) + len(_MARK):]


def observation_ids(tokenizer, observation: dict[str, Any], generated_ids: Sequence[int]) -> tuple[str, list[int]]:
    """Text and token ids of an environment observation. One with `"chat_template": True` is
    rendered as a chat turn (`chat_turn_ids`) when the tokenizer has a template; any other is
    tokenised as it is (the environment formatted it)."""
    if observation.get("chat_template") and getattr(tokenizer, "chat_template", None):
        return chat_turn_ids(tokenizer, observation, generated_ids)
    content = observation["content"]
    return content, tokenizer(content, add_special_tokens=False)["input_ids"]
