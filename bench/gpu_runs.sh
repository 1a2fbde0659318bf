#!/usr/bin/env bash
# Both GPU configs at once on one 4-GPU machine (kind nvidia-h100-x4), each on GPUs of its own, so one
# device session yields both 10-minute runs (bench/RESULTS.md, "History of GPU runs", "The whole pipeline on GPUs"):
#   GPU 0     configs/gpu-1x-colocated.yaml       (SGLang + megatron on one GPU, CUDA IPC pushes)
#   GPU 1, 2  configs/gpu-2x-disaggregated.yaml   (megatron on 1, SGLang on 2, NCCL pushes)
#   GPU 3     the colocated config again with trainer.lr=$HEDGE_LR (a second learning rate)
# Each run is a separate Ray instance started in its own session (setsid), so it outlives the device
# call that started it; later calls watch it and copy what it wrote into $OUT.
#   bash bench/gpu_runs.sh start [TIME_LIMIT_S]     start the three runs, return at once
#   bash bench/gpu_runs.sh numerics [TIME_LIMIT_S]  or: three short sync runs for the logprob gap
#   bash bench/gpu_runs.sh watch SECONDS            wait, then show each run's tail; copy results to $OUT
#   bash bench/gpu_runs.sh finish [TIMEOUT_S]       wait for the runs to end, run the raw-transfer
#                                                   baselines (bench/nccl_broadcast.py), copy to $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/gpuruns
HEDGE_LR=${HEDGE_LR:-5.0e-6}

launch() {  # launch NAME GPUS CONFIG LIMIT [a.b=c ...]
  local name=$1 gpus=$2 cfg=$3 limit=$4; shift 4
  CUDA_VISIBLE_DEVICES=$gpus OUT=$R setsid nohup bash bench/gpu_pipeline.sh "$cfg" "$name" "$limit" "$@" \
    >"$R/$name.out" 2>&1 </dev/null &
  echo $! >"$R/$name.pid"
  echo "started $name on GPU(s) $gpus (pid $!)"
}

copy_out() {  # everything small the runs wrote (no checkpoints, no HF exports) into $OUT
  [ -n "${OUT:-}" ] || return 0
  # one archive: the device tool brings back only a few files per call
  (cd $R && tar czf "$OUT/gpuruns.tgz" --exclude='*/checkpoints' --exclude='*/hf' --exclude='*.safetensors' \
    --exclude='*.pt' --exclude='*.pid' .)
}

running() { for f in $R/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid)"; done; }

case ${1:-} in
numerics)  # short sync-mode runs (every token made by the trainer's own weights): the engine-vs-trainer
  # logprob gap of both configs, and on GPU 3 the same with the numerics before 2026-11-26 (megatron's
  # unfused attention, bf16 LM head); CUDA graphs off for a faster start (same kernels' numerics)
  mkdir -p $R
  limit=${2:-90}
  common=(run.mode=sync rollout.sglang.disable_cuda_graph=true)
  launch colocated-sync 0 configs/gpu-1x-colocated.yaml "$limit" "${common[@]}"
  sleep 5
  launch disaggregated-sync 1,2 configs/gpu-2x-disaggregated.yaml "$limit" "${common[@]}"
  sleep 5
  launch colocated-sync-old-numerics 3 configs/gpu-1x-colocated.yaml "$limit" "${common[@]}" \
    trainer.attention=unfused model.fp32_lm_head=false
  ;;
start)
  mkdir -p $R
  limit=${2:-600}
  launch colocated 0 configs/gpu-1x-colocated.yaml "$limit"
  sleep 5  # Ray instances pick their ports at start: stagger them a little
  launch disaggregated 1,2 configs/gpu-2x-disaggregated.yaml "$limit"
  sleep 5
  launch colocated-lr-hedge 3 configs/gpu-1x-colocated.yaml "$limit" trainer.lr="$HEDGE_LR" run.name=colocated-lr-hedge
  ;;
watch)
  sleep "${2:-60}"
  for f in $R/*.out; do echo "== $f"; tail -n 8 "$f"; done
  echo "running: $(running | tr '\n' ' ')"
  for d in $R/*/run; do [ -f "$d/metrics.jsonl" ] && echo "$d: $(grep -c reward/mean "$d/metrics.jsonl") steps, last: $(tail -n 1 "$d/metrics.jsonl" | cut -c1-400)"; done
  copy_out
  ;;
finish)
  deadline=$((SECONDS + ${2:-400}))
  while [ -n "$(running)" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  echo "still running: $(running | tr '\n' ' ')"
  for f in $R/*.out; do echo "== $f"; tail -n 25 "$f"; done
  model=$(ls -d /tmp/models-disaggregated*/*/ 2>/dev/null | head -n 1)
  if [ -n "$model" ]; then
    CUDA_VISIBLE_DEVICES=1,2 timeout 300 python bench/nccl_broadcast.py "$model" --gpus 0,1 | tail -n 1 | tee $R/raw_baselines.json
  fi
  if [ -n "${GPU_TESTS:-}" ]; then  # the gpu-marked weight-transport tests (2 GPUs: CUDA IPC and NCCL)
    SLIPSTREAM_GPU_TESTS=1 CUDA_VISIBLE_DEVICES=0,1 timeout "${GPU_TESTS}" python -m pytest -m gpu tests/test_weights_sglang.py -q -s \
      -p no:cacheprovider 2>&1 | grep -v "arn" | tail -n 30 | tee $R/gpu_tests.txt
  fi
  copy_out
  ;;
*)
  echo "usage: $0 start|numerics [TIME_LIMIT_S] | watch SECONDS | finish [TIMEOUT_S]" >&2
  exit 2
  ;;
esac
