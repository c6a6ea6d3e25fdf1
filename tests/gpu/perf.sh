#!/usr/bin/env bash
# What one GPU measures for docs/performance.md: benchmarks/gpu_one.py on the 100m preset (native
# decode against HF generate, fp8 generation against bf16, a bf16 training step's MFU), the
# one-GPU tests of tests/gpu, the embedded default job with fp8 and with bf16 generation beside
# float32 training (accuracy and the mismatch metric), then gpu_one.py on the 1b preset.
#   tests/gpu/perf.sh [OUT_DIR]             # logs under OUT_DIR (default logs/gpu_perf)
#   QUICK=1 tests/gpu/perf.sh               # the same commands on CPU, shortened (a dry run)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$REPO/logs/gpu_perf}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
status=0
quick=(); models=(100m 1b); steps=(); gpus=1
if [ -n "${QUICK:-}" ]; then
    quick=(--quick); models=(tiny tiny); steps=(grpo.max_num_steps=3 sft_warmup.sft.max_num_steps=3); gpus=0
fi

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/machine.txt"

step() {  # step NAME LIMIT_S ARGS...: one command, its output in OUT/NAME.log and on the console
    local name="$1" limit="$2"; shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v "Loading weights\|it/s\]" | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

summary() {  # the validation accuracy at the start and end, and the mismatch metrics of a run
    "$PY" - "$1/metrics.jsonl" <<'PYTHON'
import sys
from posttrain.utils.logger import read_metrics_jsonl
rows = read_metrics_jsonl(sys.argv[1])
key = next(k for k in ("validation/accuracy_greedy", "validation/accuracy") if any(k in r for r in rows.values()))
val = [(s, r[key]) for s, r in sorted(rows.items()) if key in r]
mism = [r["train/token_mult_prob_error"] for r in rows.values() if "train/token_mult_prob_error" in r]
print(f"validation accuracy {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]});"
      f" token_mult_prob_error mean {sum(mism) / len(mism):.4f}, max {max(mism):.4f} over {len(mism)} steps")
PYTHON
}

step gpu_one_${models[0]} 200 "$PY" benchmarks/gpu_one.py --models "${models[0]}" "${quick[@]}"
[ "$gpus" -ge 1 ] && step gpu_tests 150 "$PY" -m pytest tests/gpu -n 0 -q -rs -p no:cacheprovider
for precision in fp8 bfloat16; do
    [ "$precision" = fp8 ] && [ "$gpus" -eq 0 ] && continue  # refused without FP8 hardware
    step "grpo_$precision" 120 "$PY" -m posttrain.cli grpo cluster.backend=local "cluster.gpus_per_node=$gpus" \
        logger.progress_bar=false checkpointing.enabled=false "policy.generation.precision=$precision" \
        "${steps[@]}" "logger.log_dir=$OUT/grpo_$precision"
    summary "$OUT/grpo_$precision" | tee -a "$OUT/grpo_$precision.log"
done
step gpu_one_${models[1]} 240 "$PY" benchmarks/gpu_one.py --models "${models[1]}" "${quick[@]}"
exit "$status"
