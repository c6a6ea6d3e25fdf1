"""The two generation backends side by side in one run: the native engine and vLLM (in its
isolated environment), each as one Ray generation worker on the same model, plus refit time into
each from a real policy worker.

For each model: generated tokens per second for the same batch of random prompts (greedy and
sampled; each backend's own generated tokens, up to and including end-of-sequence), the start-up
time of the generation worker, and the time of one refit (the policy packs its weights, the
engine loads them) into each backend. Ratios are vLLM / native.

    ./run.sh python benchmarks/generation_backends.py                       # tiny and 100m
    ./run.sh python benchmarks/generation_backends.py --models tiny --batch 32 --new-tokens 64

The first run builds vLLM's environment (see docs/generation.md); both backends get the
same CPU bundle size (`cluster.cpus_per_worker`), one backend at a time, so neither competes with
the other for cores.
"""

from __future__ import annotations

import argparse
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from bench_timing import best_seconds

from posttrain.config.loader import load_config
from posttrain.distributed.batch import Batch
from posttrain.distributed.ray_utils import init_ray
from posttrain.job import make_cluster, make_generation, make_policy
from posttrain.models.refit import build_refit_metadata, refit_policy_generation


def prompts(batch: int, prompt_len: int, vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=generator)
    ids = torch.randint(7, vocab, (batch, prompt_len), generator=generator)
    ids = ids.masked_fill(torch.arange(prompt_len)[None, :] >= lengths[:, None], 0)
    return Batch(input_ids=ids, input_lengths=lengths, seeds=torch.arange(batch))


def measure(model: str, backend: str, args) -> dict[str, float]:
    cfg = load_config("grpo", overrides=[
        "sft_warmup=null", f"policy.model_name={model}", "policy.precision=float32",
        f"policy.generation.backend={backend}", f"policy.generation.max_new_tokens={args.new_tokens}",
        "policy.generation.temperature=1.0", "policy.generation.colocated.enabled=false",
        f"policy.max_total_sequence_length={args.prompt_len + args.new_tokens + 1}",
        f"cluster.cpus_per_worker={args.cpus}",
    ])
    policy_cluster = make_cluster(cfg, 1, name=f"bench-policy-{backend}")
    gen_cluster = make_cluster(cfg, 1, name=f"bench-generation-{backend}")
    policy = generation = None
    try:
        policy = make_policy(cfg, policy_cluster)
        started = time.perf_counter()
        generation = make_generation(cfg, gen_cluster)
        startup = time.perf_counter() - started
        metadata = build_refit_metadata(policy.refit_info(), policy.refit_bucket_bytes(),
                                        dtypes=generation.weight_dtypes())
        generation.prepare_refit_info(metadata)
        batch = prompts(args.batch, args.prompt_len, args.vocab)
        results = {"startup_s": startup}
        for mode, greedy in (("greedy", True), ("sampled", False)):
            out = generation.generate(batch, greedy=greedy)
            tokens = float(out["generation_lengths"].sum())
            seconds = best_seconds(lambda: generation.generate(batch, greedy=greedy), args.repeats)
            results[f"{mode}_tok_s"] = tokens / seconds
        version = iter(range(1, 1000))
        results["refit_s"] = best_seconds(
            lambda: refit_policy_generation(policy, generation, metadata, version=next(version)), args.repeats)
        return results
    finally:
        for part in (generation, policy, gen_cluster, policy_cluster):
            if part is not None:
                part.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], help="presets or HF directories")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=90, help="prompt token ids are drawn below this")
    parser.add_argument("--cpus", type=float, default=1.0, help="CPUs per worker bundle (cluster.cpus_per_worker)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    init_ray()

    rows = []
    for model in args.models:
        native = measure(model, "native", args)
        vllm = measure(model, "vllm", args)
        rows.append((model, native, vllm))

    print(f"\nbatch {args.batch}, prompts up to {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{args.cpus:g} CPU per worker, best of {args.repeats}")
    header = f"{'model':8} {'backend':8} {'start s':>8} {'greedy tok/s':>13} {'sampled tok/s':>14} {'refit s':>9}"
    print(header)
    for model, native, vllm in rows:
        for name, r in (("native", native), ("vllm", vllm)):
            print(f"{model:8} {name:8} {r['startup_s']:8.1f} {r['greedy_tok_s']:13.0f} {r['sampled_tok_s']:14.0f} "
                  f"{r['refit_s']:9.3f}")
        print(f"{model:8} {'ratio':8} {vllm['startup_s'] / native['startup_s']:8.2f} "
              f"{vllm['greedy_tok_s'] / native['greedy_tok_s']:13.2f} "
              f"{vllm['sampled_tok_s'] / native['sampled_tok_s']:14.2f} {vllm['refit_s'] / native['refit_s']:9.2f}")
    print("(ratio: vLLM / native; above 1 for tok/s means vLLM generates faster, for seconds that it is slower)")


if __name__ == "__main__":
    main()
