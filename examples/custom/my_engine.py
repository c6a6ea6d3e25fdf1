"""A generation backend of your own (docs/extending.md, "A generation backend"): the native engine,
counting the tokens it writes. Picked by `policy.generation.backend: my_engine:CountingGeneration`."""

from posttrain.models.generation.native import NativeGeneration


class CountingGeneration(NativeGeneration):
    """`NativeGeneration` that counts the tokens it generates (`self.tokens`)."""

    def __init__(self, cluster, spec, **placement):  # spec: GenerationSpec (model, policy.generation, seed, ...)
        super().__init__(cluster, spec, **placement)
        self.tokens = 0

    def generate_shards(self, batch, greedy=False, params=None):
        # The rollouts call this one; `generate` (the whole batch at once) is the other entry point.
        for rows, out in super().generate_shards(batch, greedy=greedy, params=params):
            self.tokens += int(out["generation_lengths"].sum())
            yield rows, out
