"""One GPU: the native engine's decode speed against Hugging Face `generate`, fp8 generation against
bfloat16, and a training step's model-FLOPs utilisation, side by side in one run.

    python benchmarks/gpu_one.py                         # --models 100m 1b (CUDA only)
    python benchmarks/gpu_one.py --models tiny --quick   # the same code paths on CPU, shortened

First the card: its name, its bfloat16 matmul rate measured on an 8192 x 8192 x 8192 product
(`measured peak`) and its memory bandwidth measured by a device-to-device copy. Then per model
(presets `100m` and `1b`, random-initialised: the numbers are about speed, not text):

- **decode**: the native engine and HF `model.generate` on the same bfloat16 weights and the same
  `--batch` right-padded random prompts (up to `--prompt-len` tokens), `--new-tokens` each, no
  stop token (both do the same work), greedy; tokens/s, native/HF, and the weight-read bound (each
  decode step reads every weight once: batch x bandwidth / weight bytes, the KV cache not counted).
- **fp8 vs bf16**: the engine's copy in bfloat16 and in fp8 (`policy.generation.precision=fp8`: e4m3
  weights with 128 x 128 block scales, activations per 1 x 128 group, cuBLAS's block-scaled
  `scaled_mm`), sampled at temperature 1 with the same seeds at each `--fp8-batch`; tokens/s and
  the mismatch against the float32 model's logprobs of the generated tokens (GRPO's
  `token_mult_prob_error`, mean exp|dlogp|).
- **training**: one `PolicyWorker` (world size 1, `policy.precision=bfloat16`: FSDP2 mixed precision,
  float32 master weights, AdamW) trains on a GRPO-shaped batch (`--rows` rows, prompts of
  `--prompt-len`, completions 1/4..1x `--completion-len`); the step's FLOPs are 3 forwards
  (`train_step_135m.train_flops`), and MFU is FLOPs / time over the card's nominal dense bfloat16
  peak (989 TFLOP/s for H100/H200 SXM; `--peak-tflops`) and over the measured peak.

Timings: best of `--repeats` after a warm-up, with `torch.cuda.synchronize` around each.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from baselines import HFGenerateBaseline
from bench_timing import timed
from generation_precision import mismatch, trainer_logprobs
from train_step_135m import make_grpo_batch, train_flops

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig, PolicyConfig
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.low_precision import apply_generation_precision, fp8_device_problem
from posttrain.models.hf import load_causal_lm

NOMINAL_BF16_TFLOPS = 989.0  # H100 / H200 SXM, dense


def card(device: torch.device, quick: bool) -> tuple[float, float]:
    """Print the device; return (measured bf16 matmul TFLOP/s, measured bandwidth GB/s)."""
    n = 1024 if quick else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds, _ = timed(lambda: a @ b, 3 if quick else 10)
    tflops = 2 * n**3 / seconds / 1e12
    x = torch.empty(2**28 if not quick else 2**22, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    copy_s, _ = timed(lambda: y.copy_(x), 5)
    bandwidth = 2 * x.numel() / copy_s / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    print(f"device {name} (capability {capability}), torch {torch.__version__}: "
          f"{dtype} matmul {n}^3 {tflops:.0f} TFLOP/s measured, copy {bandwidth:.0f} GB/s (read + write)")
    return tflops, bandwidth


def random_prompts(batch: int, prompt_len: int, vocab: int, pad: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g)
    ids = torch.randint(8, vocab, (batch, prompt_len), generator=g)
    ids[torch.arange(prompt_len)[None] >= lengths[:, None]] = pad
    return ids.to(device), lengths.to(device)


def decode(name: str, device: torch.device, args, bandwidth_gbs: float) -> None:
    model = load_causal_lm(name, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    pad = model.config.pad_token_id or 0
    ids, lengths = random_prompts(args.batch, args.prompt_len, model.config.vocab_size, pad, device)
    native = NativeGenerationEngine(model, None, pad_token_id=pad, eos_token_id=None)
    hf = HFGenerateBaseline(model, pad_token_id=pad, eos_token_id=None)
    native_s, out = timed(lambda: native.generate(ids, lengths, max_new_tokens=args.new_tokens, greedy=True),
                                 args.repeats)
    hf_s, _ = timed(lambda: hf.generate(ids, lengths, max_new_tokens=args.new_tokens, greedy=True), args.repeats)
    tokens = int(out["generation_lengths"].sum())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = args.batch * bandwidth_gbs * 1e9 / weight_bytes
    print(f"  decode ({model.dtype}, batch {args.batch}, prompts <= {args.prompt_len}, {args.new_tokens} new, greedy): "
          f"native {tokens / native_s:,.0f} tok/s, HF generate {tokens / hf_s:,.0f} tok/s, "
          f"native/HF {hf_s / native_s:.2f}x; weight-read bound {bound:,.0f} tok/s "
          f"(native at {tokens / native_s / bound:.0%} of it)", flush=True)


def fp8_against_bf16(name: str, device: torch.device, args) -> None:
    reference = load_causal_lm(name, dtype=torch.float32, device=device)
    problem = fp8_device_problem(device)
    engines = {"bfloat16": copy.deepcopy(reference).to(torch.bfloat16)}
    if problem is None or args.quick:
        engines["fp8"] = copy.deepcopy(reference).to(torch.bfloat16)
        apply_generation_precision(engines["fp8"], "fp8", device, emulate_fp8=problem is not None)
    else:
        print(f"  fp8: not run ({problem})")
    pad = reference.config.pad_token_id or 0
    for batch in args.fp8_batch:
        ids, lengths = random_prompts(batch, args.prompt_len, reference.config.vocab_size, pad, device)
        seeds = torch.arange(batch, dtype=torch.long) + 1000
        cells = []
        for precision, model in engines.items():
            engine = NativeGenerationEngine(model, None, pad_token_id=pad, eos_token_id=None)
            seconds, out = timed(lambda: engine.generate(ids, lengths, max_new_tokens=args.new_tokens,
                                                                temperature=1.0, seeds=seeds), args.repeats)
            tokens = int(out["generation_lengths"].sum())
            gap = mismatch(out["logprobs"].to(device).float(), trainer_logprobs(reference, out), out)
            cells.append((precision, tokens / seconds, gap["token_mult_prob_error"], gap["mean_abs"]))
        base = cells[0][1]
        print(f"  batch {batch}, sampled: " + "; ".join(
            f"{p} {rate:,.0f} tok/s ({rate / base:.2f}x), token_mult_prob_error {err:.4f} (mean |dlogp| {mean:.4f})"
            for p, rate, err, mean in cells), flush=True)


def training(name: str, device: torch.device, args, peak_measured: float) -> None:
    from posttrain.models.policy.worker import PolicyWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = PolicyConfig(
        model_name=name, precision="bfloat16" if device.type == "cuda" else "float32",
        train_global_batch_size=args.rows, train_micro_batch_size=args.micro_batch_size,
        optimizer=dict(name="adamw", lr=1e-7), max_grad_norm=1.0,
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    batch = make_grpo_batch(args.rows, worker.model.config.vocab_size,
                            prompt_range=(args.prompt_len * 3 // 4, args.prompt_len),
                            completion_range=(args.completion_len // 4, args.completion_len))
    loss_fn = ClippedPGLoss(LossConfig())
    seconds, _ = timed(lambda: worker.train(batch, loss_fn), args.repeats)
    flops = train_flops(worker.model, batch["input_lengths"])
    tokens = int(batch["input_lengths"].sum())
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    achieved = flops / seconds / 1e12
    print(f"  training ({cfg.precision}, {args.rows} rows in micro-batches of {args.micro_batch_size}, {tokens} tokens, "
          f"{flops / 1e12:.1f} TFLOP): {seconds:.3f} s, {tokens / seconds:,.0f} tok/s, {achieved:.0f} TFLOP/s = "
          f"MFU {achieved / args.peak_tflops:.1%} of {args.peak_tflops:.0f} nominal, {achieved / peak_measured:.1%} of the "
          f"measured peak; peak allocated {peak_memory:.1f} GiB", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["100m", "1b"], help="presets or model directories")
    parser.add_argument("--parts", nargs="+", default=["decode", "fp8", "training"], choices=["decode", "fp8", "training"])
    parser.add_argument("--batch", type=int, default=64, help="decode batch (default 64)")
    parser.add_argument("--fp8-batch", type=int, nargs="+", default=[64, 256], help="fp8 vs bf16 batches (default 64 256)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64, help="training rows (default 64)")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=NOMINAL_BF16_TFLOPS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU dry run of the same code)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.fp8_batch, args.prompt_len, args.new_tokens = 4, [4], 8, 8
        args.rows, args.micro_batch_size, args.completion_len, args.repeats = 4, 2, 16, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak, bandwidth = card(device, args.quick)
    for name in args.models:
        print(f"\n{name}:", flush=True)
        for part in args.parts:
            start = time.perf_counter()
            {"decode": lambda: decode(name, device, args, bandwidth),
             "fp8": lambda: fp8_against_bf16(name, device, args),
             "training": lambda: training(name, device, args, peak)}[part]()
            print(f"  ({part}: {time.perf_counter() - start:.0f} s)", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    main()
