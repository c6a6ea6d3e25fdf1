#!/usr/bin/env bash
# The checks one GPU can run (docs/scaling.md, "GPU-only paths"): the embedded default job on the
# GPU in float32 and with bfloat16 mixed precision (FSDP2's MixedPrecisionPolicy), then the
# one-GPU test of tests/gpu (the memory plan against torch.cuda.max_memory_allocated).
#   tests/gpu/one_gpu.sh [OUT_DIR]          # logs and metrics under OUT_DIR (default logs/one_gpu)
#   GPUS=0 STEPS=3 tests/gpu/one_gpu.sh     # the same commands on CPU, shortened (a dry run)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$REPO/logs/one_gpu}"
PY="${PYTHON:-python3}"
GPUS="${GPUS:-1}"
STEPS="${STEPS:-}"          # empty: the default job's own 250 GRPO steps
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

run default_fp32 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${steps[@]}" \
    "logger.log_dir=$OUT/default_fp32" "checkpointing.checkpoint_dir=$CKPT/ckpt_fp32"
run default_bf16 240 "$PY" -m posttrain.cli grpo "${common[@]}" "${steps[@]}" policy.precision=bfloat16 \
    "logger.log_dir=$OUT/default_bf16" "checkpointing.checkpoint_dir=$CKPT/ckpt_bf16"
if [ "$GPUS" -ge 1 ]; then
    run gpu_tests 300 "$PY" -m pytest tests/gpu -q -s -rs -p no:cacheprovider
fi
exit "$status"
