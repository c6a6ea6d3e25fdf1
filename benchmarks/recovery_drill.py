"""A PPO run on Ray that loses a policy worker to SIGSEGV and has its generation worker frozen by
SIGSTOP, and how it recovers: whether it finishes every step, the restarts it counted, and how
long the frozen worker went unnoticed.

    ./run.sh python benchmarks/recovery_drill.py [--steps 30] [--segv-after 5] [--stop-after 13] [override ...]

The run is `posttrain ppo`'s (warm start, set-up, training, summary) on the tiny model, one policy
and one generation worker, checkpoints every 5 steps, validation at the start, every 10 steps
and at the end. Once step `--segv-after` is logged, the policy worker gets SIGSEGV (so step ~6
fails and the run goes back to its last checkpoint); once step `--stop-after` is logged, the
generation worker gets SIGSTOP (step ~14's first call to it waits for its heartbeat,
`cluster.heartbeat_timeout_s`, 60 s by default). Each signal goes once. Extra arguments are config
overrides. Prints one line per result and exits with the run's status: 0 when it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from posttrain.algorithms import ppo
from posttrain.algorithms.loop import step_callbacks
from posttrain.algorithms.on_policy import apply_warm_starts, run_on_policy
from posttrain.config.loader import load_config
from posttrain.distributed.recovery import RECORD_FILE

RUN = [
    "sft_warmup=null", "cluster.backend=ray", "policy.model_name=tiny",
    "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
    "grpo.val_at_start=true", "grpo.val_period=10", "grpo.val_at_end=true", "grpo.max_val_samples=8",
    "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
    "policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6",
    "data.num_train=256", "data.num_validation=8", "checkpointing.save_period=5",
    "logger.progress_bar=false", "logger.report=false", "logger.tensorboard_enabled=false",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--segv-after", type=int, default=5, help="SIGSEGV the policy worker once this step is logged")
    parser.add_argument("--stop-after", type=int, default=13, help="SIGSTOP the generation worker once this step is logged")
    parser.add_argument("--dir", default=None, help="run directory (default: a new temporary one)")
    args, overrides = parser.parse_known_args()
    run_dir = Path(args.dir or tempfile.mkdtemp(prefix="recovery-drill-"))
    cfg = load_config("ppo", overrides=[
        *RUN, f"grpo.max_num_steps={args.steps}", f"logger.log_dir={run_dir}/logs",
        f"checkpointing.checkpoint_dir={run_dir}/ckpt", *overrides])
    ctx = ppo.setup(apply_warm_starts(cfg))
    stopped_at: list[float] = []

    def signal_workers(step: int, _metrics: dict) -> None:
        if step == args.segv_after and not (run_dir / "segv").exists():
            (run_dir / "segv").touch()  # once: the replayed steps log this step again
            os.kill(ctx.policy.worker_group.run_all("pid")[0], signal.SIGSEGV)
        if step == args.stop_after and not stopped_at:
            pid = ctx.generation.worker_group.run_all("pid")[0]
            stopped_at.append(time.time())
            os.kill(pid, signal.SIGSTOP)

    started = time.perf_counter()
    with step_callbacks([signal_workers], "grpo"):
        finished = run_on_policy(ctx, ppo.ppo_train)
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = sorted({row["step"] for row in rows if "recovery/restarts" in row})
    last = max((row for row in rows if "recovery/restarts" in row), key=lambda row: row["step"])
    record = json.loads((run_dir / "ckpt" / RECORD_FILE).read_text())
    print(f"drill: finished={finished} in {seconds:.0f}s; steps logged {steps[0]}..{steps[-1]} ({len(steps)}), "
          f"recovery/restarts={last['recovery/restarts']:g} "
          f"(policy {last['recovery/restarts/policy']:g}, generation {last['recovery/restarts/generation']:g}, "
          f"critic {last['recovery/restarts/critic']:g}, environment {last['recovery/restarts/environment']:g})")
    if stopped_at:
        found = (run_dir / "ckpt" / RECORD_FILE).stat().st_mtime  # written when the frozen worker was found
        print(f"drill: the frozen generation worker was found {found - stopped_at[0]:.0f}s after its SIGSTOP "
              f"(cluster.heartbeat_timeout_s={cfg.cluster.heartbeat_timeout_s:g})")
    for line in record["failures"]:
        print(f"drill: failure: {line}")
    return 0 if finished and steps[-1] == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
