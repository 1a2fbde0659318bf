#!/usr/bin/env bash
# bench/peers/driver.py in the background on a GPU machine (setsid), so that device calls of at most 10
# minutes can start it, watch it and collect it; a learn job (~3 runs of 3-8 min) outlives one call.
#   bash bench/peers/session.sh start JOB MODEL [driver args]   e.g. start learn smollm2-135m
#   bash bench/peers/session.sh watch SECONDS                   wait up to SECONDS, show progress and rows
#   bash bench/peers/session.sh collect                         rows + trimmed logs into $OUT
# Needs /tmp/site (../shared/device/stage-wheels.sh) and the peer chunks (bench/peers/stage-wheels.sh)
# collected on this machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
S=${PEERS_DIR:-/tmp/peers}
for f in /tmp/whl/env.sh /tmp/whl-peer/env.sh; do
  [ -f "$f" ] && source "$f"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

case "${1:-}" in
start)
  job=${2:?job: learn or speed}; model=${3:?model: smollm2-135m, random-1.5b or an HF folder}; shift 3
  [ -f /tmp/whl/installed ] || { echo "no /tmp/site: collect ../shared/device/stage-wheels.sh's chunks first" >&2; exit 1; }
  [ -f /tmp/whl-peer/installed ] || { echo "no /tmp/peer-site: collect .whl-peer/pK chunks first" >&2; exit 1; }
  mkdir -p "$S"
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader >"$S/gpus-before.txt" 2>&1
  setsid nohup bash -c "python3 bench/peers/driver.py --job $job --model $model --out $S $*; echo \"driver done rc=\$? \$(date -u +%T)\"" \
    </dev/null >>"$S/driver.log" 2>&1 &
  echo "started $job on $model; progress: $S/driver.log"
  ;;
watch)
  end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ] && ! grep -q "driver done" "$S/driver.log" 2>/dev/null; do sleep 10; done
  tail -n 30 "$S/driver.log" | cut -c1-600
  for d in "$S"/*/; do
    [ -f "$d/console.log" ] || continue
    echo "== $d: $(grep -c 'step:[0-9]* - ' "$d/console.log") verl step lines, $(wc -l <"$d/console.log") lines"
    tail -n 3 "$d/console.log" | cut -c1-300
    [ -f "$d/run/metrics.jsonl" ] && echo "   slipstream steps: $(wc -l <"$d/run/metrics.jsonl")"
  done
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2>/dev/null
  ;;
collect)
  out=${OUT:-gpu-out}; mkdir -p "$out"
  [ -f "$S/rows.jsonl" ] && cp "$S/rows.jsonl" "$out/peers-rows.jsonl"
  # the logs without model weights, checkpoints or buffers; console logs cut to their ends
  tmp=$(mktemp -d)
  (cd "$S" && find . -name '*.log' -o -name '*.jsonl' -o -name '*.json' -o -name '*.txt' -o -name '*.yaml' -o -name '*.png' -o -name '*.md') |
    while read -r f; do
      mkdir -p "$tmp/$(dirname "$f")"
      case "$f" in
        *console.log|*.out) tail -c 2000000 "$S/$f" >"$tmp/$f" ;;
        *) cp "$S/$f" "$tmp/$f" ;;
      esac
    done
  tar czf "$out/peers.tgz" -C "$tmp" --exclude='./models' --exclude='./data' . && rm -rf "$tmp"
  ls -la "$out"
  ;;
*)
  echo "usage: $0 start JOB MODEL [driver args] | watch SECONDS | collect" >&2
  exit 2
  ;;
esac
