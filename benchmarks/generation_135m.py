"""The native generation engine on a real 135M model in a GRPO rollout, against its bounds.

    ./run.sh python benchmarks/generation_135m.py --model /tmp/smol   # --shapes 4x8 8x8 --repeats 3

`--model` is a local Hugging Face directory (docs/models.md, "A real pretrained model, offline":
`posttrain init-model --preset smollm2-135m-instruct --out /tmp/smol`) or a preset name.
Rollout shape: P distinct arithmetic prompts through the model's chat template, G generations of
each next to each other (P x G rows), sampled at `--temperature`, top_p 1, no top_k, up to
`--max-new-tokens` tokens with natural stopping at eos. Three generators run interleaved, each
`--repeats` times (medians reported):

- `unoptimised`: the engine with `engine.UNOPTIMISED` (the engine before shared-prompt prefill,
  the llama-like decoder and sampling buffers: the model's forward with a `DynamicCache`).
- `native`: the engine as posttrain runs it.
- `hf`: Hugging Face `generate` on the left-padded batch (what TRL's GRPOTrainer runs), every row
  computed until the longest one ends.

Printed per shape: seconds, generated tokens/s, samples/s and ratios; whether `native` gave
`unoptimised`'s tokens (same seeds) and the largest logprob difference; one decode step at the full
batch for both engines, split by torch's profiler into matmuls, attention, sampling and the rest; and
two bounds for the native run: the compute bound (its FLOPs / the fp32 matmul rate measured on a
2048^3 product) and the weight-reading floor (decode steps x the time to read every weight once).
"""

from __future__ import annotations

import argparse
import statistics
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from baselines import HFGenerateBaseline
from bench_timing import best_seconds

from posttrain.data.arithmetic import generate_arithmetic
from posttrain.models.generation.engine import UNOPTIMISED, NativeGenerationEngine
from posttrain.models.generation.sampling import SamplingBuffers, process_logits, sample
from posttrain.models.hf import load_causal_lm, load_tokenizer


def rollout_prompts(tokenizer, num_prompts: int, generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_prompts` distinct additions through the chat template, each repeated `generations` times (right-padded)."""
    problems, _ = generate_arithmetic(num_prompts, 0, num_digits=3, seed=7)
    rows = []
    for problem in problems:
        messages = [{"role": "user", "content": f"{problem['prompt']} Think step by step, then give the answer."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        rows += [list(ids)] * generations
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    return input_ids, torch.tensor([len(r) for r in rows])


def matmul_params(model) -> tuple[int, int]:
    """Weights of the Linear layers: (all but the output head, the output head)."""
    head_params = model.get_output_embeddings().weight.numel()
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head_params, head_params


def generation_flops(model, prompt_lengths: list[int], generation_lengths: list[int]) -> float:
    """FLOPs of the work itself: one prefill per distinct prompt (last position's logits only) and
    one forward per fed-back generated token; matmuls at 2 FLOPs per weight and token, attention
    at 4 x layers x heads x head_dim per token and attended position."""
    config = model.config
    body_params, head_params = matmul_params(model)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    flops = 0.0
    for length in sorted(set(prompt_lengths)):  # distinct prompts (a GRPO batch repeats each)
        flops += 2 * body_params * length + 2 * head_params + attention * length * (length + 1) / 2
    for prompt, generated in zip(prompt_lengths, generation_lengths):
        fed = generated - 1  # the last token is never fed back
        flops += fed * 2 * (body_params + head_params) + attention * sum(prompt + t + 1 for t in range(fed))
    return flops


def decode_steps(engine: NativeGenerationEngine, ids, lengths, steps: int) -> dict[str, float]:
    """Seconds per decode step (sampling + model step) at the full batch, mean over `steps` steps
    after the prefill and one warm-up step, split by the profiler into matmuls (aten::mm/addmm),
    attention (SDPA, or the eager attention's ops), sampling and the rest."""
    decoder = engine._decoder()
    rows = ids.shape[0]
    with torch.inference_mode():
        logits, positions = engine._prefill(ids, lengths, decoder, capacity=ids.shape[1] + steps + 2)
        buffers = SamplingBuffers(rows, logits.shape[-1], logits.device) if engine.reuse_buffers else None
        seeds = torch.arange(rows)

        def one_step(step: int) -> torch.Tensor:
            with torch.profiler.record_function("sampling"):
                tokens, _ = sample(process_logits(logits, buffers=buffers), seeds, torch.full((rows,), step),
                                   buffers=buffers)
            return decoder.step(tokens, positions + step)

        logits = one_step(0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            start = time.perf_counter()
            for step in range(1, steps + 1):
                logits = one_step(step)
            total = time.perf_counter() - start
    events = {e.key: e for e in profiler.key_averages()}
    self_us = lambda *keys: sum(events[k].self_cpu_time_total for k in keys if k in events)  # noqa: E731
    parts = {
        "matmuls": self_us("aten::mm", "aten::addmm") / 1e6,
        "attention": events["aten::scaled_dot_product_attention"].cpu_time_total / 1e6
        if "aten::scaled_dot_product_attention" in events else 0.0,
        "sampling": events["sampling"].cpu_time_total / 1e6,
    }
    parts["rest"] = total - sum(parts.values())
    return {"step": total / steps, **{k: v / steps for k, v in parts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="local HF directory or preset")
    parser.add_argument("--shapes", nargs="+", default=["4x8", "8x8"], help="PROMPTSxGENERATIONS (default 4x8 8x8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each generator (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--skip-hf", action="store_true", help="leave HF generate out (the slowest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_causal_lm(args.model)
    tokenizer = load_tokenizer(args.model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    square = torch.randn(2048, 2048)
    matmul_rate = 2 * 2048**3 / best_seconds(lambda: torch.mm(square, square), 5)
    weights = [p for p in model.parameters()]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    read_weights_s = best_seconds(lambda: [p.sum() for p in weights], 5)
    print(f"model {args.model}: {sum(p.numel() for p in weights) / 1e6:.1f}M parameters, {weight_bytes / 2**20:.0f} MiB "
          f"float32; threads {torch.get_num_threads()}; fp32 matmul 2048^3: {matmul_rate / 1e9:.0f} GFLOP/s; "
          f"reading every weight once: {read_weights_s * 1e3:.1f} ms ({weight_bytes / read_weights_s / 1e9:.1f} GB/s)")

    engines = {
        "unoptimised": NativeGenerationEngine(model, tokenizer, pad_token_id=pad, eos_token_id=eos, **UNOPTIMISED),
        "native": NativeGenerationEngine(model, tokenizer, pad_token_id=pad, eos_token_id=eos),
    }
    hf = HFGenerateBaseline(model, pad_token_id=pad, eos_token_id=eos)
    for shape in args.shapes:
        num_prompts, generations = map(int, shape.split("x"))
        ids, lengths = rollout_prompts(tokenizer, num_prompts, generations)
        rows = ids.shape[0]
        seeds = torch.arange(rows) + 1
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        runs = {name: [] for name in [*engines, *([] if args.skip_hf else ["hf"])]}
        outputs, tokens = {}, {}
        for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
            for name in runs:
                start = time.perf_counter()
                if name == "hf":
                    torch.manual_seed(0)
                    out = hf.generate(ids, lengths, **sampling)
                    tokens[name] = int(hf_generated_lengths(out, eos).sum())
                else:
                    outputs[name] = out = engines[name].generate(ids, lengths, seeds=seeds, **sampling)
                    tokens[name] = int(out["generation_lengths"].sum())
                runs[name].append(time.perf_counter() - start)
        seconds = {name: statistics.median(times) for name, times in runs.items()}

        native, reference = outputs["native"], outputs["unoptimised"]
        same = torch.equal(native["output_ids"], reference["output_ids"])
        lp_diff = (native["logprobs"] - reference["logprobs"]).abs().max().item()
        gen_lengths = native["generation_lengths"].tolist()
        print(f"\n{shape}: {num_prompts} prompts x {generations} = {rows} rows, prompts of {lengths.min()}-"
              f"{lengths.max()} tokens, temperature {args.temperature}, <= {args.max_new_tokens} new tokens; "
              f"native lengths {min(gen_lengths)}-{max(gen_lengths)} (mean {statistics.mean(gen_lengths):.1f}); "
              f"{args.repeats} interleaved runs, medians")
        print(f"  native == unoptimised tokens (same seeds): {same}; largest logprob difference {lp_diff:.1e}")
        print(f"  {'generator':12s} {'seconds':>8s} {'tokens/s':>9s} {'samples/s':>10s} {'vs unoptimised':>15s} {'vs hf':>6s}")
        for name, s in seconds.items():
            vs_hf = f"{seconds['hf'] / s:6.2f}" if "hf" in seconds else "     -"
            print(f"  {name:12s} {s:8.2f} {tokens[name] / s:9.1f} {rows / s:10.2f} "
                  f"{seconds['unoptimised'] / s:15.2f} {vs_hf}")

        # One decode step at the full batch, both engines, the better of two interleaved tries each.
        tries = {name: [] for name in engines}
        for _ in range(2):
            for name, engine in engines.items():
                tries[name].append(decode_steps(engine, ids, lengths, steps=8))
        step_flops = 2 * sum(matmul_params(model)) * rows
        for name, measured in tries.items():
            parts = min(measured, key=lambda m: m["step"])
            print(f"  decode step at {rows} rows, {name}: {parts['step'] * 1e3:.1f} ms = matmuls "
                  f"{parts['matmuls'] * 1e3:.1f} ({step_flops / parts['matmuls'] / 1e9:.0f} GFLOP/s) + attention "
                  f"{parts['attention'] * 1e3:.1f} + sampling {parts['sampling'] * 1e3:.1f} + rest "
                  f"{parts['rest'] * 1e3:.1f} (norms, rotary, cache, op overhead)")
        print(f"  one decode step's matmuls alone at the 2048^3 rate: {step_flops / matmul_rate * 1e3:.1f} ms; "
              f"reading the weights: {read_weights_s * 1e3:.1f} ms")

        flops = generation_flops(model, lengths.tolist(), gen_lengths)
        compute_bound = flops / matmul_rate
        weight_floor = max(gen_lengths) * read_weights_s  # prefill + (longest - 1) decode steps, each reads all weights
        print(f"  native run: {flops / 1e9:.0f} GFLOP -> compute bound {compute_bound:.2f} s "
              f"(measured/bound {seconds['native'] / compute_bound:.2f}); weight-reading floor {max(gen_lengths)} steps x "
              f"{read_weights_s * 1e3:.1f} ms = {weight_floor:.2f} s (measured/floor {seconds['native'] / weight_floor:.2f})")


def hf_generated_lengths(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Tokens per row of HF's `[B, T]` output up to and including the first eos."""
    is_eos = tokens == eos
    width = torch.full((tokens.shape[0],), tokens.shape[1])
    return torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, width)


if __name__ == "__main__":
    main()
