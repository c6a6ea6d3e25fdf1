"""Refit speed between two Ray actors on one node, against the speed of light and a naive path.

For each model size, a sender actor holds the policy weights and a receiver actor holds a model
with other weights. Measured in one run (best of `--repeats`, after a warm-up):

- packed: sender `refit.pack`s into uint8 buffers (returned through the object store), receiver
  `load_packed`s them (zero-copy `ray.get`, one copy into its parameters);
- naive: one `ray.put` per tensor on the sender, one `ray.get` + copy per tensor on the receiver;
- memcpy: one `Tensor.copy_` of a contiguous buffer of the same total bytes, in one process (the
  speed of light for moving those bytes once).

Prints packed / memcpy (how many memcpys a refit costs; the packed path copies each byte three
times, see `posttrain/models/refit.py`) and naive / packed. Each refit is checked bit-exact.

    python benchmarks/refit.py --models tiny 100m
"""

from __future__ import annotations

import argparse
import time

import ray
import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from baselines import naive_load_state_dict, naive_put_state_dict
from bench_timing import best_seconds

from posttrain.distributed.ray_utils import init_ray
from posttrain.models.refit import load_packed, pack, refit_metadata_from_state_dict, state_dict_checksum
from posttrain.models.tiny import make_tiny_model


def build_model(preset: str, seed: int) -> torch.nn.Module:
    return make_tiny_model(preset, "llama", seed=seed)[0]


@ray.remote(num_cpus=1)
class Sender:
    def __init__(self, preset: str, bucket_bytes: int):
        torch.set_num_threads(1)
        self.state = build_model(preset, seed=1).state_dict()
        self.metadata = refit_metadata_from_state_dict(self.state, bucket_bytes)

    def metadata_and_checksum(self):
        return self.metadata, state_dict_checksum(self.state)

    def pack(self):
        return pack(self.state, self.metadata)

    def naive_put(self):
        return naive_put_state_dict(self.state)


@ray.remote(num_cpus=1)
class Receiver:
    def __init__(self, preset: str):
        torch.set_num_threads(1)
        self.model = build_model(preset, seed=2)

    def load_packed(self, buffers, metadata) -> float:
        load_packed(self.model, buffers, metadata)
        return time.perf_counter()

    def naive_load(self, refs) -> float:
        naive_load_state_dict(self.model, refs)
        return time.perf_counter()

    def checksum(self) -> str:
        return state_dict_checksum(self.model.state_dict())


def bench(preset: str, bucket_bytes: int, repeats: int) -> None:
    sender, receiver = Sender.remote(preset, bucket_bytes), Receiver.remote(preset)
    metadata, expected = ray.get(sender.metadata_and_checksum.remote())
    metadata_ref = ray.put(metadata)
    total = metadata.total_bytes

    def packed_refit():
        buffers_ref = sender.pack.remote()  # the policy's rank 0 returning `pack(...)`
        ray.get(receiver.load_packed.remote(buffers_ref, metadata_ref))

    def naive_refit():
        refs = ray.get(sender.naive_put.remote())
        ray.get(receiver.naive_load.remote(refs))

    packed_s = best_seconds(packed_refit, repeats)
    assert ray.get(receiver.checksum.remote()) == expected, "packed refit is not bit-exact"
    naive_s = best_seconds(naive_refit, repeats)
    assert ray.get(receiver.checksum.remote()) == expected, "naive refit is not bit-exact"

    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    memcpy_s = best_seconds(lambda: dst.copy_(src), repeats)

    print(
        f"{preset:6s} {len(metadata.slots):7d} {total / 2**20:9.1f} {len(metadata.bucket_sizes):8d} "
        f"{memcpy_s * 1e3:10.2f} {packed_s * 1e3:10.1f} {naive_s * 1e3:10.1f} "
        f"{packed_s / memcpy_s:13.1f} {naive_s / packed_s:13.2f}"
    )
    ray.kill(sender)
    ray.kill(receiver)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], help="posttrain.models.tiny presets")
    parser.add_argument("--bucket-mb", type=int, default=512, help="refit bucket size (policy.refit_buffer_size_gb)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_ray(num_cpus=4, env_vars={"OMP_NUM_THREADS": "1"})
    print(
        f"{'model':6s} {'tensors':>7s} {'MiB':>9s} {'buffers':>8s} {'memcpy ms':>10s} {'packed ms':>10s} "
        f"{'naive ms':>10s} {'packed/memcpy':>13s} {'naive/packed':>13s}"
    )
    for preset in args.models:
        bench(preset, args.bucket_mb * 2**20, args.repeats)


if __name__ == "__main__":
    main()
