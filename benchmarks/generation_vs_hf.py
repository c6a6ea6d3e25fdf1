"""Native generation engine vs Hugging Face `model.generate`, side by side in one run.

Same model, same batch of random prompts (right-padded, mixed lengths up to `--prompt-len`), same
number of new tokens; greedy and sampled. Prints generated tokens per second of each and the
ratio native / HF (> 1: the native engine is faster).

By default no token ends a row, so both do exactly the same work. With `--stop-fraction F`, a
seeded random F of the vocabulary ends a row (as eos would), so rows stop at uneven lengths as in
RL rollouts: HF `generate` keeps computing finished rows until the last one ends, the native
engine drops them from the running batch. Tokens/s then counts each engine's generated tokens up
to and including the stop token.

    python benchmarks/generation_vs_hf.py --model tiny --batch 64 --prompt-len 16 --new-tokens 32
    python benchmarks/generation_vs_hf.py --stop-fraction 0.02
"""

from __future__ import annotations

import argparse

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from baselines import HFGenerateBaseline
from bench_timing import timed

from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.hf import load_causal_lm, pick_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset, local HF directory or hub id (default tiny)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--stop-fraction", type=float, default=0.0,
                        help="fraction of the vocabulary that ends a row (default 0: rows never stop early)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(args.model, dtype=pick_dtype(args.precision, device), device=device)
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    torch.manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), device=device)
    input_ids = torch.randint(8, vocab, (args.batch, args.prompt_len), device=device)
    input_ids[torch.arange(args.prompt_len, device=device).unsqueeze(0) >= lengths.unsqueeze(1)] = pad

    candidates = torch.tensor([t for t in range(vocab) if t != pad])
    num_stop = round(args.stop_fraction * vocab)
    stop_ids = candidates[torch.randperm(len(candidates), generator=torch.Generator().manual_seed(1))[:num_stop]]
    stop_ids = stop_ids.tolist() or None
    native = NativeGenerationEngine(model, None, pad_token_id=pad, eos_token_id=None)
    hf = HFGenerateBaseline(model, pad_token_id=pad, eos_token_id=stop_ids)
    print(
        f"model={args.model} device={device} dtype={next(model.parameters()).dtype} batch={args.batch} "
        f"prompt_len<={args.prompt_len} new_tokens={args.new_tokens} stop ids={num_stop} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'mode':8s} {'native tok/s':>13s} {'hf tok/s':>10s} {'native/hf':>10s} {'mean len':>9s}")
    for mode, sampling in (("greedy", dict(greedy=True)), ("sampled", dict(temperature=1.0, top_p=0.9, top_k=50))):
        native_s, out = timed(
            lambda: native.generate(
                input_ids, lengths, max_new_tokens=args.new_tokens, stop_token_ids=stop_ids, **sampling
            ),
            args.repeats,
        )
        native_tokens = int(out["generation_lengths"].sum())
        hf_s, hf_out = timed(lambda: hf.generate(input_ids, lengths, max_new_tokens=args.new_tokens, **sampling), args.repeats)
        hf_lengths = generated_lengths(hf_out, stop_ids)
        if mode == "greedy":  # same weights, same argmax: the two engines must agree
            assert out["generation_lengths"].tolist() == hf_lengths.tolist(), "greedy lengths differ from HF"
            gen = torch.stack(
                [out["output_ids"][i, lengths[i] : lengths[i] + args.new_tokens] for i in range(args.batch)]
            )
            valid = torch.arange(args.new_tokens)[None] < hf_lengths[:, None]
            agree = (gen[:, : hf_out.shape[1]] == hf_out)[valid[:, : hf_out.shape[1]]].float().mean().item()
            print(f"  greedy token agreement with HF generate: {agree:.4f}")
        native_rate, hf_rate = native_tokens / native_s, int(hf_lengths.sum()) / hf_s
        print(f"{mode:8s} {native_rate:13.0f} {hf_rate:10.0f} {native_rate / hf_rate:10.2f} "
              f"{native_tokens / args.batch:9.1f}")


def generated_lengths(tokens: torch.Tensor, stop_ids) -> torch.Tensor:
    """Tokens per row of HF's `[B, T]` output, up to and including the first stop id."""
    batch, width = tokens.shape
    if not stop_ids:
        return torch.full((batch,), width)
    is_stop = torch.isin(tokens, torch.tensor(stop_ids))
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((batch,), width))
    return first


if __name__ == "__main__":
    main()
