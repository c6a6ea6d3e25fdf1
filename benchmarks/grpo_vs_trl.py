"""posttrain GRPO vs Hugging Face TRL `GRPOTrainer`, side by side in one run on the same CPU.

TRL is not a posttrain dependency. Run this script from a separate environment that has both
(plain pip keeps torch on the local CPU wheel; `pip list | grep -i nvidia` must print nothing):

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0
    /tmp/trlvenv/bin/pip install -e . trl==1.16.0      # 1.16.0 works with transformers 5.23.0
    /tmp/trlvenv/bin/python benchmarks/grpo_vs_trl.py [--steps 60]

Both sides start from the same SFT-warmed tiny model (the cached `sft_warmup` of
`examples/configs/grpo_math_tiny.yaml`, built with posttrain on first use), train on the same
8000 two-digit additions with the tiny model's chat template, and are rewarded by the same rule
(1 when the last number of the response equals the answer, else 0). Same group shape
(`--prompts-per-step` x `--generations`, default 16 x 8), max new tokens (16), temperature 1.0,
AdamW at a constant lr 1e-4 (weight decay 0, grad-norm clip 1.0), clip epsilon 0.2, no KL
(beta 0), one optimizer step per generation batch, token-level loss over the whole batch
(TRL `loss_type="dapo"`, posttrain `loss_fn.token_level_loss`), group-normalised advantages.

Measured per side: start-up (everything before the first step), wall time per step (the first
step, and the mean and median of the rest), and greedy validation accuracy on the same held-out
problems before and after training. Both models are scored by one evaluator in this script (HF
`generate`, greedy), so neither library's own evaluation code is in the comparison. Printed
ratios: posttrain steps/s over TRL steps/s (> 1: posttrain is faster), and each side's accuracy
gain in points.

Where the two cannot be configured identically (printed with the results as well):
- Advantage std: TRL divides by the unbiased group std + 1e-4, posttrain by the population std
  + 1e-6, so TRL's advantages are sqrt((G-1)/G) (0.935 for G=8) of posttrain's; AdamW is almost
  invariant to such a uniform scale.
- Old logprobs: neither side runs a separate no-grad pass here (one optimizer step per batch:
  both take the ratio as exp(logp - logp.detach()) = 1). posttrain still measures
  `token_mult_prob_error` from its training forward.
- Process layout: posttrain runs training and generation in Ray actors (one CPU thread each, so
  TRL gets `--trl-threads 1` by default) and copies the weights to the generation actor every
  step; TRL trains and generates in this process. posttrain decodes with its native engine
  (finished rows are dropped), TRL with HF `generate` on the whole left-padded batch.
- Prompt order and sampling randomness: both draw from the same 8000 problems, each with its
  own seeded shuffle, so the 60 x 16 prompts seen and the sampled completions differ.
- Reward: posttrain's math environment sends non-plain answers (fractions, LaTeX) to math-verify;
  the TRL reward here compares plain numbers only. The tiny model only writes digits, so the two
  agree on this task.

On a 2-core machine shared with other jobs, timings move by tens of percent from run to run:
compare the ratio, not the absolute seconds, and prefer the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

TRL_VERSION = "1.16.0"  # the version this benchmark was written and run against
ANSWER_FORMAT = "last_number"
POSTTRAIN_PHASES = ("generation", "reward", "refit", "logprobs", "policy_training")


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
            f"  /tmp/trlvenv/bin/pip install -e . trl=={TRL_VERSION}\n"
            "  /tmp/trlvenv/bin/python benchmarks/grpo_vs_trl.py"
        )
    return trl.__version__


# ---------------------------------------------------------------------------- shared pieces
def exact_match(response: str, answer: str) -> float:
    """1.0 when the last number in `response` equals `answer` (plain decimal comparison), else 0.0."""
    from posttrain.environments.math_env import extract_answer, plain_numbers_equal

    extracted = extract_answer(response, ANSWER_FORMAT)
    return float(extracted is not None and plain_numbers_equal(answer, extracted) is True)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int, batch_size: int = 250) -> float:
    """Fraction of `records` ({"prompt", "answer"}) answered exactly, greedy HF `generate`.

    One evaluator for both sides, so the before/after numbers differ only by the weights.
    """
    model.eval()
    correct = 0.0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            for r in chunk
        ]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        responses = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(exact_match(text, r["answer"]) for text, r in zip(responses, chunk))
    return correct / len(records)


def step_summary(step_seconds: list[float]) -> dict[str, float]:
    """First step, and mean / median of the others (the steady state)."""
    rest = step_seconds[1:] or step_seconds
    return {"first": step_seconds[0], "mean": statistics.fmean(rest), "median": statistics.median(rest)}


# ------------------------------------------------------------------------------- posttrain
def posttrain_config(args: argparse.Namespace, log_dir: Path):
    """The default GRPO config (grpo_math_tiny.yaml) with this benchmark's settings."""
    from posttrain.config.loader import load_config

    batch = args.prompts_per_step * args.generations
    return load_config("grpo", overrides=[
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
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false", "logger.progress_bar=false",
        "logger.report=false",
    ])


def warm_start(cfg):
    """Config pointing at the cached SFT warm start (built with posttrain SFT on first use)."""
    # grpo.run calls the same helper; the cache key is a hash of the `sft_warmup` section.
    from posttrain.algorithms.grpo import apply_sft_warm_start

    return apply_sft_warm_start(cfg)


def run_posttrain(cfg, val_records: list[dict], args: argparse.Namespace) -> dict:
    """Train with posttrain's GRPO loop; start-up, per-step seconds, rewards, accuracy after."""
    from posttrain.algorithms.grpo import grpo_train, setup
    from posttrain.distributed.ray_utils import shutdown_ray
    from posttrain.models.hf import load_causal_lm
    from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

    start = time.perf_counter()
    ctx = setup(cfg)
    startup = time.perf_counter() - start
    try:
        loop_start = time.perf_counter()
        grpo_train(ctx)
        loop = time.perf_counter() - loop_start
        final_state = ctx.policy.state_dict_for_export()
    finally:
        ctx.shutdown()
        shutdown_ray()
    metrics = read_metrics_jsonl(Path(cfg.logger.log_dir) / METRICS_FILE)
    steps = [metrics[s]["timing/train/total_step_time"] for s in sorted(metrics)]
    rewards = [metrics[s]["train/reward"] for s in sorted(metrics)]
    # Where a steady-state step's time goes (median over steps 2..N, seconds).
    breakdown = {
        phase: statistics.median(metrics[s][f"timing/train/{phase}"] for s in sorted(metrics)[1:] or sorted(metrics))
        for phase in POSTTRAIN_PHASES
    }

    model = load_causal_lm(cfg.policy.model_name, dtype=torch.float32, device=torch.device("cpu"))
    model.load_state_dict(final_state)
    return {
        "startup": startup, "loop": loop, "steps": steps, "rewards": rewards, "breakdown": breakdown,
        "after": greedy_accuracy(model, ctx.tokenizer, val_records, args.max_new_tokens),
    }


# ------------------------------------------------------------------------------------- TRL
def run_trl(warm_dir: str, train_records: list[dict], val_records: list[dict], args: argparse.Namespace,
            out_dir: Path) -> dict:
    """Train with TRL's GRPOTrainer from the same warm start; the same measurements as `run_posttrain`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, reward, loss, backward, optimizer)."""

        def __init__(self) -> None:
            self.first_begin: float | None = None
            self.begin = self.last_end = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()
            self.first_begin = self.first_begin or self.begin

        def on_step_end(self, args, state, control, **kwargs):
            self.last_end = time.perf_counter()
            self.seconds.append(self.last_end - self.begin)

    def reward(completions, answer, **kwargs) -> list[float]:
        # Conversational data: each completion is a list with one assistant message.
        return [exact_match(c[0]["content"], a) for c, a in zip(completions, answer)]

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train_records]
    )
    config = GRPOConfig(
        output_dir=str(out_dir),
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
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(warm_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # one dict per step on stdout; the summary is printed at the end
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {
        "startup": timer.first_begin - start, "loop": timer.last_end - timer.first_begin,
        "steps": timer.seconds, "rewards": rewards,
        "after": greedy_accuracy(trainer.model, tokenizer, val_records, args.max_new_tokens),
    }


# ------------------------------------------------------------------------------------ report
NOT_IDENTICAL = (
    "advantages: TRL divides by the unbiased group std + 1e-4, posttrain by the population std + 1e-6 "
    "(TRL's are sqrt((G-1)/G) of posttrain's; AdamW is nearly invariant to that scale)",
    "posttrain: Ray actors (1 thread each), weights copied to the generation actor every step, native engine; "
    "TRL: one process, HF generate on the padded batch",
    "prompt order and sampling randomness differ (same problem pool, each side's own seeded shuffle)",
    "reward: posttrain's environment sends non-plain answers to math-verify, TRL's reward compares plain numbers "
    "only (the tiny model writes digits, so they agree here)",
)


def print_report(args, trl_version: str, before: float, results: dict[str, dict]) -> None:
    print(f"\nGRPO, {args.steps} steps of {args.prompts_per_step} prompts x {args.generations} generations, "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, lr={args.lr}, beta=0; "
          f"torch {torch.__version__}, trl {trl_version}, posttrain worker threads=1, TRL threads={args.trl_threads}; "
          f"validation: {args.val_samples} held-out problems, greedy, one evaluator for both")
    header = (f"{'':10s} {'start-up s':>10s} {'step 1 s':>9s} {'step s (mean)':>13s} {'step s (median)':>15s} "
              f"{'steps/s':>8s} {'train reward':>12s} {'val before':>10s} {'val after':>9s} {'gain':>7s}")
    print(header)
    for name, r in results.items():
        s = step_summary(r["steps"])
        last = r["rewards"][-10:]
        print(f"{name:10s} {r['startup']:10.1f} {s['first']:9.2f} {s['mean']:13.3f} {s['median']:15.3f} "
              f"{1 / s['mean']:8.2f} {statistics.fmean(last):12.3f} {before:10.1%} {r['after']:9.1%} "
              f"{(r['after'] - before) * 100:+6.1f}p")
    print("(step s: steps 2..N; train reward: mean of the last 10 steps; gain in percentage points)")
    pt, trl = step_summary(results["posttrain"]["steps"]), step_summary(results["trl"]["steps"])
    print(f"ratio posttrain/TRL steps/s: {trl['mean'] / pt['mean']:.2f}x (mean), "
          f"{trl['median'] / pt['median']:.2f}x (median)")
    phases = ", ".join(f"{k} {v:.3f}" for k, v in results["posttrain"]["breakdown"].items())
    print(f"posttrain step breakdown (median s): {phases}")
    print(f"loop wall time: posttrain {results['posttrain']['loop']:.1f}s, TRL {results['trl']['loop']:.1f}s")
    print(f"accuracy gain: posttrain {(results['posttrain']['after'] - before) * 100:+.1f} points, "
          f"TRL {(results['trl']['after'] - before) * 100:+.1f} points")
    print("not configured identically:")
    for line in NOT_IDENTICAL:
        print(f"  - {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per side (default 60)")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step (default 16)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt, G (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="default 16")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, constant (default 1e-4)")
    parser.add_argument("--val-samples", type=int, default=500, help="held-out problems (default 500)")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch CPU threads for TRL (default 1, as each posttrain worker)")
    parser.add_argument("--seed", type=int, default=42, help="default 42")
    args = parser.parse_args()
    trl_version = require_trl()

    from posttrain.data.datasets import load_records
    from posttrain.models.hf import load_causal_lm, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        cfg = warm_start(posttrain_config(args, Path(tmp) / "posttrain"))
        warm_dir = cfg.policy.model_name
        train_records = load_records(cfg.data, "train")
        val_records = load_records(cfg.data, "validation")[: args.val_samples]
        if len(val_records) < args.val_samples:
            raise SystemExit(f"--val-samples {args.val_samples}: the config has only {len(val_records)} "
                             "validation problems (data.num_validation)")

        torch.set_num_threads(args.trl_threads)  # this process: evaluation and TRL
        before = greedy_accuracy(
            load_causal_lm(warm_dir, dtype=torch.float32, device=torch.device("cpu")), load_tokenizer(warm_dir),
            val_records, args.max_new_tokens,
        )
        print(f"[grpo_vs_trl] warm start {warm_dir}: validation accuracy {before:.1%}", flush=True)
        results = {"posttrain": run_posttrain(cfg, val_records, args)}
        done = results["posttrain"]
        print(f"[grpo_vs_trl] posttrain done: start-up {done['startup']:.1f}s, {args.steps} steps in "
              f"{done['loop']:.1f}s, validation accuracy {done['after']:.1%}", flush=True)
        results["trl"] = run_trl(warm_dir, train_records, val_records, args, Path(tmp) / "trl")
    print_report(args, trl_version, before, results)


if __name__ == "__main__":
    main()
