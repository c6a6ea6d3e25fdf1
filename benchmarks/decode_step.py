"""One decode step of the native engine's llama-like decoder on CPU, by attention kernel and by the
thread it runs on, side by side in one run.

    ./run.sh python benchmarks/decode_step.py            # SmolLM2-135M-Instruct in bfloat16
    ./run.sh python benchmarks/decode_step.py --model tiny --dtype float32 --rows 8

Printed per batch (`--rows`, left-padded or not): the best of `--repeats` timings of `--steps`
decode steps after a prompt of `--prompt` tokens, for
- attention: `grouped` (`decoders.grouped_decode_attention`: two matmuls over the whole cache
  buffers, what the decoder runs on CPU in 16 bits) against `sdpa` (the SDPA calls transformers
  makes, what it runs elsewhere), with the largest logit difference between them;
- thread: the main thread against another one (the local backend runs each worker on a thread
  of its own, `distributed/actors.py`). With GNU OpenMP the second thread to run parallel work
  gets a slower team: small operations, which a decode step is made of, pay for it.
"""

from __future__ import annotations

import argparse
import threading

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from transformers import DynamicCache

from bench_timing import best_seconds

from posttrain.models.generation.decoders import LlamaLikeDecoder
from posttrain.models.hf import load_causal_lm, resolve_model_path


def decode_seconds(model, rows: int, padded: bool, grouped: bool, prompt: int, steps: int, repeats: int):
    """Seconds per decode step (best of `repeats` runs of `steps` steps) and the last step's logits."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, prompt), generator=generator)
    mask = torch.ones(rows, prompt, dtype=torch.long)
    if padded:
        mask[::2, : prompt // 3] = 0  # every other row left-padded by a third
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    decoder = LlamaLikeDecoder(model)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        decoder.start(cache, mask, torch.arange(rows), capacity=prompt + steps + 1)
        decoder.cpu_16bit = decoder.cpu_16bit and grouped
        last = {}

        def run() -> None:
            decoder.length = prompt  # the same cache columns every run
            for i in range(steps):
                last["logits"] = decoder.step(tokens, positions[:, -1] + 1 + i)

        seconds = best_seconds(run, repeats) / steps
    return seconds, last["logits"].float()


def on_other_thread(fn):
    """`fn()` run on a new thread (as a local-backend worker runs), its result returned."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()))
    thread.start()
    thread.join()
    return box["result"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="local HF directory or preset")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 4])
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens (default 100)")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per timing (default 10)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = load_causal_lm(resolve_model_path(args.model), dtype=getattr(torch, args.dtype)).eval()
    print(f"{args.model} in {args.dtype}, {torch.get_num_threads()} threads, prompt {args.prompt} tokens; "
          "ms per decode step (best of runs)")
    print("| rows | padded | grouped, main thread | sdpa, main thread | sdpa / grouped | max logit diff | "
          "grouped, other thread | other thread / main |")
    print("|---|---|---|---|---|---|---|---|")
    common = dict(prompt=args.prompt, steps=args.steps, repeats=args.repeats)
    for rows in args.rows:
        for padded in (False, True):
            grouped, grouped_logits = decode_seconds(model, rows, padded, True, **common)
            sdpa, sdpa_logits = decode_seconds(model, rows, padded, False, **common)
            threaded, _ = on_other_thread(lambda: decode_seconds(model, rows, padded, True, **common))
            difference = (grouped_logits - sdpa_logits).abs().max().item()
            print(f"| {rows} | {'yes' if padded else 'no'} | {grouped * 1e3:.1f} | {sdpa * 1e3:.1f} | "
                  f"{sdpa / grouped:.2f}x | {difference:.3g} | {threaded * 1e3:.1f} | {threaded / grouped:.2f}x |")


if __name__ == "__main__":
    main()
