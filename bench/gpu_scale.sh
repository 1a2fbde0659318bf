#!/usr/bin/env bash
# The trainer as a Ray actor group on GPUs (issue #13), on one 4-GPU machine (kind nvidia-h100-x4), one
# run after another, each for TIME_LIMIT_S of training; Ray picks every stage's GPUs:
#   dp2            configs/gpu-4x-dp2.yaml: megatron on 2 GPUs (DP=2), 2 SGLang engines on the other 2
#   disaggregated  configs/gpu-2x-disaggregated.yaml: megatron on 1 GPU, SGLang on 1 (the baseline)
#   7b-tp2         the dp2 config with a random-weight Qwen2.5-7B (bench/random_model.py): megatron TP=2
#                  (with sequence parallelism when the 2-GPU check passed: touch $R/sp-ok) on 2 GPUs,
#                  2 SGLang engines; its pushes gather the TP shards (weights.snapshot=auto: pinned host
#                  memory at this size) and broadcast 15 GB to both engines; then the raw NCCL broadcast
#                  of the same bytes (bench/nccl_broadcast.py)
#   async-vs-sync  bench/gpu_async_vs_sync.py on 2 GPUs (issue #17)
# The runs go on in the background (setsid) so that they outlive the device call that started them.
#   bash bench/gpu_scale.sh start [TIME_LIMIT_S]   start the sequence, return at once
#   bash bench/gpu_scale.sh watch SECONDS          wait, show the tails, pack results into $OUT
#   bash bench/gpu_scale.sh finish [TIMEOUT_S]     wait for the end, pack results into $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/gpuscale

sequence() {
  local limit=$1
  # CUDA graphs off: a faster start (~1 min less per run); the push and trainer figures do not use them
  local common=(rollout.sglang.disable_cuda_graph=true)
  OUT=$R bash bench/gpu_pipeline.sh configs/gpu-4x-dp2.yaml dp2 "$limit" "${common[@]}" >"$R/dp2.out" 2>&1
  CUDA_VISIBLE_DEVICES=0,1 OUT=$R bash bench/gpu_pipeline.sh configs/gpu-2x-disaggregated.yaml disaggregated \
    "$limit" "${common[@]}" >"$R/disaggregated.out" 2>&1
  model=$(python bench/random_model.py 7b /tmp/models-7b 2>"$R/7b-build.err" | tail -n 1)
  # sequence parallelism too, when the 2-GPU check (tests/test_gpu_context_parallel.py) passed first
  local sp=false; [ -f $R/sp-ok ] && sp=true
  OUT=$R bash bench/gpu_pipeline.sh configs/gpu-4x-dp2.yaml 7b-tp2 "$limit" "${common[@]}" \
    model.name="$model" run.name=gpu-4x-7b-tp2 trainer.tp=2 trainer.sequence_parallel=$sp trainer.recompute=true \
    trainer.batch_groups=4 trainer.micro_batch_tokens=8192 rollout.group_size=4 rollout.max_inflight_groups=8 \
    rollout.sampling.max_new_tokens=64 rollout.sglang.mem_fraction_static=0.6 weights.bucket_mb=1024 \
    >"$R/7b-tp2.out" 2>&1
  # the same bytes as one flat NCCL broadcast between two GPUs, nothing else running: the push's floor.
  # The run's Ray workers may still be exiting (a first attempt met 58 GB of a trainer on GPU 0): wait
  for _ in $(seq 60); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 2; done
  python bench/nccl_broadcast.py "$model" --dtype bfloat16 --gpus 0,2 --runs 3 >"$R/7b-raw.out" 2>&1
  rm -rf /tmp/models-7b /tmp/buffer-7b-tp2
  # issue #17: sync vs async on 2 GPUs, SmolLM2 on gsm_symbolic with up to 1024 new tokens
  CUDA_VISIBLE_DEVICES=0,1 OUT=$R python bench/gpu_async_vs_sync.py --steps "${AVS_STEPS:-14}" --skip 2 \
    >"$R/async-vs-sync.out" 2>&1
  echo done >"$R/done"
}

copy_out() {
  [ -n "${OUT:-}" ] || return 0
  (cd $R && tar czf "$OUT/gpuscale.tgz" --exclude='*/checkpoints' --exclude='*/hf' --exclude='*.safetensors' \
    --exclude='*.pt' .)
}

case ${1:-} in
start)
  mkdir -p $R
  export -f sequence
  R=$R setsid nohup bash -c "sequence ${2:-120}" >"$R/sequence.out" 2>&1 </dev/null &
  echo "started the sequence (pid $!)"
  ;;
watch)
  # results are packed into $OUT every 30 s: a call cut off by the device's time limit still brings them
  deadline=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $deadline ] && [ ! -f $R/done ]; do sleep 30; copy_out; done
  for f in $R/*.out; do echo "== $f"; tail -n 6 "$f"; done
  for d in $R/*/run; do [ -f "$d/metrics.jsonl" ] && echo "$d: $(grep -c reward/mean "$d/metrics.jsonl") steps"; done
  copy_out
  ;;
finish)
  deadline=$((SECONDS + ${2:-400}))
  while [ ! -f $R/done ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  for f in $R/*.out; do echo "== $f"; tail -n 20 "$f"; done
  copy_out
  ;;
*)
  echo "usage: bash bench/gpu_scale.sh start [TIME_LIMIT_S] | watch SECONDS | finish [TIMEOUT_S]" >&2
  exit 2
  ;;
esac
