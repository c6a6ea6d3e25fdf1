"""Micro-batch planning and the model forward pass that turns a micro-batch into logprobs.

Three ways to cut a worker's rows into micro-batches (the loss never sees the difference: it
always gets ordinary right-padded `[n, L]` rows):
- fixed size (`policy.train_micro_batch_size` / `policy.logprob_batch_size` rows), each cut to
  its longest row;
- dynamic batching (`policy.dynamic_batching`): rows sorted by length and grouped up to a token
  budget (lengths rounded up to `sequence_length_round` when counting), each cut to its longest;
- sequence packing (`policy.sequence_packing`): rows concatenated into one `[1, T]` row per bin;
  `position_ids` restart at 0 for every sequence and a block-diagonal causal mask keeps every
  token inside its own sequence (eager / sdpa attention; flash-attention varlen kwargs are not
  wired yet); the packed logprobs are unpacked back to `[n, L]` before the loss.
Bin packing, packed tensors and unpacking are `posttrain.data.packing`'s.

Two ways to turn a micro-batch into logprobs (`microbatch_logprobs`): the plain one takes the
model's logits `[n, L, V]` and `next_token_logprobs`; the fused one (`fused=True`, for models
`linear_logprobs.fused_logprobs_problem` accepts) takes the decoder's last hidden states, picks the
positions whose logprob is wanted and runs `linear_logprobs` on them only, never building the logits.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from posttrain.data import packing
from posttrain.distributed.batch import Batch
from posttrain.models.vision_inputs import image_inputs, image_token_id, mask_image_positions, suppress_image_token
from posttrain.models.policy.linear_logprobs import (
    attention_implementation,
    final_hidden_states,
    linear_logprobs,
    output_weight,
)


@dataclass
class MicroBatch:
    """Rows of a worker's local batch, ready for one forward pass.

    Attributes:
        rows: the rows, cut to their longest length.
        index: position of each row in the local batch (to write results back in order).
        packed: when packing, one bin from `packing.pack_sequences` (`input_ids`/`position_ids`
            `[1, T]`, `cu_seqlens`, `lengths`, `seq_indices`, `max_seqlen`), rows in `rows` order.
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
    """Rows grouped by length under a padded-token budget (`packing.dynamic_microbatches`)."""
    out = []
    for group in packing.dynamic_microbatches(batch["input_lengths"].tolist(), max_tokens, round_to):
        index = torch.as_tensor(group, dtype=torch.long)
        rows = batch.select(index)
        out.append(MicroBatch(_cut(rows, int(rows["input_lengths"].max())), index))
    return out


def packed_microbatches(batch: Batch, max_tokens: int, algorithm: str) -> list[MicroBatch]:
    """Rows binned by a packer up to `max_tokens` tokens, each bin concatenated into one row."""
    bins = packing.pack(batch["input_lengths"].tolist(), max_tokens, algorithm)
    packed = packing.pack_sequences(batch["input_ids"], batch["input_lengths"], bins)
    out = []
    for bin_inputs in packed:
        index = bin_inputs["seq_indices"]
        rows = batch.select(index)
        out.append(MicroBatch(_cut(rows, int(rows["input_lengths"].max())), index, packed=bin_inputs))
    return out


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


def compute_autocast(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 compute over fp32 master weights; a no-op in float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def packed_forward(model: torch.nn.Module, mb: MicroBatch, device: torch.device) -> torch.Tensor:
    """Logits `[1, T, V]` of a packed row. It carries no attention mask, only `position_ids` that
    restart at 0 for every sequence (so rotary embeddings match unpacked rows): from them
    transformers finds the sequence boundaries and keeps attention within each sequence, with
    the model's attention kernel (`policy.attn_implementation`): flash-attention varlen, a
    flex-attention block mask, or SDPA's boolean mask. No dense `T x T` float mask is built here.
    (transformers looks for the boundaries only without a KV cache, hence `use_cache=False`.)"""
    return _text_logits(model(input_ids=mb.packed["input_ids"].to(device), position_ids=mb.packed["position_ids"].to(device),
                              use_cache=False, **image_inputs(mb.rows, device)).logits, model)


def _text_logits(logits: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A vision-language model's logits without its image token (`vision_inputs.suppress_image_token`)."""
    image_id = image_token_id(model)
    return logits if image_id is None else suppress_image_token(logits, image_id)


def microbatch_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    compute_dtype: torch.dtype,
    temperature: float = 1.0,
    *,
    fused: bool = False,
    loss_positions_only: bool = False,
) -> torch.Tensor:
    """Logprobs `[n, L]` of a micro-batch's rows (0 at position 0 and in the padding).

    Args:
        fused: through the decoder's hidden states and `linear_logprobs` (default False: the
            model's logits); the caller checks `fused_logprobs_problem(model)` first.
        loss_positions_only: with `fused`, compute only the positions a loss reads
            (`logprob_positions`); the others hold 0 (default False: every valid position).
    """
    if fused:
        return _fused_microbatch_logprobs(model, mb, device, compute_dtype, temperature, loss_positions_only)
    input_ids = mb.rows["input_ids"].to(device)
    lengths = mb.rows["input_lengths"].to(device)
    seq_len = input_ids.shape[1]
    with compute_autocast(device, compute_dtype):
        if mb.packed is not None:
            packed_ids = mb.packed["input_ids"].to(device)
            logits = packed_forward(model, mb, device)
            packed_logprobs = packing.zero_sequence_starts(
                next_token_logprobs(logits, packed_ids, temperature), mb.packed["cu_seqlens"]
            )
            return mask_image_positions(
                packing.unpack(packed_logprobs, mb.packed["cu_seqlens"], mb.packed["lengths"], seq_len), input_ids, model)
        mask = (torch.arange(seq_len, device=device)[None, :] < lengths[:, None]).long()
        logits = _text_logits(model(input_ids=input_ids, attention_mask=mask, **image_inputs(mb.rows, device)).logits, model)
    return mask_image_positions(next_token_logprobs(logits, input_ids, temperature) * mask, input_ids, model)


def logprob_positions(rows: Batch, loss_positions_only: bool) -> torch.Tensor:
    """`[n, L]` bool: where a logprob is wanted. Every valid position but the first of each row; with
    `loss_positions_only` (and a `token_mask` in `rows`) only those where the losses read it,
    `token_mask != 0` and `sample_mask != 0` (docs/internals.md: a loss uses positions `1:` under
    `token_mask[:, 1:] * sample_mask[:, None]`)."""
    lengths = rows["input_lengths"]
    positions = torch.arange(rows["input_ids"].shape[1], device=lengths.device)
    wanted = (positions[None, :] < lengths[:, None]) & (positions[None, :] > 0)
    if loss_positions_only and "token_mask" in rows:
        wanted &= rows["token_mask"] != 0
        if "sample_mask" in rows:
            wanted &= (rows["sample_mask"] != 0)[:, None]
    return wanted


def _fused_microbatch_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    compute_dtype: torch.dtype,
    temperature: float,
    loss_positions_only: bool,
) -> torch.Tensor:
    """`microbatch_logprobs` from the decoder's hidden states at the wanted positions only.

    The logprob at row position i comes from the hidden state of the token before it: flat index
    `row * L + i - 1` of a padded `[n, L]` forward, `cu_seqlens[row] + i - 1` of a packed `[1, T]`
    one (a packed sequence's first position is never wanted, so no sequence reads its neighbour).
    The values are written straight into the `[n, L]` layout; a packed row needs no unpacking.
    """
    input_ids = mb.rows["input_ids"].to(device)
    n_rows, seq_len = input_ids.shape
    row, pos = logprob_positions(mb.rows, loss_positions_only).to(device).nonzero(as_tuple=True)
    with compute_autocast(device, compute_dtype), final_hidden_states(model) as captured:
        # logits_to_keep=1: transformers runs its head on one position per row; we do the rest.
        if mb.packed is not None:
            model(input_ids=mb.packed["input_ids"].to(device), position_ids=mb.packed["position_ids"].to(device),
                  use_cache=False, logits_to_keep=1, **image_inputs(mb.rows, device))
            hidden_index = mb.packed["cu_seqlens"].to(device).long()[row] + pos - 1
        else:
            # Right-padded rows need no attention mask with a causal model: no valid token sees the
            # padding after it, and the padding's outputs are never read. Without one, SDPA takes
            # its causal kernel instead of a dense boolean mask (flash-attention keeps its mask:
            # it skips the padding).
            lengths = mb.rows["input_lengths"].to(device)
            mask = (torch.arange(seq_len, device=device)[None, :] < lengths[:, None]).long()
            if attention_implementation(model) in ("sdpa", "eager"):
                mask = None
            model(input_ids=input_ids, attention_mask=mask, logits_to_keep=1, **image_inputs(mb.rows, device))
            hidden_index = row * seq_len + pos - 1
        hidden = captured[-1]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)
        values = linear_logprobs(hidden, output_weight(model), input_ids[row, pos], temperature)
    return mask_image_positions(values.new_zeros(n_rows, seq_len).index_put((row, pos), values), input_ids, model)


def microbatch_logits(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, compute_dtype: torch.dtype, temperature: float = 1.0
) -> torch.Tensor:
    """Next-token logits `[n, L, V]` (float32, divided by `temperature`) aligned to `input_ids`:
    position i holds the logits of token i given tokens < i; position 0 and the padding are 0.

    For losses with `input_type == "logits"` (distillation) and the teacher's top-k.
    """
    input_ids = mb.rows["input_ids"].to(device)
    lengths = mb.rows["input_lengths"].to(device)
    seq_len = input_ids.shape[1]
    with compute_autocast(device, compute_dtype):
        if mb.packed is not None:
            logits = packed_forward(model, mb, device)
        else:
            attention = (torch.arange(seq_len, device=device)[None, :] < lengths[:, None]).long()
            logits = _text_logits(model(input_ids=input_ids, attention_mask=attention,
                                        **image_inputs(mb.rows, device)).logits, model)
    logits = F.pad(logits[:, :-1].float(), (0, 0, 1, 0))  # shift right: position i predicts token i
    if temperature != 1.0:
        logits = logits / temperature
    if mb.packed is not None:  # a sequence's first position would condition on the previous sequence
        starts = mb.packed["cu_seqlens"][:-1].long().to(device)
        logits = logits.index_fill(1, starts[starts < logits.shape[1]], 0.0)
        return packing.unpack(logits, mb.packed["cu_seqlens"], mb.packed["lengths"], seq_len)
    valid = torch.arange(seq_len, device=device)[None, :] < lengths[:, None]
    return logits * valid[..., None]


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
    with compute_autocast(device, compute_dtype):
        scores = model(input_ids=input_ids, attention_mask=mask).logits
    return scores[:, 0].float()


def microbatch_values(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, compute_dtype: torch.dtype
) -> torch.Tensor:
    """Values `[n, L]` (float32) from a token-classification (value) model, aligned like logprobs:
    position i holds the head's output at token i - 1, the value of the prefix before token i
    (the state in which token i was chosen); position 0 and the padding are 0. A packed row's
    sequences each start at 0 as well (the packed forward keeps attention within each sequence)."""
    input_ids = mb.rows["input_ids"].to(device)
    lengths = mb.rows["input_lengths"].to(device)
    seq_len = input_ids.shape[1]
    with compute_autocast(device, compute_dtype):
        if mb.packed is not None:
            outputs = packed_forward(model, mb, device)[..., 0]
        else:
            mask = (torch.arange(seq_len, device=device)[None, :] < lengths[:, None]).long()
            outputs = model(input_ids=input_ids, attention_mask=mask).logits[..., 0]
    values = F.pad(outputs[:, :-1].float(), (1, 0))  # shift right: position i is valued from token i - 1
    if mb.packed is not None:
        values = packing.zero_sequence_starts(values, mb.packed["cu_seqlens"])
        return packing.unpack(values, mb.packed["cu_seqlens"], mb.packed["lengths"], seq_len)
    return values * (torch.arange(seq_len, device=device)[None, :] < lengths[:, None])
