"""Multi-turn tool use on the CPU: does configs/tool-calc-cpu.yaml's reward rise, and how fast?

Runs the calculator environment (stages/rollout/envs/calculator.py) with tiny-qwen2-calc on
reasoning-gym basic_arithmetic, from launch (model build included when it is not cached yet), and
reports the mean reward (exact answers) over the first and last --window steps, the reward every
--every steps, and the share of episodes that called the tool and of those that failed.

    .venv/bin/python bench/tool_calc.py [--steps N] [a.b=c ...]

Prints one JSON line last, and appends it to bench/results/tool_calc.jsonl.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _results import RESULTS, record
from _runs import moving_average, run

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "tool-calc-cpu.yaml")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "tool_calc.jsonl"), help="'' = print only")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows, t0 = run([f"run.steps={args.steps}", *args.overrides], config=CONFIG)
    rewards = [r["reward/mean"] for r in rows]
    avg = moving_average(rewards, args.window)
    w = args.window
    out = {
        "bench": "tool_calc",
        "steps": len(rows),
        "reward_first": round(sum(rewards[:w]) / len(rewards[:w]), 3),
        "reward_last": round(sum(rewards[-w:]) / len(rewards[-w:]), 3),
        "curve": {rows[i]["step"]: round(avg[i], 3) for i in range(args.every - 1, len(rows), args.every)},
        "run_s": round(rows[-1]["time"] - t0, 1),
        "first_step_s": round(rows[0]["time"] - t0, 1),
        "overrides": args.overrides,
    }
    record(out, args.out)


if __name__ == "__main__":
    main()
