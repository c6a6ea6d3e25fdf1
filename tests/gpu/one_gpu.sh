#!/usr/bin/env bash
# The checks one GPU can run (docs/scaling.md, "GPU-only paths"): the embedded default job on the
# GPU in float32 and with bfloat16 mixed precision (FSDP2's MixedPrecisionPolicy), then the
# one-GPU test of tests/gpu (the memory plan against torch.cuda.max_memory_allocated), then a
# resume: 20 GRPO steps in one go against 10 steps, a restart, and 10 more (checkpoints with the
# CUDA RNG state), compared step by step; then the default job with policy.offload_during_generation
# true and false: each phase's peak memory/<phase>/allocated_gb, and whether training is identical.
#   tests/gpu/one_gpu.sh [OUT_DIR]          # logs and metrics under OUT_DIR (default logs/one_gpu)
#   GPUS=0 STEPS=3 tests/gpu/one_gpu.sh     # the same commands on CPU, shortened (a dry run)
#   PARTS="resume" tests/gpu/one_gpu.sh     # some of: fp32 bf16 tests resume offload (default: all)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$REPO/logs/one_gpu}"
PY="${PYTHON:-python3}"
GPUS="${GPUS:-1}"
STEPS="${STEPS:-}"          # empty: the default job's own 250 GRPO steps
PARTS=" ${PARTS:-fp32 bf16 tests resume offload} "
mkdir -p "$OUT"
cd "$REPO" || exit 1
CKPT="${CKPT:-$OUT}"        # checkpoints (large) may go elsewhere than the logs
export PYTHONUNBUFFERED=1
common=(cluster.backend=local "cluster.gpus_per_node=$GPUS" logger.progress_bar=false)
steps=()
[ -n "$STEPS" ] && steps=("grpo.max_num_steps=$STEPS" "sft_warmup.sft.max_num_steps=$STEPS")
status=0

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/machine.txt"

run() {  # run NAME LIMIT_S ARGS...: one command, its output in OUT/NAME.log, its wall time printed
    local name="$1" limit="$2"; shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 4 "$OUT/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

if [[ "$PARTS" == *" fp32 "* ]]; then
    run default_fp32 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${steps[@]}" \
        "logger.log_dir=$OUT/default_fp32" "checkpointing.checkpoint_dir=$CKPT/ckpt_fp32"
fi
if [[ "$PARTS" == *" bf16 "* ]]; then
    run default_bf16 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${steps[@]}" policy.precision=bfloat16 \
        "logger.log_dir=$OUT/default_bf16" "checkpointing.checkpoint_dir=$CKPT/ckpt_bf16"
fi
if [[ "$PARTS" == *" tests "* ]] && [ "$GPUS" -ge 1 ]; then
    run gpu_tests 300 "$PY" -m pytest tests/gpu -q -s -rs -p no:cacheprovider
fi
if [[ "$PARTS" == *" resume "* ]]; then
    short=(grpo.val_period=0 grpo.val_at_start=false grpo.val_at_end=false checkpointing.save_period=10
           "sft_warmup.sft.max_num_steps=${STEPS:-350}")
    run resume_whole 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${short[@]}" grpo.max_num_steps=20 \
        "logger.log_dir=$OUT/resume_whole" "checkpointing.checkpoint_dir=$CKPT/ckpt_whole"
    run resume_first 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${short[@]}" grpo.max_num_steps=10 \
        "logger.log_dir=$OUT/resume_parts" "checkpointing.checkpoint_dir=$CKPT/ckpt_parts"
    run resume_second 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${short[@]}" grpo.max_num_steps=20 \
        "logger.log_dir=$OUT/resume_parts" "checkpointing.checkpoint_dir=$CKPT/ckpt_parts"
    "$PY" - "$OUT/resume_whole/metrics.jsonl" "$OUT/resume_parts/metrics.jsonl" <<'PYTHON' || status=1
import sys
from posttrain.utils.logger import read_metrics_jsonl as steps
whole, parts = steps(sys.argv[1]), steps(sys.argv[2])
keys = ["train/loss", "train/reward", "train/grad_norm", "train/token_mult_prob_error"]
worst = {k: max(abs(whole[s][k] - parts[s][k]) for s in range(11, 21)) for k in keys}
print("resumed steps 11-20 against one run, largest difference per metric:", worst)
print("bit-exact resume:", "yes" if not any(worst.values()) else "no")
PYTHON
fi
if [[ "$PARTS" == *" offload "* ]]; then
    # The local backend's native engine borrows the policy's weights, so the parameters stay on the
    # GPU and gradients and optimizer state move (models/policy/offload.py).
    short=(grpo.val_period=0 grpo.val_at_start=false grpo.val_at_end=false checkpointing.enabled=false
           "sft_warmup.sft.max_num_steps=${STEPS:-350}" "grpo.max_num_steps=${STEPS:-10}")
    for offload in true false; do
        run "offload_$offload" 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${short[@]}" \
            "policy.offload_during_generation=$offload" "logger.log_dir=$OUT/offload_$offload"
    done
    "$PY" - "$OUT/offload_true/metrics.jsonl" "$OUT/offload_false/metrics.jsonl" <<'PYTHON' || status=1
import sys
from posttrain.utils.logger import read_metrics_jsonl as steps
on, off = steps(sys.argv[1]), steps(sys.argv[2])
for phase in ("generation", "refit", "logprobs", "training"):
    for stat in ("allocated_gb", "reserved_gb", "peak_rss_gb"):
        key = f"memory/{phase}/{stat}"
        if any(key in row for row in on.values()):
            print(f"{key:36s} offload on: max {max(r.get(key, 0) for r in on.values()):.3f}"
                  f"  off: max {max(r.get(key, 0) for r in off.values()):.3f}")
moved = [r["memory/offload/moved_gb"] for r in on.values() if "memory/offload/moved_gb" in r]
print("moved to host per step (GiB):", f"{max(moved):.3f}" if moved else "nothing (CPU: a no-op)")
train = lambda rows, s: {k: v for k, v in rows[s].items() if k.startswith("train/")}
differ = [s for s in off if train(on, s) != train(off, s)]
print("training metrics identical with and without offloading:", "yes" if not differ else f"no (steps {differ})")
sys.exit(1 if differ or sorted(on) != sorted(off) else 0)
PYTHON
fi
exit "$status"
