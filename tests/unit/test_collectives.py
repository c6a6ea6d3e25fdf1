"""Collectives go through `posttrain.distributed.collective`, which keeps them device-correct.

On GPUs NCCL refuses CPU tensors, and the policy worker all-reduces small CPU tensors (counts,
flags, metric sums): a multi-GPU run crashed on its first step while every CPU test passed. Here a
process-group backend that, like NCCL, serves only CUDA tensors stands in for it, so the CPU
machine sees the same refusal, and the module's groups must carry CPU tensors anyway.
"""

from __future__ import annotations

import ast
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.distributed import collective

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "all_to_all",
    "all_to_all_single", "init_process_group", "new_group",
}


def distributed_calls(path: Path) -> list[str]:
    """`dist.X(...)` / `torch.distributed.X(...)` collectives called, and names imported from torch.distributed."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name in COLLECTIVES]
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in aliases:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {owner}.{node.func.attr}")
    return found


def test_no_collective_is_called_outside_the_collective_module():
    calls = [c for path in sorted(PACKAGE.rglob("*.py")) if path.name != "collective.py"
             for c in distributed_calls(path)]
    assert calls == [], "call these through posttrain.distributed.collective:\n" + "\n".join(calls)


def test_the_backend_has_a_cpu_half_wherever_it_has_an_accelerator_half():
    assert collective.process_group_backend("cpu") == "gloo"
    assert collective.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"


def test_a_tensor_runs_where_the_group_has_a_backend_for_it():
    cpu = torch.device("cpu")
    assert collective.collective_device(cpu, ["cpu", "cuda"]) == cpu
    assert collective.collective_device(cpu, ["cpu"]) == cpu


def test_without_a_process_group_collectives_are_identities():
    tensor = torch.tensor([3.0])
    assert collective.all_reduce(tensor, "max") is tensor and tensor.tolist() == [3.0]
    assert collective.all_gather_object({"a": 1}) == [{"a": 1}]
    collective.barrier()


def cuda_only_gloo(store, rank, size, timeout):
    """Gloo registered for CUDA tensors only: a backend that refuses CPU tensors, like NCCL."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def free_ports(count: int) -> tuple[int, ...]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = tuple(s.getsockname()[1] for s in sockets)
    for s in sockets:
        s.close()
    return ports


def rank_main(rank: int, ports: tuple[int, int], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.Backend.register_backend("cudaonly", cuda_only_gloo, devices=["cuda"])
    out = {}
    # What the workers did before: a GPU group of the accelerator's backend alone.
    dist.init_process_group("cudaonly", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        dist.all_reduce(torch.ones(1))
        out["accelerator_only"] = "accepted"
    except RuntimeError as error:
        out["accelerator_only"] = str(error)
    dist.destroy_process_group()
    # The module's GPU group, with the stand-in in NCCL's place (a fresh rendezvous port).
    os.environ["MASTER_PORT"] = str(ports[1])
    collective.init_worker_process_group("cuda", rank, 2, 120.0, accelerator_backend="cudaonly")
    out["devices"] = collective.backend_devices()
    out["sum"] = collective.all_reduce(torch.tensor([rank + 1.0, 10.0], dtype=torch.float64)).tolist()
    out["max"] = collective.all_reduce(torch.tensor([rank], dtype=torch.long), "max").tolist()
    out["min"] = collective.all_reduce(torch.tensor([rank + 5.0]), "min").tolist()
    out["objects"] = collective.all_gather_object(f"rank{rank}")
    collective.barrier()
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.timeout(300)
def test_control_plane_collectives_on_cpu_tensors_work_in_a_gpu_shaped_group():
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_ports(2), results), nprocs=2, join=True)
    for rank in (0, 1):
        out = results[rank]
        assert "No backend type associated with device type cpu" in out["accelerator_only"]
        assert out["devices"] == ["cpu", "cuda"]
        assert out["sum"] == [3.0, 20.0] and out["max"] == [1] and out["min"] == [5.0]
        assert out["objects"] == ["rank0", "rank1"]
