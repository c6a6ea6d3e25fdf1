"""One GRPO training step of a real 135M model: the logits path vs the fused logprob path, side by side.

    ./run.sh python benchmarks/train_step_135m.py --model /tmp/smol [--threads 2] [--repeats 5]
        [--batching] [--kernel] [--profile]

One `PolicyWorker` (world size 1, in this process, `--threads` torch threads) trains on one
realistic GRPO batch: `--rows` 32 samples, prompts of 36..44 tokens, completions drawn uniformly
from 20..128 tokens, clipped-PG loss on the completion tokens, AdamW, one optimizer step per call
(GRPO's default: no previous-logprobs pass). Variants run interleaved, one step each per repeat,
after one warm-up step each. On a shared machine each timed step first waits (`--wait-idle`, at
most 60 s) until other processes leave the CPUs idle, and records the CPU share they took during
the step; medians are over the steps where that share stayed under 10% (all steps if none did).

- default: `logits` (`policy.fused_logprobs=false`: HF logits `[n, L, V]`, then the log-softmax)
  against `fused` (`policy.fused_logprobs=true`), both with `policy.train_micro_batch_size`
  (`--micro-batch-size`, default 8) rows per micro-batch; tokens/s of each, `fused/logits`.
- `--batching [MODE:SIZE ...]`: the fused path under micro-batching settings: `fixed:ROWS`,
  `dynamic:TOKENS` (dynamic batching's budget), `packing:TOKENS` (sequence packing's bin size);
  default fixed 8 and 32 rows, dynamic 512 / 1024 / 2048 and packing 256 / 512 / 1024 tokens.
- `--infer`: time `get_logprobs` (one forward; the logprob keys of the micro-batching) instead of
  a training step; the bound is one forward.
- `--kernel`: `linear_logprobs` alone on the model's head at several tile sizes (vocabulary blocks
  over all tokens, and whole-vocabulary token chunks), against the full-logits log-softmax,
  forward + backward over the batch's completion tokens.
- `--profile`: torch.profiler's top ops (self CPU time) of one step of each path.

The compute bound of a step is its FLOPs over the float32 matmul rate measured first at the same
threads (best of [2048, hidden] x [hidden, intermediate] and x [hidden, vocab]): training is 3
forwards, a forward over rows of T_i tokens is sum_i (2 P T_i + 2 layers A T_i^2) with P the
weights of the Linear layers (lm_head included, counted for every token) and A the attention
width (causal). `measured/bound` is how far a variant is from it. tokens/s counts valid tokens
(prompt and completion, no padding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig, PolicyConfig
from posttrain.distributed.batch import Batch


def make_grpo_batch(rows: int, vocab: int, seed: int = 0, prompt_range: tuple[int, int] = (36, 44),
                    completion_range: tuple[int, int] = (20, 128)) -> Batch:
    """Right-padded GRPO rows: prompts of `prompt_range` tokens, completions of `completion_range`
    (both inclusive, uniform; default 36..44 and 20..128), trained on the completion."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(prompt_range[0], prompt_range[1] + 1, (rows,), generator=g)
    completion = torch.randint(completion_range[0], completion_range[1] + 1, (rows,), generator=g)
    lengths = prompt + completion
    width = int(lengths.max())
    positions = torch.arange(width)[None]
    valid = positions < lengths[:, None]
    token_mask = (valid & (positions >= prompt[:, None])).float()
    return Batch(
        input_ids=torch.randint(0, vocab, (rows, width), generator=g) * valid,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(rows),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, width).contiguous(),
        generation_logprobs=-torch.rand(rows, width, generator=g) * token_mask,
    )


def matmul_gflops(hidden: int, intermediate: int, vocab: int) -> float:
    """Best float32 matmul rate (GFLOP/s) at this process's threads on the model's shapes."""
    best = 0.0
    for k, n in ((hidden, intermediate), (hidden, vocab)):
        a, b = torch.randn(2048, k), torch.randn(k, n)
        torch.matmul(a, b)
        for _ in range(5):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = max(best, 2 * 2048 * k * n / (time.perf_counter() - start) / 1e9)
    return best


def train_flops(model: torch.nn.Module, lengths: torch.Tensor) -> float:
    """3 forwards over rows of `lengths` tokens (see the module docstring)."""
    config = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_width = config.num_attention_heads * head_dim
    t = lengths.double()
    forward = (2 * matmul_params * t + 2 * config.num_hidden_layers * attention_width * t**2).sum()
    return 3 * float(forward)


def make_worker(model: str, micro_batch_size: int, rows: int):
    """A world-size-1 PolicyWorker in this process (its gloo group on a free local port)."""
    import socket

    from posttrain.models.policy.worker import PolicyWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = PolicyConfig(
        model_name=model, precision="float32", train_global_batch_size=rows, train_micro_batch_size=micro_batch_size,
        optimizer=dict(name="adamw", lr=1e-7), max_grad_norm=1.0,
    )
    return PolicyWorker(cfg, init_reference_model=False)


DEFAULT_BATCHING = ["fixed:8", "fixed:32", "dynamic:512", "dynamic:1024", "dynamic:2048", "packing:256",
                    "packing:512", "packing:1024"]


def batching_updates(spec: str, infer: bool) -> dict:
    """Config updates of "fixed:ROWS", "dynamic:TOKENS" or "packing:TOKENS" (training keys, or the
    logprob keys with `infer`)."""
    mode, _, value = spec.partition(":")
    size = int(value)
    if mode == "fixed":
        return {"logprob_batch_size" if infer else "train_micro_batch_size": size}
    if mode in ("dynamic", "packing"):
        section = "dynamic_batching" if mode == "dynamic" else "sequence_packing"
        return {section: {"enabled": True, "logprob_mb_tokens" if infer else "train_mb_tokens": size}}
    raise ValueError(f"--batching {spec!r}: use fixed:ROWS, dynamic:TOKENS or packing:TOKENS")


def variants(args: argparse.Namespace) -> dict[str, dict]:
    """name -> config updates (`fused_logprobs`, micro-batching) of each variant."""
    if args.batching is None:
        return {"logits": {"fused_logprobs": False}, "fused": {"fused_logprobs": True}}
    return {spec: batching_updates(spec, args.infer) for spec in args.batching or DEFAULT_BATCHING}


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have used so far (/proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(max_wait_s: float, idle_share: float = 0.9) -> None:
    """Wait (at most `max_wait_s`) until other processes leave the CPUs at least `idle_share` idle."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = busy_cpu_seconds()
        time.sleep(0.5)
        if (busy_cpu_seconds() - before) / (0.5 * (os.cpu_count() or 1)) < 1 - idle_share:
            return


class Timings:
    """Per variant: wall seconds of each timed call and the CPU share other processes took meanwhile."""

    def __init__(self, names) -> None:
        self.seconds: dict[str, list[float]] = {name: [] for name in names}
        self.cpu_seconds: dict[str, list[float]] = {name: [] for name in names}  # this process's
        self.others: dict[str, list[float]] = {name: [] for name in names}

    def clean(self, name: str, max_others: float = 0.1) -> list[float]:
        """The calls during which other processes took under `max_others` of the CPUs (all calls
        if none was that quiet)."""
        quiet = [t for t, o in zip(self.seconds[name], self.others[name]) if o < max_others]
        return quiet or self.seconds[name]


def time_interleaved(fns: dict[str, Callable[[], None]], repeats: int, wait_idle_s: float = 0.0) -> Timings:
    """Each function once (warm-up), then `repeats` rounds of one call each, in turn; before each
    timed call wait up to `wait_idle_s` for the other processes to go quiet."""
    for fn in fns.values():
        fn()
    timings = Timings(fns)
    cores = os.cpu_count() or 1
    for _ in range(repeats):
        for name, fn in fns.items():
            wait_until_idle(wait_idle_s)
            own, busy, start = sum(os.times()[:2]), busy_cpu_seconds(), time.perf_counter()
            fn()
            wall = time.perf_counter() - start
            own = sum(os.times()[:2]) - own
            others = (busy_cpu_seconds() - busy) - own
            timings.seconds[name].append(wall)
            timings.cpu_seconds[name].append(own)
            timings.others[name].append(max(0.0, others) / (wall * cores))
    return timings


def bench_steps(args: argparse.Namespace) -> None:
    worker = make_worker(args.model, args.micro_batch_size, args.rows)
    model = worker.model
    batch = make_grpo_batch(args.rows, model.config.vocab_size)
    loss_fn = ClippedPGLoss(LossConfig())
    base = worker.cfg.model_dump()
    eligible = worker.fused_logprobs

    def step_fn(updates: dict) -> Callable[[], None]:
        cfg = PolicyConfig.model_validate({**base, "fused_logprobs": True, **updates})

        def step() -> None:
            worker.cfg, worker.fused_logprobs = cfg, eligible and cfg.fused_logprobs
            if args.infer:
                worker.get_logprobs(batch)
            else:
                worker.train(batch, loss_fn)

        return step

    fns = {name: step_fn(updates) for name, updates in variants(args).items()}
    gflops = matmul_gflops(model.config.hidden_size, model.config.intermediate_size, model.config.vocab_size)
    flops = train_flops(model, batch["input_lengths"]) / (3 if args.infer else 1)
    bound = flops / (gflops * 1e9)
    tokens = int(batch["input_lengths"].sum())
    completion = int(batch["token_mask"].sum())
    print(f"model={args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M) threads={torch.get_num_threads()} "
          f"rows={args.rows} tokens={tokens} (completion {completion}, padded width {batch['input_ids'].shape[1]}) "
          f"fused path eligible={eligible}")
    print(f"matmul rate {gflops:.0f} GFLOP/s; step {flops / 1e12:.2f} TFLOP -> compute bound {bound:.2f} s")
    if args.profile:
        profile({name: fns[name] for name in list(fns)[:2]})
    timings = time_interleaved(fns, args.repeats, args.wait_idle)
    first = next(iter(fns))
    print(f"{'variant':18s} {'median s':>9s} {'min s':>7s} {'cpu s':>7s} {'tokens/s':>9s} {'x ' + first:>10s} "
          f"{'meas/bound':>10s}  each step: seconds (others' CPU share)")
    for name in fns:
        med = statistics.median(timings.clean(name))
        ratio = statistics.median(timings.clean(first)) / med
        steps = " ".join(f"{t:.2f}({o:.0%})" for t, o in zip(timings.seconds[name], timings.others[name]))
        print(f"{name:18s} {med:9.2f} {min(timings.seconds[name]):7.2f} {statistics.median(timings.cpu_seconds[name]):7.2f} "
              f"{tokens / med:9.0f} {ratio:10.2f} {med / bound:10.2f}  {steps}")
    print("(median s: over the steps during which other processes used under 10% of the CPUs, if any; "
          "cpu s: this process's CPU seconds per step, median)")
    if args.batching is None:
        pairs = [a / b for a, b, oa, ob in zip(timings.seconds["logits"], timings.seconds["fused"],
                                                timings.others["logits"], timings.others["fused"])
                 if max(oa, ob) < 0.1]
        pairs = pairs or [a / b for a, b in zip(timings.seconds["logits"], timings.seconds["fused"])]
        overall = statistics.median(timings.clean("logits")) / statistics.median(timings.clean("fused"))
        print(f"tokens/s fused/logits: {overall:.2f}x "
              f"(median of per-round ratios {statistics.median(pairs):.2f}x over {len(pairs)} rounds)")


def profile(fns: dict[str, Callable[[], None]], rows: int = 12) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in fns.items():
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        print(f"\nprofile of one '{name}' step: {total:.2f} s self CPU")
        for e in events[:rows]:
            print(f"  {e.key[:48]:48s} {e.self_cpu_time_total / 1e6:7.2f} s {e.count:6d} calls")


def bench_kernel(args: argparse.Namespace) -> None:
    """`linear_logprobs` forward + backward at several tile shapes against the full log-softmax."""
    from transformers import AutoConfig

    from posttrain.models.hf import resolve_model_path
    from posttrain.models.policy.linear_logprobs import linear_logprobs, tile_shape

    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    hidden_size, vocab = config.hidden_size, config.vocab_size
    n = int(make_grpo_batch(args.rows, vocab)["token_mask"].sum())
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(n, hidden_size, generator=g), torch.randn(vocab, hidden_size, generator=g) / 24
    targets, upstream = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g)

    def run(fn) -> Callable[[], None]:
        def once() -> None:
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            (fn(h, w) * upstream).sum().backward()
        return once

    def full(h, w):
        logits = h @ w.T
        return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(-1)

    fns = {"full logits": run(full)}
    for mib in (4, 8, 16, 32, 64):
        chunk, block = tile_shape(n, vocab, mib * 2**20)
        fns[f"{mib} MiB tiles ({chunk}x{block})"] = run(
            lambda h, w, c=chunk, b=block: linear_logprobs(h, w, targets, chunk_tokens=c, vocab_block=b))
    for mib in (32, 128):  # whole-vocabulary token chunks, for comparison
        chunk = mib * 2**20 // (4 * vocab)
        fns[f"{mib} MiB tiles ({chunk}x{vocab})"] = run(
            lambda h, w, c=chunk: linear_logprobs(h, w, targets, chunk_tokens=c, vocab_block=vocab))
    timings = time_interleaved(fns, args.repeats, args.wait_idle)
    print(f"head {vocab} x {hidden_size}, {n} tokens, threads={torch.get_num_threads()}: forward + backward")
    for name in fns:
        ts = timings.clean(name)
        print(f"  {name:30s} median {statistics.median(ts):6.3f} s  min {min(timings.seconds[name]):6.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model_name (default: the preset)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rows", type=int, default=32, help="samples in the batch (default 32)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant (default 3)")
    parser.add_argument("--batching", nargs="*", metavar="MODE:SIZE",
                        help="compare micro-batching settings on the fused path: fixed:ROWS, dynamic:TOKENS, "
                             f"packing:TOKENS (default, without values: {' '.join(DEFAULT_BATCHING)})")
    parser.add_argument("--infer", action="store_true",
                        help="time get_logprobs (the logprob pass, one forward) instead of a training step")
    parser.add_argument("--kernel", action="store_true", help="time the chunked kernel alone")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one step of each path")
    parser.add_argument("--wait-idle", type=float, default=60.0,
                        help="before each timed step wait up to this many seconds for other processes to go quiet "
                             "(default 60; 0: do not wait)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernel:
        bench_kernel(args)
    else:
        bench_steps(args)


if __name__ == "__main__":
    main()
