#!/usr/bin/env bash
# Issue #34's MoE pipeline on four GPUs, with its baseline in the same call:
#   1. build a random-weight Qwen3-MoE of 2B (moe-small: 16 experts, top-4) on the machine;
#   2. the raw baselines of its bytes (bench/nccl_broadcast.py: an NCCL broadcast GPU 0 -> GPU 1 of
#      every tensor, and of the same bytes as one flat tensor), before anything else holds the GPUs;
#   3. configs/gpu-4x-moe.yaml on it for LIMIT seconds of training (trainer EP=2 on two GPUs, two SGLang
#      engines on the others, NCCL pushes, routing replay);
#   4. one JSON line: the pipeline's summary, the push against the raw broadcasts, routing agreement.
#
#   bash bench/gpu_moe_pipeline.sh [LIMIT_S] [a.b=c ...]   # OUT (default gpu-out/) gets the logs
# Needs sglang==0.5.17 and megatron-core (docs/gpu.md's appendix).
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-150}; shift || true
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
model=$(python bench/random_model.py moe-small /tmp/moe-models 2>"$out/build.err" | tail -n 1)
[ -d "$model" ] || { echo "moe-small build failed: $(tail -3 "$out/build.err")"; exit 1; }
python bench/nccl_broadcast.py "$model" --gpus 0,1 --runs 3 2>"$out/raw.err" | tail -n 1 >"$out/raw.json"
bash bench/gpu_pipeline.sh --out "$out" configs/gpu-4x-moe.yaml moe4 "$limit" model.name="$model" "$@" \
  >"$out/pipeline.out" 2>&1
python - "$out/raw.json" "$out/moe4/summary.json" <<'PY'
import datetime, json, sys

raw = json.loads(open(sys.argv[1]).read() or "{}")
lines = [l for l in open(sys.argv[2]).read().splitlines() if l.startswith("{")] if len(sys.argv) > 2 else []
row = {"bench": "gpu_moe_pipeline", "model": "moe-small (random Qwen3-MoE, 16 experts top-4, 1.96B)"}
row.update(json.loads(lines[-1]) if lines else {"error": "no pipeline summary (see pipeline.out)"})
row.pop("plot", None)
row.update({f"raw_{k}" if not k.startswith("raw") else k: v for k, v in raw.items() if k not in ("bench", "device")})
push = row.get("push_seconds_median")
for key in ("raw_broadcast_s", "raw_broadcast_flat_s"):
    if push and row.get(key):
        row[f"push_vs_{key}"] = round(push / row[key], 2)
row.update(device=raw.get("device", "?") + " x4", date=datetime.date.today().isoformat())
print(json.dumps(row))
PY
