"""A stand-in generation engine for rollout tests: every row gets one token (id 20), returned in
`shards` slices the way `num_shards` generation workers would return theirs."""

from __future__ import annotations

import torch

from posttrain.distributed.batch import Batch


class OneTokenGeneration:
    def __init__(self, shards: int = 1):
        self.shards = shards

    def prepare_for_generation(self):
        return True

    def finish_generation(self):
        return True

    def generate_shards(self, batch, greedy=False, params=None):
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        out = torch.cat([ids, torch.zeros(ids.shape[0], 1, dtype=torch.long)], dim=1)
        for row, n in enumerate(lengths.tolist()):
            out[row, n] = 20
        b = ids.shape[0]
        full = Batch(output_ids=out, generation_lengths=torch.ones(b, dtype=torch.long),
                     logprobs=torch.zeros(out.shape), truncated=torch.zeros(b, dtype=torch.bool))
        for rows in torch.arange(b).tensor_split(self.shards):
            yield rows.tolist(), full.select(rows)
