"""Micro-batch planning and the model forward pass that turns a micro-batch into logprobs.

Three ways to cut a worker's rows into micro-batches (the loss never sees the difference: it
always gets ordinary right-padded `[n, L]` rows):
- fixed size (`policy.train_micro_batch_size` / `policy.logprob_batch_size` rows), each cut to
  its longest row;
- dynamic batching (`policy.dynamic_batching`): rows sorted by length and grouped up to a token
  budget, lengths rounded up to `sequence_length_round`;
- sequence packing (`policy.sequence_packing`): rows concatenated into one `[1, T]` row per bin;
  `position_ids` restart at 0 for every sequence, from which transformers builds a
  block-diagonal causal mask (any attention implementation), so no token sees another
  sequence.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from posttrain.distributed.batch import Batch


@dataclass
class MicroBatch:
    """Rows of a worker's local batch, ready for one forward pass.

    Attributes:
        rows: the rows, cut to `rows["input_ids"].shape[1]` = their longest length (rounded).
        index: position of each row in the local batch (to write results back in order).
        packed: when packing, the concatenated `[1, T]` inputs (`input_ids`, `position_ids`) and
            `cu_seqlens` (start offset of every row in the packed row, plus the total).
        dummy: a stand-in run only so every data-parallel rank makes the same number of forward
            (and backward) passes; its loss is multiplied by 0 and its outputs are dropped.
    """

    rows: Batch
    index: torch.Tensor
    packed: Optional[dict[str, torch.Tensor]] = None
    dummy: bool = False

    def as_dummy(self) -> "MicroBatch":
        return MicroBatch(self.rows, self.index, self.packed, dummy=True)


def _cut(rows: Batch, length: int) -> Batch:
    return rows.truncate(max(1, length))


def fixed_size_microbatches(batch: Batch, size: int) -> list[MicroBatch]:
    """Consecutive groups of `size` rows, each cut to its longest row."""
    out = []
    for start in range(0, batch.size, size):
        index = torch.arange(start, min(start + size, batch.size))
        rows = batch.select(index)
        out.append(MicroBatch(_cut(rows, int(rows["input_lengths"].max())), index))
    return out


def dynamic_microbatches(batch: Batch, max_tokens: int, round_to: int) -> list[MicroBatch]:
    """Rows grouped by length under a padded-token budget (see `posttrain.data.packing`)."""
    from posttrain.data import packing

    lengths = batch["input_lengths"].tolist()
    groups = packing.dynamic_microbatches(lengths, max_tokens, round_to)
    out = []
    for group in groups:
        index = torch.as_tensor(group, dtype=torch.long)
        rows = batch.select(index)
        longest = int(rows["input_lengths"].max())
        padded = min(batch["input_ids"].shape[1], -(-longest // round_to) * round_to)
        out.append(MicroBatch(_cut(rows, padded), index))
    return out


def packed_microbatches(batch: Batch, max_tokens: int, algorithm: str) -> list[MicroBatch]:
    """Rows binned by a packer up to `max_tokens` tokens, each bin concatenated into one row."""
    from posttrain.data import packing

    lengths = batch["input_lengths"].tolist()
    bins = packing.pack_sequences(lengths, max_tokens, algorithm)
    out = []
    for group in bins:
        index = torch.as_tensor(group, dtype=torch.long)
        rows = batch.select(index)
        rows = _cut(rows, int(rows["input_lengths"].max()))
        out.append(MicroBatch(rows, index, packed=pack_rows(rows["input_ids"], rows["input_lengths"])))
    return out


def pack_rows(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Concatenate the valid tokens of right-padded rows into one `[1, T]` row."""
    lengths = input_lengths.tolist()
    ids = torch.cat([input_ids[i, :n] for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(input_ids.device)
    cu_seqlens = F.pad(torch.as_tensor(lengths).cumsum(0), (1, 0))
    return {"input_ids": ids, "position_ids": positions, "cu_seqlens": cu_seqlens}


def unpack_rows(packed_values: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of `pack_rows` for a `[T]` per-token tensor: `[n, seq_len]`, 0 in the padding.

    Built with one `index_select` + mask (not per-row slicing into a buffer) so the gradient
    flows straight back to the packed values.
    """
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    positions = torch.arange(seq_len)
    valid = positions[None, :] < lengths[:, None]
    flat = (starts[:, None] + positions[None, :]).clamp(max=max(int(cu_seqlens[-1]) - 1, 0))
    gathered = packed_values.index_select(0, flat.flatten().to(packed_values.device)).view(len(lengths), seq_len)
    return gathered * valid.to(gathered.device)


# ------------------------------------------------------------------------------------ forwards
def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`[B, S]` with position i = log p(input_ids[:, i] | input_ids[:, :i]) and position 0 = 0.

    Computed in float32 as `logit[target] - logsumexp(logits)` after dividing by `temperature`
    (so it matches the generation side's processed logprobs).
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    logprobs = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return F.pad(logprobs, (1, 0))


def _autocast(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 compute over fp32 master weights; a no-op in float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def microbatch_logprobs(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, compute_dtype: torch.dtype, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs `[n, L]` of a micro-batch's rows (0 at position 0 and in the padding)."""
    input_ids = mb.rows["input_ids"].to(device)
    lengths = mb.rows["input_lengths"].to(device)
    seq_len = input_ids.shape[1]
    with _autocast(device, compute_dtype):
        if mb.packed is not None:
            packed_ids = mb.packed["input_ids"].to(device)
            logits = model(input_ids=packed_ids, position_ids=mb.packed["position_ids"].to(device)).logits
            # Across a sequence boundary the "next token" belongs to another row; unpacking keeps
            # only positions 1..n-1 of each row, so those values are dropped.
            packed_logprobs = next_token_logprobs(logits, packed_ids, temperature)[0]
            logprobs = unpack_rows(packed_logprobs, mb.packed["cu_seqlens"], seq_len)
            return logprobs * (torch.arange(seq_len, device=device) > 0)
        mask = (torch.arange(seq_len, device=device)[None, :] < lengths[:, None]).long()
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    return next_token_logprobs(logits, input_ids, temperature) * mask


def microbatch_scores(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, compute_dtype: torch.dtype
) -> torch.Tensor:
    """One scalar per row `[n]` from a sequence-classification (reward) model.

    transformers pools the score at each row's last non-pad token (`config.pad_token_id`), which
    is the last valid token for right-padded rows whose pad token differs from their content.
    """
    if mb.packed is not None:
        raise ValueError("reward models do not support policy.sequence_packing; use dynamic batching")
    input_ids = mb.rows["input_ids"].to(device)
    lengths = mb.rows["input_lengths"].to(device)
    mask = (torch.arange(input_ids.shape[1], device=device)[None, :] < lengths[:, None]).long()
    with _autocast(device, compute_dtype):
        scores = model(input_ids=input_ids, attention_mask=mask).logits
    return scores[:, 0].float()
