"""Sequence parallelism keeps less for the backward pass than tensor parallelism alone
(`models/policy/parallel.py`), with two real gloo processes on CPU and the worker's own sharding
(`shard_model`: TP plan, then FSDP2) and forward (`microbatch_logprobs`).

What is measured is exact, not timed: the bytes of every distinct storage autograd saves during
one forward pass (`torch.autograd.graph.saved_tensors_hooks`), on each rank. Under SP the residual
stream and the norms hold half of the sequence; the attention and MLP blocks gather it once each.
Gathering it per projection instead (q, k and v each, as `ColwiseParallel(input_layouts=Shard(1))`
does) kept three full copies and saved more than TP without SP.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest

from test_collectives import free_ports

ROWS, WIDTH = 2, 128  # tokens per row: a multiple of tp, so SP needs no padding


def saved_bytes(run) -> tuple[int, object]:
    """(bytes of the distinct storages autograd keeps for the backward pass while `run()` runs,
    parameters aside; its result). Saved-tensor hooks nest (the innermost wins), and SP's blocks
    install their own, so every hooks object made meanwhile counts what its pack keeps: a tensor,
    or the slice a `_Regather` keeps in place of the whole gathered input."""
    from torch.distributed.tensor import DTensor

    from posttrain.models.policy.sequence_parallel import _Regather

    storages: dict[int, torch.UntypedStorage] = {}
    real = torch.autograd.graph.saved_tensors_hooks

    def record(saved, packed) -> None:
        if isinstance(packed, _Regather):
            packed = packed.kept()
        elif saved.is_leaf and saved.requires_grad:
            return  # a parameter (FSDP's unsharded one): the same under both plans, not an activation
        local = packed._local_tensor if isinstance(packed, DTensor) else packed
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage  # held, so that no address is reused meanwhile

    class Counting(real):
        def __init__(self, pack, unpack):
            def counted(saved):
                packed = pack(saved)
                record(saved, packed)
                return packed
            super().__init__(counted, unpack)

    torch.autograd.graph.saved_tensors_hooks = Counting
    try:
        with Counting(lambda t: t, lambda t: t):
            result = run()
    finally:
        torch.autograd.graph.saved_tensors_hooks = real
    return sum(storage.nbytes() for storage in storages.values()), result


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from posttrain.distributed.batch import Batch
    from posttrain.models.hf import load_causal_lm
    from posttrain.models.policy import parallel
    from posttrain.models.policy.forward import MicroBatch, microbatch_logprobs

    g = torch.Generator().manual_seed(0)
    rows = Batch(input_ids=torch.randint(3, 100, (ROWS, WIDTH), generator=g),
                 input_lengths=torch.full((ROWS,), WIDTH))
    weights = torch.randn(ROWS, WIDTH, generator=g)
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm("tiny")
        dp_mesh, tp_mesh = parallel.build_mesh("cpu", 2, 2)
        parallel.shard_model(model, dp_mesh, tp_mesh, sequence_parallel=sp)
        mb = MicroBatch(rows, torch.arange(ROWS))
        nbytes, logprobs = saved_bytes(lambda: microbatch_logprobs(model, mb, torch.device("cpu"), torch.float32))
        (logprobs * weights).sum().backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.full_tensor()
        out[sp] = {"saved": nbytes, "logprobs": logprobs.detach(), "grad": grad,
                   "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size}
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.timeout(600)
def test_sequence_parallel_saves_less_than_tensor_parallel_alone_with_the_same_values():
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_ports(1)[0], results), nprocs=2, join=True)
    for rank in (0, 1):
        tp, sp = results[rank][False], results[rank][True]
        print(f"rank {rank}: saved for backward, tp=2 {tp['saved']} B, tp=2 + SP {sp['saved']} B")
        torch.testing.assert_close(sp["logprobs"], tp["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sp["grad"], tp["grad"], rtol=1e-4, atol=1e-6)
        # Each layer keeps half of six [rows, width, hidden] float32 tensors: each of its two RMSNorms'
        # input and normalised input, and each of its two blocks' gathered input (kept as the rank's
        # slice, gathered again in backward; kept whole, the saving is four halves, measured).
        halves = tp["layers"] * 6 * ROWS * WIDTH * tp["hidden"] * 4 // 2
        assert tp["saved"] - sp["saved"] >= halves, (tp["saved"], sp["saved"], halves)
