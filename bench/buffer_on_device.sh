#!/usr/bin/env bash
# The buffer benches on the device machine's CPUs (16 cores; no GPU work), to see how the ingest goals
# depend on the cores a host has. The device has pyarrow, numpy and pyyaml but no pyzmq or msgspec:
# carry their wheels (python 3.12) in .whl/cpu, e.g.
#   pip download --only-binary=:all: --python-version 3.12 --no-deps -d .whl/cpu pyzmq msgspec
# then run through the device tool with carry [".whl/cpu"]:  bash bench/buffer_on_device.sh [quick fetch full threads p2 p4]
# Writes every bench's stdout+stderr under $OUT (or ./device-out).
set -euo pipefail
out=${OUT:-device-out}
mkdir -p "$out"
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/cpu-site .whl/cpu/*.whl
export PYTHONPATH=/tmp/cpu-site:.${PYTHONPATH:+:$PYTHONPATH}
{ nproc; lscpu | grep -E "Model name|^CPU\(s\)"; free -g | head -2; df -h /tmp | tail -1; python3 -V
  ldconfig -p | grep -c deflate || true; } > "$out/host.txt" 2>&1
cat "$out/host.txt"
run() {  # name, then the bench's arguments
  local name=$1; shift
  echo "== $name: $*"
  python3 "$@" > "$out/$name.txt" 2>&1 || { tail -5 "$out/$name.txt"; return 1; }
  tail -1 "$out/$name.txt"
}
# what to run: the arguments of this script, else all of it
sel=${*:-"quick fetch full threads p2 p4"}
for what in $sel; do
  case $what in
    quick) run ingest_quick bench/buffer_ingest.py --quick --tokens 2048 --runs 5 --steady ;;
    fetch) run fetch bench/buffer_fetch.py ;;
    full) run ingest_full bench/buffer_ingest.py --tokens 2048 --runs 3 --steady ;;
    threads) run threads_steady bench/ingest_threads.py --steady --runs 2
             run threads_steady_prebuilt bench/ingest_threads.py --steady --prebuilt --runs 2
             run threads_fresh bench/ingest_threads.py --runs 2
             run threads_fresh_prebuilt bench/ingest_threads.py --prebuilt --runs 2 ;;
    p*) run "ingest_full_producers_${what#p}" bench/buffer_ingest.py --tokens 2048 --runs 3 --steady --producers "${what#p}" ;;
  esac
done
