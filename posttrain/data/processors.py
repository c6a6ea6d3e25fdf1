"""Turn a record (`{"prompt", "answer", "task_name", ...}`) into what the algorithms train on.

An RL prompt becomes a `Sample` (`posttrain.data.sample`: message log, task and environment,
`extra_env_info` with the ground truth, ...); an SFT example is a dict

    {"message_log": [...], "length": int, "extra_env_info": {"ground_truth": answer, <row fields>},
     "loss_multiplier": 1.0, "idx": int, "task_name": str, "env_name": str, ["source", "source_weight"]}

`loss_multiplier` 0.0 masks the sample out of the loss (it becomes `sample_mask`); it is how an
over-long sample is dropped without crashing the run. Processors are registered by name
(`PROCESSORS`), so a new prompt format is one decorated function.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.data.chat import render_prompt, tools_system_text
from posttrain.data.datasets import DataError, env_metadata
from posttrain.data.sample import DEFAULT_TASK_NAME, Sample
from posttrain.utils.registry import registrar

Processor = Callable[..., Any]  # a `Sample` (RL prompts) or an example dict (SFT)
PROCESSORS: dict[str, Processor] = {}

# Tokens an over-long prompt keeps (as NeMo-RL's math processor): enough to keep tensors
# non-empty, while its loss_multiplier of 0 keeps it out of training.
TRUNCATED_PROMPT_TOKENS = 4


register_processor = registrar(PROCESSORS, "processor")  # @register_processor("name") on a Processor


def _field(record: dict, key: str, idx: int) -> Any:
    if key not in record:
        raise DataError(f"sample idx {idx}: record has no {key!r} key (keys: {sorted(record)})")
    return record[key]


def _prompt_text(
    prompt: str, tokenizer: PreTrainedTokenizerBase, use_chat_template: bool, system_prompt: str | None,
    messages: list[dict] | None = None, tools: list[dict] | None = None,
) -> tuple[str, list[dict], bool]:
    """(text the model sees before its answer, chat messages, add_special_tokens for encoding it).

    With the chat template the text ends with the generation prompt (e.g. `<|assistant|>`) and
    carries its own special tokens. Without it, the system prompt (if any) goes on its own line
    before the prompt and the tokenizer adds its usual special tokens (bos for Llama-style ones).
    `messages` (a record's own conversation, e.g. a NeMo-Gym row's input) replaces the single user
    message; `system_prompt` is added when they have no system message. `tools` (OpenAI-style
    function schemas) are described through the template (`posttrain.data.chat.render_prompt`), or
    in the system message without a chat template.
    """
    if messages:
        # content: a string, or (a row with images, posttrain.data.images) a list of text and image parts
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
    else:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
    if use_chat_template:
        if tokenizer.chat_template is None:
            raise ValueError("data.use_chat_template is true but the tokenizer has no chat template")
        text = render_prompt(tokenizer, messages, tools)
        return text, messages, False
    text = "\n".join(([tools_system_text(tools)] if tools else []) + [m["content"] for m in messages])
    return text, messages, True


def _routing(record: dict) -> dict[str, Any]:
    """The datum keys that route a record: task (metrics), environment, and blend source."""
    task = record.get("task_name", DEFAULT_TASK_NAME)
    routing = {"task_name": task, "env_name": record.get("env_name") or task}
    if "source" in record:
        routing.update(source=record["source"], source_weight=float(record.get("source_weight", 1.0)))
    return routing


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"], dtype=torch.long)


def _prompt_message(tokenizer: PreTrainedTokenizerBase, text: str, add_special: bool, record: dict, idx: int) -> dict:
    """The prompt message: its text and tokens, and for a row with images (`images`, decoded by
    `posttrain.data.images`) the `pixel_values` its expanded image tokens stand for (the model's
    processor: `posttrain.data.image_prompts.image_prompt`) and the images themselves (`images`,
    for vLLM, which runs the processor itself)."""
    images = record.get("images")
    if not images:
        return {"role": "user", "content": text, "token_ids": _encode(tokenizer, text, add_special)}
    if "messages" not in record:
        raise DataError(f"sample idx {idx}: a row with images needs its prompt as chat messages with image parts")
    from posttrain.data.image_prompts import image_prompt

    token_ids, pixel_values = image_prompt(tokenizer, text, images)
    return {"role": "user", "content": text, "token_ids": token_ids, "pixel_values": pixel_values,
            "images": list(images)}


def _without_image_tokens(tokenizer: PreTrainedTokenizerBase, token_ids: torch.Tensor, message: dict) -> torch.Tensor:
    """A cut prompt's tokens with its image tokens made padding: the cut drops its images (it is
    masked out of the loss, and a model needs every image whose tokens it sees)."""
    if "pixel_values" not in message:
        return token_ids
    from posttrain.data.image_prompts import processor_for

    return token_ids.masked_fill(token_ids == processor_for(tokenizer).image_token_id, tokenizer.pad_token_id)


@register_processor("math")
def build_prompt_message_log(
    record: dict,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    idx: int = 0,
) -> Sample:
    """A one-message prompt `Sample` for RL: the model answers it, an environment grades it.

    Args:
        record: needs `prompt` and `answer` (ground truth, passed to the environment as
            `extra_env_info["ground_truth"]`); `task_name` routes it to an environment
            (default `"math"`).
        tokenizer: a Hugging Face tokenizer.
        max_seq_length: a longer prompt is cut to 4 tokens and gets `loss_multiplier` 0.0 (the
            preflight counts such rows per data file: `posttrain.data.row_lengths`).
        use_chat_template: wrap the prompt with the tokenizer's chat template, ending in the
            generation prompt (default True). A record's `tools` (function schemas) are described
            in the prompt, and its `stop_strings` end the first generated turn. The single `user` message's content is the whole
            templated text, so the message log holds exactly the tokens the model sees.
        system_prompt: optional system message (default None).
        idx: the sample's index, kept in the datum.
    """
    prompt = _field(record, "prompt", idx)
    if _routing(record)["env_name"] == DEFAULT_TASK_NAME:
        _field(record, "answer", idx)  # math grades against it; other environments read other fields
    text, _, add_special = _prompt_text(prompt, tokenizer, use_chat_template, system_prompt, record.get("messages"),
                                        record.get("tools"))
    message = _prompt_message(tokenizer, text, add_special, record, idx)
    token_ids = message["token_ids"]
    loss_multiplier = 1.0
    if token_ids.numel() > max_seq_length:  # said once per data file by the preflight (data/row_lengths.py)
        token_ids = token_ids[: min(TRUNCATED_PROMPT_TOKENS, max_seq_length)]
        text = tokenizer.decode(token_ids)
        loss_multiplier = 0.0
        message = {"role": "user", "content": text, "token_ids": _without_image_tokens(tokenizer, token_ids, message)}
    return Sample(
        message_log=[message],
        prompt_length=token_ids.numel(),
        extra_env_info=env_metadata(record),
        loss_multiplier=loss_multiplier,
        idx=idx,
        stop_strings=list(record["stop_strings"]) if record.get("stop_strings") else None,
        **_routing(record),
    )


def _assistant_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], prompt_text: str, answer: str, use_chat_template: bool
) -> tuple[str, bool]:
    """Text of the assistant turn after the generation prompt, and whether eos must be appended.

    With a chat template it is whatever the template writes after the generation prompt for this
    answer (`46<|end|>` here, `46<|im_end|>\\n` for Qwen), so the end-of-turn token is learned.
    """
    if use_chat_template:
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
        if full.startswith(prompt_text):
            return full[len(prompt_text):], False
    return answer, True


@register_processor("sft")
def build_sft_example(
    record: dict,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    idx: int = 0,
) -> dict[str, Any]:
    """A supervised example: the prompt (not trained on) and the answer (trained on).

    The message log is `[user (prompt, generation prompt included), assistant (answer and its
    end-of-turn / eos tokens, "loss": True)]`; `flatten_message_logs` sets `token_mask` to 1 on
    messages with `loss: True`. Each message is tokenised on its own, as the model would see the
    prompt at generation time. A pair longer than `max_seq_length` keeps at most
    `max_seq_length // 2` tokens of each message and gets `loss_multiplier` 0.0 (counted per data
    file by the preflight: `posttrain.data.row_lengths`).
    Arguments as in `build_prompt_message_log`.
    """
    prompt = _field(record, "prompt", idx)
    answer = str(_field(record, "answer", idx))
    prompt_text, messages, add_special = _prompt_text(prompt, tokenizer, use_chat_template, system_prompt,
                                                      record.get("messages"))
    prompt_message = _prompt_message(tokenizer, prompt_text, add_special, record, idx)
    prompt_ids = prompt_message["token_ids"]
    answer_text, append_eos = _assistant_text(tokenizer, messages, prompt_text, answer, use_chat_template)
    answer_ids = _encode(tokenizer, answer_text, False)
    if append_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("build_sft_example without a chat template needs a tokenizer with an eos token")
        answer_ids = torch.cat([answer_ids, torch.tensor([tokenizer.eos_token_id])])
        answer_text += tokenizer.eos_token

    loss_multiplier = 1.0
    if prompt_ids.numel() + answer_ids.numel() > max_seq_length:  # said per data file by the preflight
        keep = max(max_seq_length // 2, 1)
        prompt_ids, answer_ids = prompt_ids[:keep], answer_ids[:keep]
        prompt_text, answer_text = tokenizer.decode(prompt_ids), tokenizer.decode(answer_ids)
        loss_multiplier = 0.0
        prompt_message = {"role": "user", "content": prompt_text,
                          "token_ids": _without_image_tokens(tokenizer, prompt_ids, prompt_message)}
    return {
        "message_log": [
            prompt_message,
            {"role": "assistant", "content": answer_text, "token_ids": answer_ids, "loss": True},
        ],
        "length": prompt_ids.numel() + answer_ids.numel(),
        "extra_env_info": env_metadata(record),
        "loss_multiplier": loss_multiplier,
        "idx": idx,
        **_routing(record),
    }
