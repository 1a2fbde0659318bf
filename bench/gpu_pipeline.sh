#!/usr/bin/env bash
# Run the whole pipeline on a GPU machine with one of the GPU configs and summarise it into OUT_DIR/NAME.
#   bash bench/gpu_pipeline.sh [--out OUT_DIR] configs/gpu-2x-disaggregated.yaml NAME TIME_LIMIT_S [a.b=c ...]
# OUT_DIR defaults to $OUT, else gpu-out/ in the repository. Needs the `gpu` extra (sglang) and
# megatron-core. Uses the exported basic_arithmetic JSONL (bench/export_task.py) and the `math` reward,
# so reasoning-gym is not needed there. The run directory is OUT_DIR/NAME/run (its metrics survive a run
# that is cut off); its checkpoints and HF export are deleted at the end unless KEEP_CHECKPOINTS=1, and
# the buffer lives in /tmp.
set -uo pipefail
out_root=${OUT:-}
if [ "${1:-}" = "--out" ]; then out_root=$2; shift 2; fi
cfg=$1; name=$2; limit=$3; shift 3
cd "$(dirname "$0")/.."
out_root=${out_root:-$PWD/gpu-out}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # an NCCL failure then says why, in the stage's log
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=$out_root/$name; mkdir -p "$out"
# the run directory lives under $OUT: whatever happens (a call cut off by its time limit included), the
# metrics written so far come back. The buffer's segments stay out of it (they can be large).
run=$out/run
python - <<'PY' || exit 1
import importlib, time
t = time.time()
for m in ("ray", "zmq", "msgspec", "pyarrow", "megatron.core", "sglang", "transformers", "gguf"):
    importlib.import_module(m)
import torch
print(f"preflight ok: {torch.cuda.device_count()} GPUs, imports {time.time() - t:.1f}s", flush=True)
PY
python -m pipeline --config "$cfg" run.dir="$run" run.time_limit_s="$limit" metrics.tensorboard=false \
  model.cache_dir=/tmp/models-$name rollout.data.source=bench/data/basic_arithmetic.jsonl rollout.reward.fn=math \
  rollout.sglang.log_dir="$run/sglang" buffer.dir=/tmp/buffer-$name "$@" 2>&1 | grep -v "Warning\|warn(" | tail -60
rc=${PIPESTATUS[0]}
grep -v "GET /model_info\|GET /health" "$run"/sglang/*.log | tail -120 > "$out"/sglang-tail.log 2>/dev/null
python bench/pipeline_summary.py "$run" | tee "$out"/summary.json
python -m pipeline.orchestration.report "$run" > /dev/null || echo "run report failed (matplotlib?)"
[ "${KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "$run/checkpoints" "$run/hf"
exit $rc
