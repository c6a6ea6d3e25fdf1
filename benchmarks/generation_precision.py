"""Low-precision generation: decode speed and the train/inference mismatch of each engine precision, side by side.

    ./run.sh python benchmarks/generation_precision.py       # --models tiny smollm2-135m-instruct --layers

For each model (default: `tiny`, and `smollm2-135m-instruct` when it is in posttrain's cache) the
native engine generates one GRPO-shaped rollout (`--prompts` arithmetic prompts through the chat
template x `--generations` samples each, temperature 1, up to `--max-new-tokens`) with the same
seeds at each `policy.generation.precision`:

- `float32`: the trainer's precision (the reference row);
- `bfloat16`: the whole engine in bfloat16;
- `int8`: the decoder's linear layers int8 per output channel (W8A16, torch's CPU kernel);
- `fp8 (emulated)`: e4m3 with 128x128 block scales, activations per 1x128 group, computed in
  float32 on the dequantized numbers (what the GPU kernel computes, to float32 rounding; a run
  refuses fp8 without FP8 hardware, so its speed here means nothing and is not printed).

Printed per precision: the generation's wall time (best of `--repeats`, the precisions taking turns
so a busy moment of the machine slows each alike) and generated tokens/s with
the speed-up over float32; and the mismatch the trainer would see on those tokens: the float32
model's logprobs (full vocabulary, temperature 1, what `Policy.get_logprobs` computes) against the
engine's, as mean |difference|, `token_mult_prob_error` (mean exp|difference|) and `gen_kl_error`
(k3), the names of GRPO's `train/` metrics.

`--layers` also times one linear layer of each shape at several row counts: float32, torch's int8
kernel and the int8 arithmetic with the weight converted per call (how `INT8_KERNEL_MAX_ROWS` in
`low_precision.py` was chosen).
"""

from __future__ import annotations

import argparse
import copy
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
import torch.nn.functional as F

from bench_timing import best_seconds
from generation_135m import rollout_prompts

from posttrain.algorithms.loss import per_token_kl
from posttrain.models.generation import quantization as q
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.low_precision import apply_generation_precision
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.utils.cache import cache_dir

PRECISIONS = ("float32", "bfloat16", "int8", "fp8")
SMOLLM2 = "smollm2-135m-instruct"


def engine_model(reference: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The generation engine's copy of the float32 `reference` in `precision`."""
    model = copy.deepcopy(reference)
    if precision == "bfloat16":
        return model.to(torch.bfloat16)
    apply_generation_precision(model, precision, "cpu", emulate_fp8=True)
    return model


def trainer_logprobs(model: torch.nn.Module, out: dict, batch_rows: int = 16) -> torch.Tensor:
    """`[B, S+T]` float32 logprobs of each token under `model` (temperature 1, 0 at position 0)."""
    ids, lengths = out["output_ids"], out["unpadded_sequence_lengths"]
    rows = []
    with torch.inference_mode():
        for start in range(0, ids.shape[0], batch_rows):
            chunk = ids[start : start + batch_rows]
            mask = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[start : start + batch_rows, None]).long()
            logits = model(input_ids=chunk, attention_mask=mask).logits.float()
            chosen = torch.log_softmax(logits[:, :-1], -1).gather(2, chunk[:, 1:, None])[..., 0]
            rows.append(torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1))
    return torch.cat(rows)


def mismatch(engine_logprobs: torch.Tensor, train_logprobs: torch.Tensor, out: dict) -> dict[str, float]:
    """GRPO's mismatch metrics over the generated tokens."""
    positions = torch.arange(engine_logprobs.shape[1], device=engine_logprobs.device)[None]
    ends = out["unpadded_sequence_lengths"][:, None]
    generated = (positions >= ends - out["generation_lengths"][:, None]) & (positions < ends)
    gen, train = engine_logprobs[generated], train_logprobs[generated]
    return {
        "mean_abs": (gen - train).abs().mean().item(),
        "token_mult_prob_error": (gen - train).abs().exp().mean().item(),
        "gen_kl_error": per_token_kl(gen, train, "k3").mean().item(),
    }


def run_model(name: str, args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(name)
    reference = load_causal_lm(name)
    input_ids, input_lengths = rollout_prompts(tokenizer, args.prompts, args.generations)
    seeds = torch.arange(input_ids.shape[0], dtype=torch.long) + 1000
    engines = {precision: NativeGenerationEngine(engine_model(reference, precision), tokenizer,
                                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
               for precision in args.precisions}
    outputs, seconds = {}, {p: float("inf") for p in engines}

    def generate(precision: str) -> None:
        outputs[precision] = engines[precision].generate(
            input_ids, input_lengths, max_new_tokens=args.max_new_tokens, temperature=1.0, seeds=seeds)

    # Interleaved, so a busy moment of the machine slows every precision alike; best of the repeats.
    for repeat in range(args.repeats + 1):  # the first round warms up
        for precision in engines:
            if precision == "fp8" and repeat:  # emulated: its speed means nothing
                continue
            start = time.perf_counter()
            generate(precision)
            if repeat:
                seconds[precision] = min(seconds[precision], time.perf_counter() - start)

    print(f"\n{name}: {args.prompts} prompts x {args.generations} generations, up to {args.max_new_tokens} new tokens, "
          f"temperature 1, {args.threads} threads, best of {args.repeats} (interleaved)")
    print(f"{'precision':<15} {'seconds':>8} {'tokens/s':>9} {'vs fp32':>8} {'mean |dlogp|':>13} "
          f"{'token_mult_prob_error':>22} {'gen_kl_error':>13}")
    baseline = None
    for precision, out in outputs.items():
        tokens = int(out["generation_lengths"].sum())
        rate = tokens / seconds[precision]
        if precision == "float32":
            baseline = rate
        metrics = mismatch(out["logprobs"], trainer_logprobs(reference, out), out)
        timed = precision != "fp8"
        label = "fp8 (emulated)" if precision == "fp8" else precision
        speed = (f"{seconds[precision]:>8.2f} {rate:>9.0f} {rate / baseline:>7.2f}x" if timed and baseline
                 else f"{'-':>8} {'-':>9} {'-':>8}")
        print(f"{label:<15} {speed} {metrics['mean_abs']:>13.5f} {metrics['token_mult_prob_error']:>22.6f} "
              f"{metrics['gen_kl_error']:>13.2e}   ({tokens} tokens)", flush=True)


def layer_table(shapes: list[tuple[int, int]], rows_list: list[int], repeats: int) -> None:
    """One linear layer per shape: float32 against the int8 kernel and the per-call conversion."""
    print(f"\none linear layer, microseconds (best of {repeats} x 20 calls): float32 | int8 kernel | int8 converted per call")
    print(f"{'in x out':>12} " + " ".join(f"{f'{r} rows':>24}" for r in rows_list))
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features)
        weight_q, scale = q.quantize_int8_rows(weight)
        ones = torch.ones_like(scale, dtype=torch.bfloat16)
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            times = []
            for fn in (lambda: F.linear(x, weight), lambda: q.int8_matmul(x, weight_q, scale, ones),
                       lambda: q.int8_matmul_dequantized(x, weight_q, scale)):
                times.append(best_seconds(lambda: [fn() for _ in range(20)], repeats) / 20 * 1e6)
            cells.append(f"{times[0]:>7.0f} |{times[1]:>6.0f} |{times[2]:>6.0f}")
        print(f"{f'{in_features}x{out_features}':>12} " + " ".join(f"{c:>24}" for c in cells), flush=True)


def model_shapes(name: str) -> list[tuple[int, int]]:
    config = load_causal_lm(name).config
    hidden, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return list(dict.fromkeys([(hidden, hidden), (hidden, kv), (hidden, config.intermediate_size),
                               (config.intermediate_size, hidden)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    smollm2_cached = (cache_dir() / "models" / SMOLLM2 / "config.json").is_file()
    parser.add_argument("--models", nargs="+", default=["tiny"] + ([SMOLLM2] if smollm2_cached else []),
                        help=f"presets or directories (default: tiny, and {SMOLLM2} when cached)")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", action="store_true", help="also time single linear layers per row count")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    for name in args.models:
        run_model(name, args)
    if args.layers:
        shapes = list(dict.fromkeys(shape for name in args.models for shape in model_shapes(name)))
        layer_table(shapes, [1, 4, 8, 16, 32, 64, 256], args.repeats)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
