"""`Batch`: the dict of per-sample data that crosses module and Ray boundaries.

A `Batch` maps names to either tensors whose first dimension is the batch size `B`
(`input_ids [B, S]`, `rewards [B]`, ...) or Python lists of length `B` (message logs, answers,
metadata). Every operation works row-wise on all entries at once, so the sample at row *i*
stays together whatever we do (shard across ranks, repeat per generation, cut into
micro-batches). It is a plain `dict` subclass and pickles as one, which is what Ray needs.

Modelled on NeMo-RL's `BatchedDataDict`, with a smaller surface (see docs/internals.md).
"""

from __future__ import annotations

import copy as _copy
from typing import Any, Iterator, Mapping, Sequence, Union

import torch

Indices = Union[Sequence[int], torch.Tensor]


class Batch(dict):
    """Dict of `str -> Tensor[B, ...] | list (len B)`; every entry has the same `B`.

    Sizes are checked whenever an entry is set, so a mismatch fails where it is made, with
    the offending key named.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    # ------------------------------------------------------------------ validation / size
    def __setitem__(self, key: str, value: Any) -> None:
        rows = _rows(key, value)
        for other_key, other in self.items():
            if other_key != key:
                other_rows = _rows(other_key, other)
                if rows != other_rows:
                    raise ValueError(
                        f"Batch entry {key!r} has {rows} rows but {other_key!r} has {other_rows}; "
                        "all entries of a Batch must share the batch size (dim 0 / list length)."
                    )
                break  # every existing entry already agrees with this one
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # route through __setitem__ checks
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __reduce__(self):  # pickle as (class, plain dict) so unpickling revalidates once
        return (type(self), (dict(self),))

    @property
    def size(self) -> int:
        """Batch size `B` (0 for an empty Batch)."""
        for key, value in self.items():
            return _rows(key, value)
        return 0

    # ------------------------------------------------------------------ building
    @classmethod
    def cat(cls, batches: Sequence["Batch"], pad_values: Mapping[str, Any] | None = None) -> "Batch":
        """Concatenate along dim 0, right-padding dim 1 of tensors with 2+ dims to the longest.

        Args:
            batches: batches with the same keys.
            pad_values: pad value per key (default 0 for every key), e.g.
                `{"input_ids": tokenizer.pad_token_id}`.
        """
        batches = [b for b in batches]
        if not batches:
            raise ValueError("Batch.cat needs at least one batch")
        pad_values = pad_values or {}
        keys = list(batches[0].keys())
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(keys):
                missing = sorted(set(keys) ^ set(batch.keys()))
                raise KeyError(
                    f"Batch.cat: batch {i} has keys {sorted(batch.keys())}, batch 0 has {sorted(keys)} "
                    f"(differing: {missing})"
                )
        out = cls()
        for key in keys:
            values = [b[key] for b in batches]
            if isinstance(values[0], torch.Tensor):
                if not all(isinstance(v, torch.Tensor) and v.ndim == values[0].ndim for v in values):
                    raise TypeError(f"Batch.cat: entry {key!r} mixes tensors of different ndim or lists")
                if values[0].ndim >= 2:
                    longest = max(v.shape[1] for v in values)
                    pad = pad_values.get(key, 0)
                    values = [_pad_dim1(v, longest, pad) for v in values]
                out[key] = torch.cat(values, dim=0)
            else:
                out[key] = [item for v in values for item in v]
        return out

    # ------------------------------------------------------------------ row operations
    def select(self, indices: Indices) -> "Batch":
        """Rows `indices` (ints or a bool mask of length B), in that order."""
        index = torch.as_tensor(indices)
        if index.dtype == torch.bool:
            if index.numel() != self.size:
                raise ValueError(f"select: bool mask has {index.numel()} entries, batch has {self.size} rows")
            index = index.nonzero().flatten()
        index = index.long().flatten()
        if index.numel() and (index.min() < -self.size or index.max() >= self.size):
            raise IndexError(f"select: indices out of range for a batch of {self.size} rows")
        rows = index.tolist()
        return type(self)(
            {k: v[index.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in rows] for k, v in self.items()}
        )

    def repeat_interleave(self, n: int) -> "Batch":
        """Repeat every row `n` times in place: rows [a, b] -> [a, a, b, b] for n=2.

        List items are deep-copied so each repeat is independent (rollouts append turns to
        message logs; shared references would leak one generation's turns into another).
        """
        if n < 1:
            raise ValueError(f"repeat_interleave: n must be >= 1, got {n}")
        return type(self)(
            {
                k: v.repeat_interleave(n, dim=0)
                if isinstance(v, torch.Tensor)
                else [_copy.deepcopy(item) for item in v for _ in range(n)]
                for k, v in self.items()
            }
        )

    def _slice(self, start: int, stop: int) -> "Batch":
        return type(self)({k: v[start:stop] for k, v in self.items()})

    def shard(self, n: int) -> list["Batch"]:
        """Split into `n` contiguous shards whose sizes differ by at most 1 (earlier ones larger).

        Shards may be empty when `B < n`; concatenating the shards gives back the batch.
        """
        if n < 1:
            raise ValueError(f"shard: n must be >= 1, got {n}")
        base, extra = divmod(self.size, n)
        shards, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            shards.append(self._slice(start, stop))
            start = stop
        return shards

    def chunk(self, size: int) -> list["Batch"]:
        """Consecutive pieces of `size` rows; the last one may be smaller."""
        return list(self.microbatches(size))

    def microbatches(self, size: int) -> Iterator["Batch"]:
        """Iterate over consecutive pieces of `size` rows (the last one may be smaller)."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        for start in range(0, self.size, size):
            yield self._slice(start, start + size)

    # ------------------------------------------------------------------ tensor operations
    def to(self, device: torch.device | str) -> "Batch":
        """Move every tensor to `device` (lists are kept as they are)."""
        return type(self)({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    def truncate(self, max_len: int) -> "Batch":
        """Cut dim 1 of every tensor with 2+ dims (the sequence tensors) to `max_len`."""
        return type(self)(
            {k: v[:, :max_len] if isinstance(v, torch.Tensor) and v.ndim >= 2 else v for k, v in self.items()}
        )

    def copy(self) -> "Batch":
        """Shallow copy: a new Batch with new lists but the same tensor objects."""
        return type(self)({k: list(v) if isinstance(v, list) else v for k, v in self.items()})


def _rows(key: str, value: Any) -> int:
    """Number of rows of one entry, with a clear error for values a Batch cannot hold."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise ValueError(f"Batch entry {key!r} is a 0-dim tensor; entries need a batch dim (use shape [B])")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(
        f"Batch entry {key!r} must be a torch.Tensor [B, ...] or a list of length B, got {type(value).__name__}"
    )


def _pad_dim1(tensor: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """Right-pad dim 1 of `tensor` to `length` with `value` (any dtype, bool included)."""
    if tensor.shape[1] == length:
        return tensor
    padded = tensor.new_full((tensor.shape[0], length, *tensor.shape[2:]), value)
    padded[:, : tensor.shape[1]] = tensor
    return padded
