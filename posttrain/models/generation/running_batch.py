"""The rows a decoder runs during one `NativeGenerationEngine.generate` call, with continuous batching.

A call may hold more rows than the decoder runs at once (`max_running_rows`, the worker's
`policy.generation.batch_size`). The decoder then starts with the first of them; as running rows
finish, they leave its batch (`LlamaLikeDecoder.keep_rows`) and the rows still waiting take their
places (`LlamaLikeDecoder.admit`, after a prefill of their prompts), so each decode step stays full
instead of running on with the few rows that generate longest. Static batches spend a decode step's
cost, which on a CPU is mostly reading every weight once, on ever fewer rows: in the nemotron_mini
recipe's validation half the steps had 8 rows or fewer, at 60-70 ms each against 106 ms for 32.

Every row counts its own tokens (`steps`), so its random stream (`sampling.counter_uniform`), stop
checks and budget are its own, whenever it was admitted: in float32 its tokens are those of one batch
of all rows (in 16 bits another batch rounds differently, as any change of batch does). The engine
admits the longest prompts first: rows of similar length then prefill together, with less padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RunningBatch:
    """The decoder's slots (its batch rows, in order) and the rows waiting for one.

    Slot i decodes original row `slot_rows[i]`, which has generated `steps[i]` tokens in this call and
    feeds its next token at position `positions[i]`; `generating[i]` is False once the row finished (it
    may stay in the decoder's batch a while, fed padding, its outputs ignored).
    """

    slot_rows: torch.Tensor  # [slots] int64
    steps: torch.Tensor  # [slots] int64
    positions: torch.Tensor  # [slots] int64
    generating: torch.Tensor  # [slots] bool
    waiting: torch.Tensor  # original rows not admitted yet, in order
    max_running_rows: int
    num_finished: int = 0  # slots whose row finished

    @classmethod
    def empty(cls, order: torch.Tensor, max_running_rows: int) -> "RunningBatch":
        """No slot taken yet; the rows `order` wait, to be admitted in that order."""
        none = order.new_zeros(0)
        return cls(none, none, none, none.bool(), order, max_running_rows)

    @property
    def size(self) -> int:
        return self.slot_rows.numel()

    def take_waiting(self) -> torch.Tensor:
        """The waiting rows that fit in the free slots, removed from the queue."""
        count = max(0, self.max_running_rows - self.size)
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        return taken

    def add(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Admitted `rows` take the next slots; their first tokens go at `positions`."""
        self.slot_rows = torch.cat([self.slot_rows, rows])
        self.steps = torch.cat([self.steps, torch.zeros_like(rows)])
        self.positions = torch.cat([self.positions, positions])
        self.generating = torch.cat([self.generating, torch.ones_like(rows, dtype=torch.bool)])

    def live(self) -> Optional[torch.Tensor]:
        """The slots still generating, or None when all are (the common case, without an index)."""
        return self.generating.nonzero().squeeze(1) if self.num_finished else None

    def advance(self, live: Optional[torch.Tensor], tokens: torch.Tensor, finished: torch.Tensor,
                pad_token_id: int) -> torch.Tensor:
        """Count the token the `live` slots just generated (`tokens`), mark the `finished` ones; returns
        the next step's input, one token per slot (padding for slots whose row finished earlier)."""
        if live is None:
            self.steps += 1
            fed = tokens
        else:
            self.steps[live] += 1
            fed = torch.full_like(self.slot_rows, pad_token_id)
            fed[live] = tokens
        if finished.any():
            self.generating[finished.nonzero().squeeze(1) if live is None else live[finished]] = False
            self.num_finished = int((~self.generating).sum())
        return fed

    @property
    def done(self) -> bool:
        return self.num_finished == self.size and not self.waiting.numel()

    def keep(self, keep: torch.Tensor) -> None:
        """Only the slots `keep` stay, moved to the front (as the decoder's `keep_rows`)."""
        self.slot_rows, self.steps = self.slot_rows[keep], self.steps[keep]
        self.positions, self.generating = self.positions[keep], self.generating[keep]
        self.num_finished = int((~self.generating).sum())
