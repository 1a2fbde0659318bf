"""Time for the embedded default (configs/default.yaml) to reach a reward of 0.9, from launch.

Launch = the moment run_pipeline is called (Ray start-up, model build and megatron import included).
"Reached" = the moving average of the per-step mean reward over --window steps is >= --target. The
baseline in the same run is the reward at the start (what an untrained policy gets).

    .venv/bin/python bench/default_run.py [--steps N] [a.b=c ...]

Prints one JSON line last: {"time_to_reward_0_9_s": ..., ...}; goal <= 300 on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import platform

from _runs import moving_average, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows, t0 = run(args.overrides)
    avg = moving_average([r["reward/mean"] for r in rows], args.window)
    hit = next((i for i, a in enumerate(avg) if i + 1 >= args.window and a >= args.target), None)
    out = {
        "time_to_reward_0_9_s": round(rows[hit]["time"] - t0, 1) if hit is not None else None,
        "step_at_target": rows[hit]["step"] if hit is not None else None,
        "reward_start": round(sum(r["reward/mean"] for r in rows[:3]) / 3, 3),
        "reward_end": round(avg[-1], 3),
        "steps": len(rows),
        "run_s": round(rows[-1]["time"] - t0, 1),
        "first_step_s": round(rows[0]["time"] - t0, 1),
        "machine": f"{platform.machine()} {platform.node()}",
        "goal_s": 300,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
