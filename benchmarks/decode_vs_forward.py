"""The native engine's fast decoder (`LlamaLikeDecoder`; Gemma 3: `Gemma3Decoder`) against the model's own
forward with a `DynamicCache` (`ModelForwardDecoder`), one decode step, side by side in one run.

    ./run.sh python benchmarks/decode_vs_forward.py --model tiny-gemma3 --rows 8 --prompt 100
    ./run.sh python benchmarks/decode_vs_forward.py --model /path/to/gemma3-270m --rows 8 4

Printed per model and batch: the best of `--repeats` timings of `--steps` decode steps after a prompt
of `--prompt` tokens (every other row left-padded by a third), each decoder starting from its own
prefill of the same prompts, the ratio, and the largest difference between the two decoders' last
logits (float rounding: both compute the model's forward).
"""

from __future__ import annotations

import argparse
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from transformers import DynamicCache

from posttrain.models.generation.decoders import ModelForwardDecoder, unsupported_reason
from posttrain.models.generation.gemma3_decoder import fast_decoder
from posttrain.models.hf import load_causal_lm, resolve_model_path


def step_seconds(model, make_decoder, rows: int, prompt: int, steps: int, repeats: int, device: torch.device):
    """Seconds per decode step (best of `repeats` runs of `steps` steps, each after an untimed prefill)
    and the last step's logits."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, prompt), generator=generator).to(device)
    mask = torch.ones(rows, prompt, dtype=torch.long, device=device)
    mask[::2, : prompt // 3] = 0  # every other row left-padded by a third
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(0, vocab, (steps, rows), generator=generator).to(device)
    best, logits = float("inf"), None
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms up
            cache = DynamicCache()
            model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            decoder = make_decoder()
            decoder.start(cache, mask, torch.arange(rows, device=device), capacity=prompt + steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(steps):
                logits = decoder.step(tokens[i], positions[:, -1] + 1 + i)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
            decoder.release()
    return best / steps, logits.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["tiny-gemma3"], help="presets or local HF directories")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8])
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens (default 100)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timing (default 20)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    print(f"{args.dtype}, {device}, {torch.get_num_threads()} threads, prompt {args.prompt} tokens, "
          f"{args.steps} steps; ms per decode step (best of {args.repeats})")
    print("| model | fast decoder | rows | fast | model forward | forward / fast | max logit diff |")
    print("|---|---|---|---|---|---|---|")
    for name in args.model:
        model = load_causal_lm(resolve_model_path(name), dtype=getattr(torch, args.dtype), device=device).eval()
        reason = unsupported_reason(model)
        if reason is not None:
            print(f"| {name} | none: {reason} | | | | | |")
            continue
        kind = type(fast_decoder(model)).__name__
        for rows in args.rows:
            common = dict(rows=rows, prompt=args.prompt, steps=args.steps, repeats=args.repeats, device=device)
            fast, fast_logits = step_seconds(model, lambda: fast_decoder(model), **common)
            forward, forward_logits = step_seconds(model, lambda: ModelForwardDecoder(model, True), **common)
            difference = (fast_logits - forward_logits).abs().max().item()
            print(f"| {name} | {kind} | {rows} | {fast * 1e3:.1f} | {forward * 1e3:.1f} | {forward / fast:.2f}x | "
                  f"{difference:.3g} |", flush=True)


if __name__ == "__main__":
    main()
