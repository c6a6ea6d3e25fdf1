"""Message logs: the one trajectory record, and the flatten that turns them into training tensors.

A conversation is a `list[dict]`; each message has
- `role` (`system`, `user`, `assistant`, `environment`, ...), `content` (str),
- `token_ids` (LongTensor[n]): exactly the tokens the model saw or produced,
- for generated turns: `generation_logprobs` (FloatTensor[n], the sampler's logprob of each
  token) and `weight_version` (int, the policy version that generated it),
- optionally `loss: True` to train on a message that was not generated (SFT targets),
- for a message with images (a vision-language model's prompt): `pixel_values` (FloatTensor
  [n_images, 3, H, W], the processor's), whose image tokens `token_ids` holds expanded, and
  `images` (the PIL images themselves, for an engine that runs the processor: vLLM).

Generated text is never re-tokenised: `token_ids` is the source of truth and `content` is for
people and environments.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from posttrain.distributed.batch import Batch

Message = dict[str, Any]
MessageLog = list[Message]


def _as_ids(token_ids: Any, where: str) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"{where}: token_ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids


def append_message(
    log: MessageLog,
    role: str,
    content: str,
    token_ids: Sequence[int] | torch.Tensor,
    generation_logprobs: Sequence[float] | torch.Tensor | None = None,
    weight_version: int | None = None,
    routed_experts: torch.Tensor | None = None,
) -> MessageLog:
    """Append a message to `log` in place (and return `log`).

    `generation_logprobs`, when given, must have one value per token: it marks the message as
    generated, so its tokens are trained on. `routed_experts` (`[n, layers, k]`, a mixture of
    experts' generation's chosen experts per token, -1 where none; models/router_replay.py) is
    kept for router replay.
    """
    message: Message = {"role": role, "content": content, "token_ids": _as_ids(token_ids, f"{role} message")}
    if generation_logprobs is not None:
        logprobs = torch.as_tensor(generation_logprobs, dtype=torch.float32)
        if logprobs.shape != message["token_ids"].shape:
            raise ValueError(
                f"{role} message: {logprobs.numel()} generation_logprobs for {message['token_ids'].numel()} tokens"
            )
        message["generation_logprobs"] = logprobs
    if weight_version is not None:
        message["weight_version"] = weight_version
    if routed_experts is not None:
        message["routed_experts"] = routed_experts
    log.append(message)
    return log


def is_trained_on(message: Message, loss_roles: Iterable[str] | None = None) -> bool:
    """True for generated messages, messages flagged `loss: True`, and roles in `loss_roles`."""
    return (
        "generation_logprobs" in message
        or bool(message.get("loss", False))
        or (loss_roles is not None and message["role"] in loss_roles)
    )


def flatten_message_logs(
    message_logs: Sequence[MessageLog],
    pad_token_id: int,
    loss_roles: Iterable[str] | None = None,
    pad_to_multiple_of: int = 1,
) -> Batch:
    """Concatenate each log's tokens into one right-padded row.

    Args:
        message_logs: B conversations.
        pad_token_id: fills `input_ids` beyond each row's length (other tensors pad with 0).
        loss_roles: also train on every message of these roles (default None: only generated
            or `loss`-flagged messages), e.g. `("assistant",)` for SFT data without flags.
        pad_to_multiple_of: round the padded length S up to a multiple of this (default 1),
            e.g. the tensor-parallel size.

    Returns:
        `Batch` with `input_ids [B,S]` (long), `input_lengths [B]` (long), `token_mask [B,S]`
        (float, 1 on trained tokens) and `generation_logprobs [B,S]` (float, 0 off generated
        messages), all aligned to `input_ids` (see docs/internals.md); when a message carries
        `pixel_values`, also `pixel_values`: a list with each row's images concatenated (None for
        a row without images; `posttrain.models.vision_inputs`).
    """
    loss_roles = set(loss_roles) if loss_roles is not None else None
    rows = []
    for b, log in enumerate(message_logs):
        ids, mask, logprobs = [], [], []
        for m, message in enumerate(log):
            where = f"message_logs[{b}][{m}] ({message.get('role')})"
            message_ids = _as_ids(message["token_ids"], where)
            n = message_ids.numel()
            if "generation_logprobs" in message:
                message_logprobs = torch.as_tensor(message["generation_logprobs"], dtype=torch.float32)
                if message_logprobs.shape != (n,):
                    raise ValueError(f"{where}: {message_logprobs.numel()} generation_logprobs for {n} tokens")
            else:
                message_logprobs = torch.zeros(n)
            ids.append(message_ids)
            logprobs.append(message_logprobs)
            mask.append(torch.full((n,), float(is_trained_on(message, loss_roles))))
        rows.append((torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long),
                     torch.cat(mask) if mask else torch.zeros(0),
                     torch.cat(logprobs) if logprobs else torch.zeros(0)))

    lengths = torch.tensor([row[0].numel() for row in rows], dtype=torch.long)
    max_len = int(lengths.max()) if len(rows) else 0
    max_len = -(-max_len // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(rows), max_len), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros(len(rows), max_len)
    generation_logprobs = torch.zeros(len(rows), max_len)
    for b, (ids, mask, logprobs) in enumerate(rows):
        input_ids[b, : ids.numel()] = ids
        token_mask[b, : ids.numel()] = mask
        generation_logprobs[b, : ids.numel()] = logprobs
    batch = Batch(
        input_ids=input_ids,
        input_lengths=lengths,
        token_mask=token_mask,
        generation_logprobs=generation_logprobs,
    )
    images = message_log_images(message_logs)
    if images is not None:
        batch["pixel_values"] = images
    routed = _routed_experts(message_logs, max_len)
    if routed is not None:
        batch["routed_experts"] = routed
    return batch


def message_log_images(message_logs: Sequence[MessageLog]) -> list[torch.Tensor | None] | None:
    """Each log's images (its messages' `pixel_values` concatenated; None for a log without any), a
    vision-language model's (models/vision_inputs.py); None when no log has images."""
    images = [[m["pixel_values"] for m in log if m.get("pixel_values") is not None] for log in message_logs]
    return [torch.cat(row) if row else None for row in images] if any(images) else None


def message_log_source_images(message_logs: Sequence[MessageLog]) -> list[list | None] | None:
    """Each log's images as its rows gave them (PIL; the messages' `images`, in order; None for a
    log without any), for a generation batch whose engine runs the processor itself (vLLM); None
    when no log has images. Training batches leave them out: the trainer reads `pixel_values`."""
    images = [[image for m in log for image in (m.get("images") or [])] for log in message_logs]
    return [row or None for row in images] if any(images) else None


def _routed_experts(message_logs: Sequence[MessageLog], width: int) -> torch.Tensor | None:
    """`[B, width, layers, k]` int16: the generated messages' `routed_experts` at their tokens, -1
    elsewhere (router replay, models/router_replay.py); None when no message has any."""
    shape = next((m["routed_experts"].shape[1:] for log in message_logs for m in log if "routed_experts" in m), None)
    if shape is None:
        return None
    out = torch.full((len(message_logs), width, *shape), -1, dtype=torch.int16)
    for b, log in enumerate(message_logs):
        start = 0
        for message in log:
            n = _as_ids(message["token_ids"], "message").numel()
            if "routed_experts" in message:
                out[b, start:start + n] = message["routed_experts"]
            start += n
    return out
