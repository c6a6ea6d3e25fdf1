"""A decode step under each OpenMP wait setting, alone and beside another thread's team, side by side
in one run.

    ./run.sh python benchmarks/openmp_wait.py            # SmolLM2-135M-Instruct in bfloat16, 2 and 32 rows
    ./run.sh python benchmarks/openmp_wait.py --model tiny --dtype float32

A decode step of a small model is hundreds of small parallel regions (every matmul, norm and add),
so what an OpenMP thread does between two of them decides much of its time. Settings, each in a
process of its own (OpenMP reads them once, when torch loads):
- default: posttrain's (`OMP_WAIT_POLICY=PASSIVE`, `GOMP_SPINCOUNT=10000`: a spin of about 0.1 ms,
  then sleep; `posttrain/__init__.py`);
- passive: `OMP_WAIT_POLICY=PASSIVE` alone (sleep at once: posttrain's default before 2026-11-28);
- spinning: `OMP_WAIT_POLICY=ACTIVE` (spin for minutes: what torch does with nothing set is a 3 ms
  spin, alike on a quiet machine).
In each, the main thread's decode step (`decode_step.decode_seconds`, grouped attention) is timed
- alone;
- beside an idle team: another thread ran one parallel region and now waits, as an idle
  local-backend worker did before it gave its team back; GNU OpenMP then counts more threads than
  cores and cuts every spin short;
- beside a released team: the same thread after `posttrain.utils.openmp.release_thread_team()`,
  what an idle local actor now does.
`benchmarks/busy_machine.py` measures the same settings beside CPU hogs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

from posttrain.utils.openmp import environment_with_wait  # first: it sets OpenMP's waiting before torch loads OpenMP

SETTINGS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spinning": {"OMP_WAIT_POLICY": "ACTIVE"},
}
PLACES = ("alone", "idle team", "released team")


def measure(args) -> dict[str, dict[int, float]]:
    """ms per decode step, per place and row count, in this process."""
    import torch

    from decode_step import decode_seconds
    from posttrain.models.hf import load_causal_lm, resolve_model_path
    from posttrain.utils.openmp import release_thread_team

    model = load_causal_lm(resolve_model_path(args.model), dtype=getattr(torch, args.dtype)).eval()
    out: dict[str, dict[int, float]] = {}

    def time_rows(place: str) -> None:
        out[place] = {rows: 1000 * decode_seconds(model, rows, False, True, args.prompt, args.steps, args.repeats)[0]
                      for rows in args.rows}

    time_rows("alone")
    for place in PLACES[1:]:
        has_team, stop = threading.Event(), threading.Event()

        def other_thread(release: bool = place == "released team") -> None:
            torch.randn(4_000_000).exp().sum()  # one parallel region: this thread now has a team
            if release:
                release_thread_team()
            has_team.set()
            stop.wait()

        thread = threading.Thread(target=other_thread)
        thread.start()
        has_team.wait()
        try:
            time_rows(place)
        finally:
            stop.set()
            thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="local HF directory or preset")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--prompt", type=int, default=80, help="prompt tokens (default 80)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timing (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell, the best kept (default 5)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one setting, in this process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return

    results = {}
    for name in args.settings:
        child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]],
                               env=environment_with_wait(SETTINGS[name]), capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"[openmp_wait] {name} failed:\n{child.stderr[-3000:]}")
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"[openmp_wait] {name}: {results[name]}", flush=True)

    base = results.get("passive", next(iter(results.values())))
    print(f"\n{args.model} in {args.dtype}, {os.cpu_count()} cores: ms per decode step (best of {args.repeats} x "
          f"{args.steps} steps), and the speed-up against passive waiting alone")
    print(f"{'setting':10s} {'rows':>4s} " + " ".join(f"{place:>22s}" for place in PLACES))
    for name, cells in results.items():
        for rows in args.rows:
            row = " ".join(f"{cells[p][str(rows)]:10.1f} ms ({base['alone'][str(rows)] / cells[p][str(rows)]:4.2f}x)"
                           for p in PLACES)
            print(f"{name:10s} {rows:4d} {row}")


if __name__ == "__main__":
    main()
