"""Sharded loading under expert parallelism (`sharded_load.ExpertSliceReader`, `expert_parallel.shard_experts`)
in two gloo processes, without Ray: from the tiny Qwen3-MoE, Mixtral and DeepSeek-V3 checkpoints (one
tensor per expert, Mixtral's `block_sparse_moe` names) and from a checkpoint saved with transformers 5's
fused expert tensors, each EP rank's experts equal the checkpoint's slice exactly, every other tensor
(DeepSeek-V3's routing-bias buffer included) equals the checkpoint's, and each rank read only its own
experts: half of the experts' bytes, no tensor or slice of the other rank's experts."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_collectives import free_ports

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def rank_main(rank: int, port: int, paths: dict[str, str], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from posttrain.models.hf import load_causal_lm
    from posttrain.models.policy import expert_parallel as ep
    from posttrain.models.policy import sharded_load

    mesh = ep.build_mesh("cpu", 2, 2)
    out = {}
    for label, path in paths.items():
        model = sharded_load.empty_causal_lm(path)
        files = sharded_load.safetensors_files(path)
        model_type = model.config.model_type
        experts = ep.expert_weight_names(model)
        sharded_load.fill_from_safetensors(model, files, skip=experts,
                                           names=sharded_load.checkpoint_names(files, model_type))
        reader = sharded_load.ExpertSliceReader(files, model_type)
        params = ep.shard_experts(model, mesh["ep"], reader)
        reference = load_causal_lm(path)
        full = reference.state_dict()
        unequal = []
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                want = full[name][rank * local.shape[0]:(rank + 1) * local.shape[0]]
            else:
                local, want = tensor, full[name]
            if local.dtype != want.dtype or not torch.equal(local, want):
                unequal.append(name)
        out[label] = dict(unequal=unequal, experts=len(experts), params=len(params), reads=reader.reads,
                          bytes_read=reader.bytes_read, local=model.config.to_dict().get("num_experts")
                          or model.config.to_dict().get("num_local_experts") or model.config.n_routed_experts)
    dist.destroy_process_group()
    results[rank] = out


def fused_checkpoint(source: str, target: str) -> str:
    """`source`'s model saved with the model's own (fused expert) tensor names, as one safetensors file."""
    from safetensors.torch import save_file

    from posttrain.models.hf import load_causal_lm

    os.makedirs(target)
    shutil.copy(os.path.join(source, "config.json"), target)
    model = load_causal_lm(source)
    state = {name: t.clone() for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied
    save_file(state, os.path.join(target, "model.safetensors"))
    return target


def expert_bytes(path: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys() if ".experts." in k) * 4  # float32


@pytest.mark.timeout(600)
def test_ep2_ranks_read_only_their_experts_and_equal_the_checkpoint(tmp_path):
    from posttrain.models.hf import resolve_model_path

    paths = {arch: resolve_model_path(f"tiny-{arch}") for arch in ARCHS}
    paths["qwen3_moe fused"] = fused_checkpoint(paths["qwen3_moe"], str(tmp_path / "fused"))
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_ports(1)[0], paths, results), nprocs=2, join=True)
    for label, path in paths.items():
        total = expert_bytes(path)
        for rank in (0, 1):
            r = results[rank][label]
            assert r["unequal"] == [], (label, rank)
            assert r["params"] == r["experts"] >= 2, label
            assert r["bytes_read"] * 2 == total, (label, rank)  # half of the experts' bytes
            local = r["local"] // 2
            own = range(rank * local, (rank + 1) * local)
            for key, start, stop in r["reads"]:
                if start is None:  # one expert's tensor
                    assert int(EXPERT_KEY.search(key).group(1)) in own, (label, rank, key)
                else:  # a slice of a fused tensor
                    assert (start, stop) == (own.start, own.stop), (label, rank, key)
            if label.endswith("fused"):
                assert all(start is not None for _, start, _ in r["reads"]) and len(r["reads"]) == r["experts"]
