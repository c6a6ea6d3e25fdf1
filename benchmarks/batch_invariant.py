"""What `policy.batch_invariant` costs and what it removes, side by side in one run.

    ./run.sh python benchmarks/batch_invariant.py     # --models tiny smollm2-135m-instruct

For each model (default: `tiny`, and `smollm2-135m-instruct` when it is in posttrain's cache):

- **generation**: one GRPO-shaped rollout (`--prompts` prompts x `--generations` samples through
  the chat template, temperature 1, up to `--max-new-tokens`, per-row seeds) by the native engine
  batched and batch-invariant (each row alone), the two taking turns, best of `--repeats`:
  seconds and the invariant / batched ratio. Then the same rows generated again in another batch
  (every other row, beside rows of other prompts): the largest |logprob difference| of a row
  between the two batches, for each mode (0 means batch-invariant).
- **logprobs** (the trainer's forward, `get_logprobs`'s micro-batching): the generated sequences
  scored in micro-batches as the recipe cuts them (dynamic batching, `--mb-tokens` tokens) against
  one sequence per forward (`policy.batch_invariant`), fused logprob path, best of `--repeats`;
  the largest difference of a sequence's logprobs between the whole batch and a half of it.

Threads: `--threads` (default 2).
"""

from __future__ import annotations

import argparse

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from bench_timing import best_interleaved
from generation_135m import rollout_prompts

from posttrain.distributed.batch import Batch
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.policy.forward import dynamic_microbatches, fixed_size_microbatches, microbatch_logprobs
from posttrain.utils.cache import cache_dir

SMOLLM2 = "smollm2-135m-instruct"


def row_gap(first: dict, first_rows: list[int], second: dict, second_rows: list[int]) -> float:
    """Largest |logprob difference| of the same rows in two generations (over the shorter of each
    pair's lengths: rows whose tokens differ are compared up to where they part)."""
    gap = 0.0
    for a, b in zip(first_rows, second_rows):
        end = min(int(first["unpadded_sequence_lengths"][a]), int(second["unpadded_sequence_lengths"][b]))
        same = (first["output_ids"][a, :end] == second["output_ids"][b, :end]).long().cumprod(0).sum()
        gap = max(gap, (first["logprobs"][a, :same] - second["logprobs"][b, :same]).abs().max().item())
    return gap


def trainer_logprobs(model, batch: Batch, invariant: bool, mb_tokens: int) -> torch.Tensor:
    mbs = fixed_size_microbatches(batch, 1) if invariant else dynamic_microbatches(batch, mb_tokens, 1)
    out = torch.zeros(batch["input_ids"].shape)
    with torch.inference_mode():
        for mb in mbs:
            values = microbatch_logprobs(model, mb, torch.device("cpu"), torch.float32, fused=True)
            out[mb.index, : values.shape[1]] = values
    return out


def run_model(name: str, args) -> None:
    tokenizer, model = load_tokenizer(name), load_causal_lm(name)
    input_ids, input_lengths = rollout_prompts(tokenizer, args.prompts, args.generations)
    seeds = torch.arange(input_ids.shape[0]) + 1000
    engines = {mode: NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id,
                                            eos_token_id=tokenizer.eos_token_id, batch_invariant=mode == "invariant")
               for mode in ("batched", "invariant")}
    generate = {mode: (lambda e=engine: e.generate(input_ids, input_lengths, max_new_tokens=args.max_new_tokens,
                                                    temperature=1.0, seeds=seeds))
                for mode, engine in engines.items()}
    seconds, outputs = best_interleaved(generate, args.repeats)
    tokens = int(outputs["batched"]["generation_lengths"].sum())
    # The same rows again, every other one, beside the rollout's rows of another seed.
    rows = list(range(0, input_ids.shape[0], 2))
    other_ids, other_lengths = rollout_prompts(tokenizer, args.prompts + 3, 1)
    mixed_ids = torch.nn.functional.pad(input_ids[rows], (0, max(0, other_ids.shape[1] - input_ids.shape[1])),
                                        value=tokenizer.pad_token_id)
    extra = other_ids[-3:, : mixed_ids.shape[1]]
    mixed_ids = torch.cat([mixed_ids, torch.nn.functional.pad(extra, (0, mixed_ids.shape[1] - extra.shape[1]),
                                                                value=tokenizer.pad_token_id)])
    mixed_lengths = torch.cat([input_lengths[rows], other_lengths[-3:]])
    mixed_seeds = torch.cat([seeds[rows], torch.arange(3) + 5000])
    gaps = {}
    for mode, engine in engines.items():
        again = engine.generate(mixed_ids, mixed_lengths, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                seeds=mixed_seeds)
        gaps[mode] = row_gap(outputs[mode], rows, again, list(range(len(rows))))
    print(f"\n{name}: {args.prompts} prompts x {args.generations} samples, up to {args.max_new_tokens} new tokens "
          f"({tokens} generated), {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"  generation: batched {seconds['batched']:.2f} s, batch-invariant {seconds['invariant']:.2f} s "
          f"({seconds['invariant'] / seconds['batched']:.2f}x); a row's largest |dlogp| in another batch: "
          f"batched {gaps['batched']:.2e}, batch-invariant {gaps['invariant']:.2e}", flush=True)

    out = outputs["batched"]
    batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    half = torch.arange(0, batch.size, 2)
    score = {mode: (lambda m=mode: trainer_logprobs(model, batch, m == "invariant", args.mb_tokens))
             for mode in ("batched", "invariant")}
    seconds, scored = best_interleaved(score, args.repeats)
    gaps = {}
    for mode in score:
        again = trainer_logprobs(model, batch.select(half), mode == "invariant", args.mb_tokens)
        width = again.shape[1]
        gaps[mode] = (scored[mode][half, :width] - again).abs().max().item()
    print(f"  logprobs ({batch.size} sequences, dynamic batching of {args.mb_tokens} tokens against one sequence per "
          f"forward): batched {seconds['batched']:.2f} s, batch-invariant {seconds['invariant']:.2f} s "
          f"({seconds['invariant'] / seconds['batched']:.2f}x); a sequence's largest |dlogp| in half the batch: "
          f"batched {gaps['batched']:.2e}, batch-invariant {gaps['invariant']:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cached = (cache_dir() / "models" / SMOLLM2 / "config.json").is_file()
    parser.add_argument("--models", nargs="+", default=["tiny"] + ([SMOLLM2] if cached else []))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mb-tokens", type=int, default=4096, help="dynamic batching budget (the recipe's logprob_mb_tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        run_model(name, args)


if __name__ == "__main__":
    main()
