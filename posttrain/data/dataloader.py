"""A resumable, seeded sampler over an in-memory list of datums.

The RL loops draw `num_prompts_per_step` prompts per step. Resuming must continue exactly where
the interrupted run stopped, so the order is a pure function of (seed, epoch) and the state is
just (epoch, position): two integers saved in every checkpoint.
"""

from __future__ import annotations

import random
from typing import Any, Generic, Sequence, TypeVar

T = TypeVar("T")


class ResumableLoader(Generic[T]):
    """Yields batches of `batch_size` items, reshuffling (seeded) at every epoch boundary.

    Args:
        items: the data set (kept in memory; RL prompt sets are small).
        batch_size: items per batch. A batch may span an epoch boundary, so every batch is full.
        shuffle: permute each epoch with `random.Random(seed + epoch)` (default True).
        seed: base seed of the permutation.
    """

    def __init__(self, items: Sequence[T], batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if not items:
            raise ValueError("ResumableLoader got an empty data set")
        self.items = list(items)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[T]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.items[self._order[self.position]])
            self.position += 1
        return batch

    def steps_for_epochs(self, num_epochs: int) -> int:
        """Batches that cover `num_epochs` passes over the data (the last one may spill over)."""
        return -(-num_epochs * len(self.items) // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)
