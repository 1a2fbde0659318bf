#!/usr/bin/env bash
# Issue #40's prefix-cache bench on two GPUs: configs/tool-calc-gpu.yaml (multi-turn calculator episodes,
# SmolLM2-135M-Instruct, one SGLang engine, megatron on the other GPU) with SGLang's radix cache on (keyed
# by weight version, rollout.sglang.radix_cache) against the same run with it off, one after the other,
# both pushing through the generator (weights.transport=cpu: the key moves before each update):
#   bash bench/gpu_agent.sh [STEPS]
# MODE (run.mode, default sync): in sync mode every step trains on samples of its own version, so
# logp/abs_diff_same_version is measured at every step, after every push (async measured it at step 1
# only, before any push: bench/RESULTS.md, GPU session of 2026-11-28, 11:05). bench/gpu_cache_check.py
# is the directed check that no KV crosses a push.
# OVERRIDES: more a.b=c overrides for both runs, e.g. the 135M trainer beside its engine on one GPU:
#   OVERRIDES="cluster.num_gpus=1 cluster.colocate=true rollout.sglang.mem_fraction_static=0.4"
# One JSON row: prompt tokens the engine prefilled per episode in each run (generator/engine_prefill_tokens
# over the samples made), episodes/s, and the engine-vs-trainer gap on tokens of the trainer's own version
# (logp/abs_diff_same_version, median over the run): `prefill_ratio` = off / on (goal >= 2), and the gap
# with the cache on no larger than off (the proof that no KV crossed a push). Rows go to
# bench/results/gpu_agent.jsonl. Needs sglang==0.5.17 and megatron-core (docs/gpu.md's appendix).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for cache in off on; do
  flag=$([ $cache = on ] && echo true || echo false)
  bash bench/gpu_pipeline.sh --out "$out" configs/tool-calc-gpu.yaml "agent-cache-$cache" 1200 \
    run.steps="$steps" run.mode="${MODE:-sync}" rollout.sglang.radix_cache="$flag" weights.transport=cpu trainer.save_at_end=false eval.every_steps=0 ${OVERRIDES:-} >"$out/agent-cache-$cache.out" 2>&1
done
python - "$out/agent-cache-off/run" "$out/agent-cache-on/run" "${OVERRIDES:-}" "${MODE:-sync}" <<'PY'
import datetime, json, statistics, sys
from pathlib import Path

def figures(run):
    rows = [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    last = rows[-1]
    samples = last.get("generator/samples") or 0
    gaps = [r["logp/abs_diff_same_version"] for r in rows if r.get("logp/same_version_tokens")]
    return {
        "steps": len(rows),
        "prefill_per_episode": round(last.get("generator/engine_prefill_tokens", 0) / max(samples, 1), 1),
        "episodes_per_s": round(samples / max(rows[-1]["time"] - rows[0]["time"], 1e-9), 2),
        "same_version_gap": round(statistics.median(gaps), 5) if gaps else None,
        "reward_last": last.get("reward/mean"),
    }

off, on = figures(sys.argv[1]), figures(sys.argv[2])
row = {"bench": "gpu_agent", "config": "tool-calc-gpu", "mode": sys.argv[4], "overrides": sys.argv[3], "cache_off": off, "cache_on": on}
row["prefill_ratio"] = round(off["prefill_per_episode"] / on["prefill_per_episode"], 2) if on["prefill_per_episode"] else None
import torch
row.update(device=f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}", date=datetime.date.today().isoformat())
print(json.dumps(row))
PY
