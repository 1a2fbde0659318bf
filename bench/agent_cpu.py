"""An agent written against the `openai` client vs the built-in environment, on the CPU: does
configs/agent-calc-cpu.yaml's reward rise as configs/tool-calc-cpu.yaml's does, and are its episodes
token-exact?

Runs both configs one after the other in this invocation (same model, task, reward, trainer, seed and
steps; the agent's episodes go through the generator's OpenAI-compatible endpoint), and reports for each
the mean reward over the first and last --window steps and over the run, the wall time, and from the
run's buffer: the share of episodes that called the tool (two or more model turns), failed samples, and
for the agent the model turns whose tokens are not the engine's (`turn_mismatches`, over every stored
sample), episodes recorded as several segments, and model turns whose text would have re-encoded to
other tokens (what a proxy that re-tokenises would have trained on).

    .venv/bin/python bench/agent_cpu.py [--steps N] [a.b=c ...]

Prints one JSON line last, and appends it to bench/results/agent_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _results import RESULTS, record
from _runs import moving_average

from buffer.record import Status, batch_to_samples
from pipeline.config import load_config
from pipeline.inspect import load
from pipeline.orchestration.launcher import run_pipeline
from stages.rollout.agent_session import turn_mismatches

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def one(name: str, steps: int, window: int, overrides: list[str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"slipstream-bench-{name}-"))
    cfg = load_config(
        CONFIGS / f"{name}-cpu.yaml",
        [f"run.dir={run_dir}", "metrics.progress=false", f"run.steps={steps}", *overrides],
    )
    t0 = time.time()
    res = run_pipeline(cfg)
    if res.status != "completed":
        raise SystemExit(f"benchmark run {name} failed: {res.error}")
    rows = [h for h in res.history if "reward/mean" in h]
    rewards = [r["reward/mean"] for r in rows]
    samples = batch_to_samples(load(str(run_dir / "buffer"))[0])
    episodes = {(s.metadata.get("agent") or {}).get("session", s.uid) for s in samples}
    out = {
        "steps": len(rows),
        "reward_first": round(sum(rewards[:window]) / len(rewards[:window]), 3),
        "reward_last": round(sum(rewards[-window:]) / len(rewards[-window:]), 3),
        "reward_mean": round(sum(rewards) / len(rewards), 3),
        "curve": [round(x, 3) for x in moving_average(rewards, window)[window - 1 :: window]],
        "run_s": round(rows[-1]["time"] - t0, 1),
        "samples": len(samples),
        "episodes": len(episodes),
        "tool_share": round(sum(s.metadata.get("model_turns", 1) >= 2 for s in samples) / len(samples), 3),
        "failed": sum(s.status == Status.FAILED for s in samples),
    }
    agent = [s for s in samples if "agent" in s.metadata]
    if agent:
        out.update(
            turn_mismatches=sum(turn_mismatches(s) for s in agent),
            model_turns=sum(len(s.metadata["agent"]["turns"]) for s in agent),
            multi_segment_episodes=len(
                {s.metadata["agent"]["session"] for s in agent if s.metadata["agent"]["segments"] > 1}
            ),
            retokenize_diffs=sum(s.metadata["agent"]["retokenize_diffs"] for s in agent),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "agent_cpu.jsonl"), help="'' = print only")
    ap.add_argument("overrides", nargs="*", help="applied to both runs")
    args = ap.parse_args()
    out = {"bench": "agent_cpu", "steps": args.steps, "overrides": args.overrides}
    for name in ("tool-calc", "agent-calc"):  # one after the other: the CPU is shared
        out[name.replace("-", "_")] = one(name, args.steps, args.window, args.overrides)
    a, t = out["agent_calc"], out["tool_calc"]
    out["reward_gain"] = {
        "agent_calc": round(a["reward_last"] - a["reward_first"], 3),
        "tool_calc": round(t["reward_last"] - t["reward_first"], 3),
    }
    record(out, args.out)


if __name__ == "__main__":
    main()
