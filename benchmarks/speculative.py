"""Speculative sampling in the native engine against plain decoding, side by side in one run.

    ./run.sh python benchmarks/speculative.py                                   # the default job
    ./run.sh python benchmarks/speculative.py --config examples/configs/grpo_smollm2_135m.yaml \\
        --model ~/.cache/posttrain/models/smollm2-135m-instruct --shapes 4x8 1x1 --draft-layers 8

The prompts are a job's own (`--config`, default the embedded default of `posttrain grpo`: its data
section through its generator or data set, templates and tokenizer), `--shapes` PxG: P training
prompts, G generations of each next to each other (default: the job's `num_prompts_per_step` x
`num_generations_per_prompt`). The model is `--model` (a preset, a local HF directory), or the
job's policy: for a job with an SFT warm start (the default job) the warm start's export, which
is trained first if it is not in the cache (about a minute for the default job). Sampling is the
job's (`policy.generation`: temperature, max_new_tokens, eos), and greedy too with `--greedy`.

For each shape and mode, plain decoding and each `--methods` speculation (`ngram`: prompt lookup,
`early_exit`: the first `--draft-layers` layers, `draft_model`: `--draft-model`) run interleaved,
`--repeats` times (medians), all with the same seeds. Printed: seconds, generated tokens/s, the
speed-up over plain decoding, the acceptance rate (drafted tokens kept), generated tokens per policy
forward (1.0 for plain decoding; the prefill counts as one), and whether the tokens equal plain
decoding's (they should, up to float rounding; `rows same` counts the rows that are identical).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from posttrain.algorithms.on_policy import sft_warm_start_dir
from posttrain.config.loader import load_config
from posttrain.data.message_log import flatten_message_logs
from posttrain.data.processors import build_prompt_message_log
from posttrain.job import build_datums
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.speculative import SPECULATIVE_COUNTS, make_drafter
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.run_config import warm_start_dirs


def job_model(cfg, model: str | None, workdir: Path) -> str:
    """`model`, or the job's policy (its SFT warm start's export when it has one: trained if not cached)."""
    if model is not None:
        return str(Path(model).expanduser()) if Path(model).expanduser().exists() else model
    if cfg.sft_warmup is not None:
        log_dir, _ = warm_start_dirs(cfg.model_copy(update={"logger": cfg.logger.model_copy(
            update={"log_dir": str(workdir)})}), "sft_warmup")
        return str(sft_warm_start_dir(cfg.sft_warmup, log_dir))
    return cfg.policy.model_name


def job_prompts(cfg, tokenizer, num_prompts: int, generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's first `num_prompts` training prompts, each `generations` times (right-padded)."""
    datums = build_datums(cfg, build_prompt_message_log, tokenizer, "train", limit=None, lazy=True)
    logs = [datums[i].message_log for i in range(num_prompts) for _ in range(generations)]
    flat = flatten_message_logs(logs, pad_token_id=tokenizer.pad_token_id)
    return flat["input_ids"], flat["input_lengths"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a GRPO config file (default: the embedded default job)")
    parser.add_argument("--model", default=None, help="preset or HF directory (default: the job's policy)")
    parser.add_argument("--shapes", nargs="+", default=None, help="PROMPTSxGENERATIONS (default: the job's)")
    parser.add_argument("--methods", nargs="+", default=["ngram", "early_exit"],
                        choices=["ngram", "early_exit", "draft_model"])
    parser.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4])
    parser.add_argument("--ngram-size", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=None, help="early_exit (default: a quarter, at least 1)")
    parser.add_argument("--draft-model", default=None, help="draft_model: preset or HF directory")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the job's")
    parser.add_argument("--greedy", action="store_true", help="also greedy decoding (validation)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/posttrain-bench-speculative", help="the warm start's logs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config("grpo", args.config)
    model_name = job_model(cfg, args.model, Path(args.workdir))
    model = load_causal_lm(model_name)
    tokenizer = load_tokenizer(model_name)
    gen = cfg.policy.generation
    max_new = args.max_new_tokens or gen.max_new_tokens
    layers = model.config.num_hidden_layers
    draft_layers = args.draft_layers or max(1, layers // 4)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    draft_engine = None
    if "draft_model" in args.methods:
        if args.draft_model is None:
            parser.error("--methods draft_model needs --draft-model")
        draft_engine = NativeGenerationEngine(load_causal_lm(args.draft_model), pad_token_id=pad, eos_token_id=None)
    engines = {"plain": NativeGenerationEngine(model, tokenizer, pad_token_id=pad, eos_token_id=eos)}
    for method in args.methods:
        for k in args.num_draft_tokens:
            drafter = make_drafter(method, num_draft_tokens=k, ngram_size=args.ngram_size, draft_layers=draft_layers,
                                   draft_engine=draft_engine)
            engines[f"{method} k={k}"] = NativeGenerationEngine(model, tokenizer, pad_token_id=pad, eos_token_id=eos,
                                                                speculative=drafter)
    print(f"model {model_name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {layers} layers; "
          f"threads {torch.get_num_threads()}; temperature {gen.temperature}, up to {max_new} new tokens; "
          f"early_exit drafts with {draft_layers} layers; medians of {args.repeats}")

    shapes = args.shapes or [f"{cfg.grpo.num_prompts_per_step}x{cfg.grpo.num_generations_per_prompt}"]
    modes = [("sampled", False)] + ([("greedy", True)] if args.greedy else [])
    header = (f"{'shape':>6} {'mode':8} {'engine':16} {'seconds':>8} {'tok/s':>8} {'speed-up':>8} {'accepted':>9} "
              f"{'tok/fwd':>8} {'rows same':>9}")
    print(header)
    for shape in shapes:
        num_prompts, generations = map(int, shape.split("x"))
        ids, lengths = job_prompts(cfg, tokenizer, num_prompts, generations)
        seeds = torch.arange(ids.shape[0]) + 1
        for mode, greedy in modes:
            options = dict(max_new_tokens=max_new, temperature=gen.temperature, greedy=greedy, seeds=seeds,
                           stop_token_ids=gen.stop_token_ids, stop_strings=gen.stop_strings)
            seconds = {name: [] for name in engines}
            outputs = {}
            for engine in engines.values():  # warm-up: first-call allocations and kernel choices
                engine.generate(ids, lengths, **{**options, "max_new_tokens": 2})
            for _ in range(args.repeats):
                for name, engine in engines.items():  # interleaved: a busy moment hits every engine alike
                    start = time.perf_counter()
                    outputs[name] = engine.generate(ids, lengths, **options)
                    seconds[name].append(time.perf_counter() - start)
            plain_s = statistics.median(seconds["plain"])
            for name, out in outputs.items():
                s = statistics.median(seconds[name])
                tokens = int(out["generation_lengths"].sum())
                same = sum(torch.equal(out["output_ids"][i], outputs["plain"]["output_ids"][i])
                           for i in range(ids.shape[0]))
                if name == "plain":
                    accepted, per_forward = "", 1.0
                else:
                    drafted, kept, forwards = (int(out[key].sum()) for key in SPECULATIVE_COUNTS)
                    accepted, per_forward = f"{kept / max(drafted, 1):9.2f}", tokens / forwards
                print(f"{shape:>6} {mode:8} {name:16} {s:8.2f} {tokens / s:8.0f} {plain_s / s:8.2f} {accepted:>9} "
                      f"{per_forward:8.2f} {same:>4}/{ids.shape[0]:<4}")
    print("(speed-up: plain seconds / these seconds, above 1 is faster; accepted: drafted tokens kept; "
          "tok/fwd: generated tokens per policy forward, prefill included)")


if __name__ == "__main__":
    main()
