"""Sequence packing and dynamic batching (pure functions).

Packing concatenates several right-padded rows into one ``[1, T]`` row so a micro-batch carries
no padding. How a policy worker runs a packed micro-batch so that its logprobs equal the padded
ones (checked against a real HF Llama in tests/unit/test_packing.py):

1. ``bins = pack(lengths, capacity=policy.sequence_packing.train_mb_tokens, algorithm=...)``.
2. ``packed = pack_sequences(batch["input_ids"], batch["input_lengths"], bins)``; per bin:
   ``input_ids [1, T]``, ``position_ids [1, T]`` (restarting at 0 for every sequence, so rotary
   embeddings see the same positions as unpacked), ``cu_seqlens [n + 1]`` (int32 slot boundaries,
   FlashAttention-2 varlen style), ``lengths [n]``, ``seq_indices [n]`` (rows of the batch),
   ``max_seqlen``.
3. Forward with ``position_ids`` and no attention mask: transformers finds the sequence
   boundaries where the positions restart and keeps attention within each sequence, with the
   model's kernel (flash-attention varlen, a flex-attention block mask, or SDPA's boolean mask;
   ``policy.attn_implementation``). No dense ``T x T`` float mask is built.
4. The model's next-token logprobs of the packed row, with ``zero_sequence_starts(values,
   cu_seqlens)`` (0 at each sequence start), and ``unpack(values, cu_seqlens, lengths, max_len)`` scatters
   them back to ``[n, S]``, aligned with ``batch.select(seq_indices)``; the ordinary loss runs on
   that, so losses never see packing.

Bin packers (registry ``PACKERS``) follow NeMo-RL's ``data/packing/algorithms.py``. An item longer
than the bin capacity raises ``ValueError``: the token budget must be at least the longest
sequence (``policy.max_total_sequence_length``), and silently over-filling a bin would break the
memory bound the budget exists for.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from posttrain.utils.registry import registrar

Lengths = Union[Sequence[int], torch.Tensor]
Packer = Callable[[list[int], int], list[list[int]]]
PACKERS: dict[str, Packer] = {}


# @register_packer("name") on ``fn(lengths: list[int], capacity: int) -> bins (indices per bin)``.
register_packer = registrar(PACKERS, "packer")


def _as_list(lengths: Lengths) -> list[int]:
    return [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]


def pack(lengths: Lengths, capacity: int, algorithm: str = "first_fit_decreasing") -> list[list[int]]:
    """Pack items of the given lengths into bins of ``capacity`` tokens; returns the item indices
    of each bin. Every index appears exactly once and no bin exceeds the capacity.

    ``algorithm``: a name in `PACKERS`, "first_fit_decreasing" (default) or
    "modified_first_fit_decreasing". Raises ``ValueError`` for an item longer than ``capacity``.
    """
    if algorithm not in PACKERS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose from {sorted(PACKERS)}")
    if capacity < 1:
        raise ValueError(f"bin capacity must be >= 1, got {capacity}")
    sizes = _as_list(lengths)
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sequence {i} has negative length {size}")
        if size > capacity:
            raise ValueError(
                f"sequence {i} has {size} tokens, more than the packing bin capacity {capacity}; raise the "
                "token budget (policy.sequence_packing.*_mb_tokens) to at least policy.max_total_sequence_length"
            )
    return PACKERS[algorithm](sizes, capacity)


def _first_fit(order: list[int], sizes: list[int], capacity: int, bins: list[list[int]], free: list[int]) -> None:
    """Put each item (in the given order) into the first bin with room, opening bins as needed."""
    for i in order:
        for b, room in enumerate(free):
            if sizes[i] <= room:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(capacity - sizes[i])


def _decreasing(indices: Sequence[int], sizes: list[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-sizes[i], i))  # ties: original order, deterministic


@register_packer("first_fit_decreasing")
def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """First-Fit Decreasing (Johnson 1973): longest first, each into the first bin it fits;
    uses at most 11/9 OPT + 6/9 bins."""
    bins: list[list[int]] = []
    free: list[int] = []
    _first_fit(_decreasing(range(len(sizes)), sizes), sizes, capacity, bins, free)
    return bins


@register_packer("modified_first_fit_decreasing")
def modified_first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Modified First-Fit Decreasing (Johnson & Garey 1985; 71/60 OPT + 1 bins).

    Items are classed large (> C/2), medium (> C/3), small (> C/6) and tiny. Each large item opens
    a bin (longest first); forward over those bins, add the largest medium item that fits; backward
    over them, add the smallest small item and then the largest small item that still fits (only
    if the two smallest small items fit together); forward again, fill each bin with the largest
    remaining items that fit; first-fit decreasing for what is left.
    """
    c = capacity
    large = _decreasing([i for i, s in enumerate(sizes) if s > c / 2], sizes)
    medium = _decreasing([i for i, s in enumerate(sizes) if c / 3 < s <= c / 2], sizes)
    small = _decreasing([i for i, s in enumerate(sizes) if c / 6 < s <= c / 3], sizes)
    tiny = _decreasing([i for i, s in enumerate(sizes) if s <= c / 6], sizes)

    bins = [[i] for i in large]
    free = [c - sizes[i] for i in large]

    # Forward: the largest medium item that fits (medium is sorted largest first).
    for b in range(len(bins)):
        fitting = next((i for i in medium if sizes[i] <= free[b]), None)
        if fitting is not None:
            medium.remove(fitting)
            bins[b].append(fitting)
            free[b] -= sizes[fitting]

    # Backward: two small items when the two smallest fit together.
    for b in reversed(range(len(bins))):
        if len(small) < 2 or sizes[small[-1]] + sizes[small[-2]] > free[b]:
            continue
        smallest = small.pop()
        bins[b].append(smallest)
        free[b] -= sizes[smallest]
        partner = next((i for i in small if sizes[i] <= free[b]), None)
        if partner is not None:
            small.remove(partner)
            bins[b].append(partner)
            free[b] -= sizes[partner]

    # Forward: fill with the largest remaining items that fit.
    remaining = _decreasing(medium + small + tiny, sizes)
    for b in range(len(bins)):
        for i in list(remaining):
            if sizes[i] <= free[b]:
                remaining.remove(i)
                bins[b].append(i)
                free[b] -= sizes[i]

    _first_fit(remaining, sizes, capacity, bins, free)
    return bins


# ------------------------------------------------------------------------------ packed tensors
def pack_sequences(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    bins: list[list[int]],
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> list[dict[str, torch.Tensor | int]]:
    """Concatenate the valid tokens of the rows of each bin into one ``[1, T]`` row.

    ``pad_to_multiple_of`` (default 1) right-pads each sequence's slot to a multiple (some kernels
    and tensor parallelism want that) with ``pad_token_id``; the pad tokens sit after the real
    ones in the same causal segment, so they never change the real tokens' outputs. Returns, per
    bin, ``input_ids``, ``position_ids`` (restart at 0 per sequence), ``cu_seqlens`` (int32 slot
    boundaries, ``[n + 1]``), ``lengths`` (real tokens per sequence), ``seq_indices`` (batch rows)
    and ``max_seqlen`` (longest slot, an int).
    """
    if input_ids.ndim != 2 or input_lengths.shape != (input_ids.shape[0],):
        raise ValueError(
            f"pack_sequences needs input_ids [B, S] and input_lengths [B], got {tuple(input_ids.shape)} "
            f"and {tuple(input_lengths.shape)}"
        )
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if int(input_lengths.max()) > input_ids.shape[1] or int(input_lengths.min()) < 1:
        raise ValueError(f"input_lengths must lie in [1, {input_ids.shape[1]}], got {input_lengths.tolist()}")
    packed = []
    for rows in bins:
        tokens, positions, slots = [], [], [0]
        for row in rows:
            n = int(input_lengths[row])
            slot = -(-n // pad_to_multiple_of) * pad_to_multiple_of
            tokens.append(input_ids[row, :n])
            tokens.append(input_ids.new_full((slot - n,), pad_token_id))
            positions.append(torch.arange(slot, device=input_ids.device))
            slots.append(slots[-1] + slot)
        cu_seqlens = torch.tensor(slots, dtype=torch.int32, device=input_ids.device)
        packed.append({
            "input_ids": torch.cat(tokens)[None, :],
            "position_ids": torch.cat(positions)[None, :],
            "cu_seqlens": cu_seqlens,
            "lengths": input_lengths[rows].clone(),
            "seq_indices": torch.tensor(rows, dtype=torch.long, device=input_ids.device),
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        })
    return packed


def unpack(packed_values: torch.Tensor, cu_seqlens: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Scatter per-token values ``[1, T]`` of a packed row back to the padded layout ``[n, max_len]``
    (row j = sequence j of the bin, its first ``lengths[j]`` tokens; the rest 0). Differentiable."""
    if packed_values.ndim < 2 or packed_values.shape[0] != 1:
        raise ValueError(f"packed_values must be [1, T, ...], got {tuple(packed_values.shape)}")
    n = len(lengths)
    out = packed_values.new_zeros((n, max_len, *packed_values.shape[2:]))
    for j in range(n):
        start, length = int(cu_seqlens[j]), int(lengths[j])
        if length > max_len or start + length > int(cu_seqlens[j + 1]):
            raise ValueError(f"sequence {j}: length {length} does not fit max_len {max_len} or its packed slot")
        out[j, :length] = packed_values[0, start : start + length]
    return out


def zero_sequence_starts(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``values [1, T]`` of a packed row (e.g. next-token logprobs, which at a sequence's first
    position would condition on the previous sequence) with each sequence's first position set
    to 0: the convention of docs/internals.md, so `unpack` yields the padded layout directly."""
    starts = cu_seqlens[:-1].long().to(values.device)
    return values.index_fill(1, starts[starts < values.shape[1]], 0.0)


# -------------------------------------------------------------------------------- dynamic batching
def dynamic_microbatches(lengths: Lengths, max_tokens: int, round_to: int = 1) -> list[list[int]]:
    """Group rows into padded micro-batches of at most ``max_tokens`` tokens each.

    Rows are sorted by length (longest first, so the largest micro-batch runs first and an
    out-of-memory shows up at once); a group grows while ``round_up(longest, round_to) * rows <=
    max_tokens``. ``round_to`` (default 1; config ``policy.dynamic_batching.sequence_length_round``)
    bounds the number of distinct shapes. Each micro-batch is then truncated to its own longest
    row. Raises ``ValueError`` for a row that alone exceeds the budget.
    """
    sizes = _as_list(lengths)
    groups: list[list[int]] = []
    padded_len = 0
    for i in _decreasing(range(len(sizes)), sizes):
        if groups and padded_len * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
            continue
        padded_len = -(-sizes[i] // round_to) * round_to
        if padded_len > max_tokens:
            raise ValueError(
                f"sequence {i} has {sizes[i]} tokens (rounded to {padded_len}), more than the dynamic batching "
                f"budget of {max_tokens} tokens (policy.dynamic_batching.*_mb_tokens)"
            )
        groups.append([i])
    return groups
