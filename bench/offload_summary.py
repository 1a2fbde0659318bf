"""Summarise a colocated run with offload (cluster.offload, docs/offload.md) from its run directory: the
median step split (generate / train / the hand-over: offload and onload of both sides and the push), the
hand-over's share of the step (issue #38's goal: `handover_share` <= 0.10 at a 7B-sized batch), the memory
each side holds in each phase, generation tokens/s, and, given the SGLang log, the KV cache's size.

    .venv/bin/python bench/offload_summary.py RUN_DIR [--skip N] [--sglang-log FILE]

The step's wall time is the interval between two metrics rows (the driver logs one per step, after its
hand-over), so every phase is inside it; the first `--skip` steps (start-up, compilation) are left out.
Prints one JSON line last; bench/gpu_offload.sh adds the device and appends it to
bench/results/gpu_offload.jsonl.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HANDOVER = (
    "offload/train_s",
    "offload/rollout_s",
    "onload/train_s",
    "onload/rollout_s",
    "push/snapshot_s",  # a push through a snapshot, and the wait for it (sync mode)
    "push/wait_s",
    "push/direct_s",  # or a direct push (weights.snapshot=direct, the default at 7B), which it replaces
)
MEMORY = (
    "memory/train_gb/train",
    "memory/train_gb/generate",
    "memory/rollout_gb/generate",
    "memory/rollout_gb/train",
)
# SGLang's start-up lines that size the KV cache (0.5.17: "KV Cache is allocated. dtype: ..., #tokens: N,
# ..." and "max_total_num_tokens=N")
_KV_TOKENS = (
    re.compile(r"KV Cache is allocated\..*?#tokens: (\d+)"),
    re.compile(r"max_total_num_tokens=(\d+)"),
)


def kv_cache_tokens(log_text: str) -> int | None:
    """The KV cache's size in tokens from an SGLang server log (the last start-up's), or None."""
    for pattern in _KV_TOKENS:
        found = pattern.findall(log_text)
        if found:
            return int(found[-1])
    return None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarise(rows: list[dict], skip: int = 2) -> dict:
    """The figures of a run's metrics rows (one per step, with their `time` stamps)."""
    rows = [r for r in rows if "step" in r and "time" in r]
    walls = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])][max(skip - 1, 0) :]
    steady = rows[skip:] if len(rows) > skip else rows
    if not walls or not steady:
        raise ValueError(f"{len(rows)} steps with time stamps: need more than --skip={skip} + 1")

    def med(key: str) -> float | None:
        return _median([float(r[key]) for r in steady if isinstance(r.get(key), int | float)])

    handover = [sum(float(r.get(k, 0.0)) for k in HANDOVER) for r in steady]
    step = _median(walls)
    out = {
        "steps": len(rows),
        "step_s": step,
        "generate_s": med("time/data_wait_s"),  # sync mode: the trainer waits while the batch is generated
        "train_s": med("time/train_s"),
        "handover_s": _median(handover),
        **{f"{k.replace('/', '_')}": med(k) for k in HANDOVER},
        "handover_share": round(_median(handover) / step, 4) if step else None,
        **{k.replace("/", "_"): med(k) for k in MEMORY},
        "generated_tokens_per_s": med("throughput/generated_tokens_per_s"),
        "reward_first": steady[0].get("reward/mean"),
        "reward_last": steady[-1].get("reward/mean"),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--skip", type=int, default=2, help="start-up steps left out")
    ap.add_argument("--sglang-log", default="", help="an SGLang server log of the run, for the KV cache size")
    a = ap.parse_args()
    path = Path(a.run_dir) / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: not a finished run directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = {"bench": "gpu_offload", "run_dir": str(a.run_dir), **summarise(rows, a.skip)}
    if a.sglang_log:
        out["kv_cache_tokens"] = kv_cache_tokens(Path(a.sglang_log).read_text(errors="replace"))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
