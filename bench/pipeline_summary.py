"""Summarise a finished run directory (metrics.jsonl) into the figures bench/RESULTS.md records:
rollout and trainer tokens/s, weight-push phases against the raw transfer, engine-vs-trainer logprob
gap, reward at the start and end; and draw reward_staleness.png when it is missing.

    .venv/bin/python bench/pipeline_summary.py RUN_DIR

Prints one JSON line last.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.orchestration.metrics import plot_history, read_history  # noqa: E402


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return round(statistics.median(vals), 4) if vals else None


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return round(statistics.mean(vals), 4) if vals else None


def _same_version_gap(rows: list[dict]) -> float | None:
    pairs = [
        (r["logp/abs_diff_same_version"], r["logp/same_version_tokens"])
        for r in rows
        if r.get("logp/same_version_tokens")
    ]
    n = sum(t for _, t in pairs)
    return round(sum(d * t for d, t in pairs) / n, 4) if n else None


def stall_share(steady: list[dict]) -> float | None:
    """Generation stalled by weight pushes over `steady`, a window of metrics rows: the pause-to-continue
    seconds of its pushes (each row carries the one before it, so the first row's is left out) over
    its span; None when it spans no time. A sync run logs no `push/prev_seconds` (it pushes between
    batches) and comes out 0."""
    span = steady[-1]["time"] - steady[0]["time"] if steady else 0.0
    if span <= 0:
        return None
    return round(sum(r.get("push/prev_seconds") or 0.0 for r in steady[1:]) / span, 4)


def summarise(run_dir: Path) -> dict:
    rows = [r for r in read_history(run_dir / "metrics.jsonl") if "reward/mean" in r]
    if len(rows) < 3:
        raise SystemExit(f"{run_dir}: only {len(rows)} training steps logged; nothing to summarise")
    steady = rows[2:]  # the first steps include start-up and the first (NCCL warm-up) push
    span = steady[-1]["time"] - steady[0]["time"]
    gen_tokens = steady[-1]["generator/tokens"] - steady[0]["generator/tokens"]
    train_tok = sum(r["tokens/total"] for r in steady)
    train_s = sum(r["time/train_s"] for r in steady)
    # async runs log the previous push's phases at the next step (push/prev_*); sync runs wait for the
    # push and log its total only (push/seconds)
    push = _med(rows[2:], "push/prev_seconds") or _med(rows[2:], "push/seconds")
    raw = _med(rows[2:], "push/prev_transfer_s")
    k = max(1, len(rows) // 10)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    t = cfg["trainer"]
    out = {
        "config": cfg["run"]["name"],
        "model": cfg["model"]["name"],
        "trainer_gpus": t["tp"] * t["pp"] * t["dp"] if t["device"] == "cuda" else 0,
        "trainer_parallel": f"tp{t['tp']} pp{t['pp']} dp{t['dp']}",
        "steps": len(rows),
        "steps_per_s": round((len(steady) - 1) / span, 3) if span > 0 else None,
        "wall_s": round(rows[-1]["time"] - rows[0]["time"], 1),
        "rollout_tokens_per_s": round(gen_tokens / span, 1) if span > 0 else None,
        "trainer_tokens_per_s": round(train_tok / train_s, 1) if train_s > 0 else None,
        "trainer_data_wait_share": round(sum(r["time/data_wait_s"] for r in steady) / max(span, 1e-9), 3),
        "push_seconds_median": push,  # SGLang pushes pause generation for all of this
        "stall_share": stall_share(steady),
        "push_pause_s_median": _med(rows[2:], "push/prev_pause_s"),  # the /pause_generation call itself
        "push_raw_transfer_s_median": raw,
        "push_vs_raw_transfer": round(push / raw, 2) if push and raw else None,
        "push_bytes": _med(rows, "push/prev_bytes"),
        # the trainer's side of a push: gather the shards, copy the weights (weights.snapshot); blocks training
        "push_snapshot_s_median": _med(rows[2:], "push/snapshot_s"),
        # weights.snapshot=direct: no snapshot; training waits for the whole push (gathers included)
        "push_direct_s_median": _med(rows[2:], "push/direct_s"),
        # token-weighted over the steps that had any tokens made by exactly the trainer's weights
        "logp_abs_diff_same_version": _same_version_gap(rows),
        "same_version_tokens": int(sum(r.get("logp/same_version_tokens", 0) for r in rows)),
        "logp_abs_diff_all": _med(rows, "logp/abs_diff_train_rollout"),
        "staleness_mean": round(statistics.mean(r["staleness/mean"] for r in rows), 2),
        # MoE with trainer.routing_replay: how often the trainer's router chose the engine's experts
        "routing_agreement": _mean(rows, "routing/agreement"),
        "reward_first": round(statistics.mean(r["reward/mean"] for r in rows[:k]), 3),
        "reward_last": round(statistics.mean(r["reward/mean"] for r in rows[-k:]), 3),
    }
    png = run_dir / "reward_staleness.png"
    if not png.exists():
        plot_history(rows, png)
    out["plot"] = str(png)
    return out


if __name__ == "__main__":
    print(json.dumps(summarise(Path(sys.argv[1]))))
