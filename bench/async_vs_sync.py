"""Async vs sync on the same workload: wall time per trained sample, one run of each, same process.

The workload has a long-tailed response-time distribution: on top of the real torch engine, every
group waits an extra lognormal delay (rollout.delay_model=longtail:<mean seconds>), as long agentic or
reasoning rollouts do. Sync mode waits for the slowest group of every batch and leaves the trainer idle
while generating; async keeps generating while training, bounded by run.max_staleness.

    .venv/bin/python bench/async_vs_sync.py [--steps 30] [--delay 0.3] [a.b=c ...]

Prints one JSON line last with `speedup` = sync s/sample / async s/sample (goal >= 2.5).
"""

from __future__ import annotations

import argparse
import json

from _runs import run


def per_sample(rows: list[dict], skip: int) -> float:
    """Seconds per trained sample over the steady part of a run (after `skip` warm-up steps)."""
    steady = rows[skip:]
    samples = sum(r["samples"] for r in steady[1:])
    return (steady[-1]["time"] - steady[0]["time"]) / samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the timing")
    ap.add_argument("--delay", type=float, default=0.3, help="mean extra seconds per group (long tail)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    # the workload (both modes): 8 groups x 8 samples per step, up to 32 groups in flight, a 64-sequence
    # engine batch, no KL term (the reference forward is the same in both modes and only adds CPU load
    # on 2 cores); everything else as configs/default.yaml
    common = [
        "rollout.max_batch_size=64",
        "trainer.loss.kl_coef=0",
        f"run.steps={args.steps}",
        f"rollout.delay_model=longtail:{args.delay}",
        "rollout.max_inflight_groups=32",
        "trainer.batch_groups=8",
        "rollout.group_size=8",
        "eval.every_steps=0",
        *args.overrides,
    ]
    results = {}
    for mode in ("sync", "async"):
        rows, _ = run([f"run.mode={mode}", *common])
        results[mode] = {
            "s_per_sample": per_sample(rows, args.skip),
            "staleness_mean": sum(r["staleness/mean"] for r in rows) / len(rows),
            "trainer_idle": rows[-1].get("trainer/idle_share"),
        }
    out = {
        "speedup": round(results["sync"]["s_per_sample"] / results["async"]["s_per_sample"], 2),
        "sync_s_per_sample": round(results["sync"]["s_per_sample"], 4),
        "async_s_per_sample": round(results["async"]["s_per_sample"], 4),
        "async_staleness_mean": round(results["async"]["staleness_mean"], 2),
        "sync_trainer_idle": round(results["sync"]["trainer_idle"] or 0, 2),
        "async_trainer_idle": round(results["async"]["trainer_idle"] or 0, 2),
        "steps": args.steps,
        "delay_mean_s": args.delay,
        "goal": 2.5,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
