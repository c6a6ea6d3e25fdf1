"""A generation backend of a user's own, picked by `policy.generation.backend: <this file>:Class`
in the tests: the native backend, recording every batch it generates."""

from __future__ import annotations

from posttrain.models.generation.native import NativeGeneration


class RecordingGeneration(NativeGeneration):
    """Native generation that records `(rows, greedy)` of every batch it is asked for."""

    def __init__(self, cluster, spec, **placement):
        super().__init__(cluster, spec, **placement)
        self.requests: list[tuple[int, bool]] = []

    def generate_shards(self, batch, greedy=False, params=None):
        self.requests.append((batch.size, greedy))
        yield from super().generate_shards(batch, greedy=greedy, params=params)

    def generate(self, batch, greedy=False, params=None):
        self.requests.append((batch.size, greedy))
        return super().generate(batch, greedy=greedy, params=params)


class NotABackend:
    """A class that is no GenerationInterface: preflight refuses it."""
