"""A resumable, seeded sampler over an in-memory list of datums.

The RL loops draw `num_prompts_per_step` prompts per step. Resuming must continue exactly where
the interrupted run stopped, so the order is a pure function of (seed, epoch) and the state is
just (epoch, position): two integers saved in every checkpoint.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class LazyDatums(Sequence):
    """Datums made from records when first read (then kept): a training split of many prompts is
    not tokenised at start-up, only the prompts the run draws. Records are checked for what every
    datum needs when they are loaded (`datasets.load_records`), so a bad row still fails at start.

    Args:
        records: the split's records (`{"prompt", "answer", "task_name", "env_name", ...}`).
        build: `build(record, index) -> datum` (a processor with its settings bound).
    """

    def __init__(self, records: Sequence[dict], build: Callable[[dict, int], Any]):
        self.records = records
        self._build = build
        self._datums: list[Any] = [None] * len(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        datum = self._datums[index]
        if datum is None:
            datum = self._datums[index] = self._build(self.records[index], index)
        return datum


def routes(datums: Sequence[Any]) -> list[tuple[str, str]]:
    """`(task_name, env_name)` of each datum, read from the records of `LazyDatums` without
    building them."""
    if isinstance(datums, LazyDatums):
        return [(r["task_name"], r["env_name"]) for r in datums.records]
    return [(d["task_name"], d["env_name"]) if isinstance(d, dict) else (d.task_name, d.env_name) for d in datums]


def _source(items: Sequence[Any], index: int) -> tuple[Any, float]:
    """A datum's blend source and its weight (from the record for `LazyDatums`)."""
    item = items.records[index] if isinstance(items, LazyDatums) else items[index]
    if isinstance(item, dict):  # a record, or an example dict
        return item.get("source"), float(item.get("source_weight", 1.0))
    return item.source, item.source_weight


class _Subset(Sequence):
    """`items[indices[i]]`, read through (a blend source's share of a lazy split)."""

    def __init__(self, items: Sequence[Any], indices: list[int]):
        self.items, self.indices = items, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.items[self.indices[i]]


class ResumableLoader(Generic[T]):
    """Yields batches of `batch_size` items, reshuffling (seeded) at every epoch boundary.

    Args:
        items: the data set (any sequence, read by index: `LazyDatums` builds only what is drawn).
        batch_size: items per batch. A batch may span an epoch boundary, so every batch is full.
        shuffle: permute each epoch with `random.Random(seed + epoch)` (default True).
        seed: base seed of the permutation.
    """

    def __init__(self, items: Sequence[T], batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if not items:
            raise ValueError("ResumableLoader got an empty data set")
        self.items = items if isinstance(items, Sequence) else list(items)
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


class BlendedLoader:
    """Batches drawn from several sources by weight: each item of a batch comes from source s with
    probability `weights[s] / sum(weights)`; within a source, items follow that source's own
    `ResumableLoader` (reshuffled per epoch). The draw of batch b depends only on (seed, b), so
    the state is the batch counter plus each source's (epoch, position).

    Args:
        sources: source name -> its items (each non-empty).
        weights: source name -> weight > 0.
        batch_size, shuffle, seed: as `ResumableLoader`.
    """

    def __init__(self, sources: dict[str, Sequence[T]], weights: dict[str, float], batch_size: int, *,
                 shuffle: bool = True, seed: int = 0):
        if not sources:
            raise ValueError("BlendedLoader needs at least one source")
        self.names = sorted(sources)
        self.weights = [float(weights[name]) for name in self.names]
        self.loaders = {
            name: ResumableLoader(sources[name], 1, shuffle=shuffle, seed=seed + 7919 * i)
            for i, name in enumerate(self.names)
        }
        self.batch_size = batch_size
        self.seed = seed
        self.num_batches = 0
        self.total_items = sum(len(items) for items in sources.values())

    def next_batch(self) -> list[T]:
        rng = random.Random(self.seed * 1_000_003 + self.num_batches)
        picks = rng.choices(self.names, weights=self.weights, k=self.batch_size)
        self.num_batches += 1
        return [self.loaders[name].next_batch()[0] for name in picks]

    def steps_for_epochs(self, num_epochs: int) -> int:
        """Batches that draw as many items as `num_epochs` passes over all sources hold."""
        return -(-num_epochs * self.total_items // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"num_batches": self.num_batches, "seed": self.seed,
                "sources": {name: loader.state_dict() for name, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_batches = state["num_batches"]
        self.seed = state["seed"]
        for name, loader_state in state["sources"].items():
            if name in self.loaders:
                self.loaders[name].load_state_dict(loader_state)


def make_loader(items: Sequence[Any], batch_size: int, *, shuffle: bool = True, seed: int = 0):
    """A `BlendedLoader` over the items' `source`s (weights `source_weight`) when they come from
    several sources (a data blend or several reasoning-gym tasks), else a `ResumableLoader`."""
    indices: dict[str, list[int]] = {}
    weights: dict[str, float] = {}
    for i in range(len(items)):  # `Sample`s, example dicts, or `LazyDatums` (read from the records)
        name, weight = _source(items, i)
        indices.setdefault(name, []).append(i)
        if name is not None:
            weights[name] = weight
    if len(indices) < 2 or None in indices:
        return ResumableLoader(items, batch_size, shuffle=shuffle, seed=seed)
    sources = {name: _Subset(items, rows) for name, rows in indices.items()}
    return BlendedLoader(sources, weights, batch_size, shuffle=shuffle, seed=seed)
