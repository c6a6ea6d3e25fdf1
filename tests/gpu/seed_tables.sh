#!/usr/bin/env bash
# The docs' seed tables on one GPU: the embedded default job over 5 seeds and the nemotron_mini
# recipe over 3, all at once (benchmarks/seeds.py --parallel). Each run is its own process on the
# same GPU: these models leave it mostly idle (decoding is launch-bound), so a run's wall time here
# includes sharing the GPU with the seven others. The recipe generates 256 rows at a time
# (`policy.generation.batch_size`, 32 on CPU) so that a validation set is one batch; training
# rollouts are 32 episodes a step either way.
#   tests/gpu/seed_tables.sh [OUT_DIR]              # tables and each run's logs under OUT_DIR
#   RECIPE_TIMEOUT=480 tests/gpu/seed_tables.sh     # stop recipe runs after this many seconds
#   GPUS=0 QUICK=1 tests/gpu/seed_tables.sh         # the same commands on CPU, 2 steps each (a dry run)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$REPO/logs/gpu_seeds}"
PY="${PYTHON:-python3}"
GPUS="${GPUS:-1}"
mkdir -p "$OUT"
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
common=(cluster.backend=local "cluster.gpus_per_node=$GPUS")
# Eight runs at once: two of the machine's cores each rather than all of them each.
[ "$GPUS" -ge 1 ] && common+=("cluster.cpus_per_worker=$(( $(nproc) / 8 > 0 ? $(nproc) / 8 : 1 ))")
main_extra=(); recipe_extra=(policy.generation.batch_size=256)
if [ -n "${QUICK:-}" ]; then
    main_extra=(grpo.max_num_steps=2 sft_warmup.sft.max_num_steps=2 grpo.max_val_samples=8 sft_warmup.sft.max_val_samples=8)
    recipe_extra=(grpo.max_num_steps=2 grpo.max_val_samples=2 grpo.val_period=1 policy.generation.max_new_tokens=8)
fi

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/machine.txt"

t0=$SECONDS
"$PY" benchmarks/seeds.py main --seeds 1 2 3 4 5 --parallel 5 --json "$OUT/main.json" --keep "$OUT/main" \
    "${common[@]}" "${main_extra[@]}" > "$OUT/main.log" 2>&1 &
main_pid=$!
"$PY" benchmarks/seeds.py recipe --seeds 1 2 3 --parallel 3 --timeout "${RECIPE_TIMEOUT:-3600}" \
    --json "$OUT/recipe.json" --keep "$OUT/recipe" "${common[@]}" "${recipe_extra[@]}" > "$OUT/recipe.log" 2>&1 &
recipe_pid=$!
wait "$main_pid"; main_rc=$?
echo "== main: exit $main_rc after $((SECONDS - t0)) s"; cat "$OUT/main.log"
wait "$recipe_pid"; recipe_rc=$?
echo "== recipe: exit $recipe_rc after $((SECONDS - t0)) s"; cat "$OUT/recipe.log"
[ "$main_rc" -eq 0 ] && [ "$recipe_rc" -eq 0 ]
