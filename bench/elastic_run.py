"""Elastic rollout on the default config: a generator added at a third of the run and one removed at
two thirds (through the run directory's scale request, as `bin/run-pipeline scale` writes it), beside
an unchanged run of the same config in the same invocation. Does the run complete, does any
acknowledged sample get lost or any sample trained twice, do the added generator's samples get trained,
and does the reward curve match the unchanged run's?

    .venv/bin/python bench/elastic_run.py [--steps 300] [--window 25] [a.b=c ...]

Both runs get cluster.num_cpus=4 (room for the added generator's bundle on a 2-core box). Counted as
bench/fault_run.py counts: lost = accepted by the buffer when training ended but not on disk
afterwards; trained twice = a uid served more than once in the consumption log. The curves are compared
as the mean reward of each `--window` steps: `curve_max_diff` is the largest difference of two windows,
`final_reward` the mean of the last 50 steps. Prints one JSON line last and appends it to
bench/results/elastic_run.jsonl. Goal: completed, 0 lost, 0 trained twice, final reward within 0.05
of the unchanged run.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import record  # noqa: E402 - bench/ is on sys.path when a bench runs


def _scale_at(run_dir: Path, metrics, plan: list[tuple[int, int]], answers: list, stop: threading.Event):
    """Write each (step, generators) request once the driver logged that step; collect the answers."""
    from pipeline.orchestration.elastic import read_status, write_request

    def run():
        for step, n in plan:
            while not stop.is_set() and not any(h.get("step", 0) >= step for h in metrics.history):
                time.sleep(0.05)
            if stop.is_set():
                return
            rid = write_request(run_dir, n).id
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not stop.is_set():
                st = read_status(run_dir)
                if st is not None and st.id == rid:
                    answers.append({"step": st.step, "outcome": st.outcome, "generators": st.generators})
                    break
                time.sleep(0.1)
            else:
                answers.append({"step": step, "outcome": "no answer within 120 s"})

    t = threading.Thread(target=run, daemon=True, name="scale requests")
    t.start()
    return t


def one_run(overrides: list[str], plan: list[tuple[int, int]]) -> dict:
    import ray

    from buffer.segments import iter_log, recover_segments
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import Pipeline, StageFailed, start_ray
    from pipeline.orchestration.metrics import MetricsWriter
    from pipeline.orchestration.progress import Progress

    run_dir = Path(tempfile.mkdtemp(prefix="slipstream-elastic-"))
    cfg = load_config(
        None, [f"run.dir={run_dir}", "metrics.progress=false", "cluster.num_cpus=4", *overrides]
    )
    start_ray(cfg)  # started by the first run, kept for the second (main stops it)
    metrics = MetricsWriter(run_dir, tensorboard=False)
    pipe = Pipeline(cfg, run_dir)
    answers: list = []
    stop = threading.Event()
    status, error, accepted = "completed", "", None
    t0 = time.monotonic()
    try:
        pipe.start()
        thread = _scale_at(run_dir, metrics, plan, answers, stop)
        pipe.train(metrics, Progress(cfg.run.steps, enabled=False))
        thread.join(timeout=1.0)
        accepted = ray.get(pipe.buffer.stats.remote(), timeout=60).get("accepted")
    except StageFailed as e:
        status, error = "failed", str(e)
    finally:
        stop.set()
        pipe.shutdown(failed=status != "completed")  # its actors and placement groups end with it
        metrics.close()
    wall = time.monotonic() - t0
    rows = [h for h in metrics.history if "reward/mean" in h]
    log_records = list(iter_log(run_dir / "buffer"))
    served = collections.Counter(u for r in log_records if r.op == "served" for u in r.uids)
    stored = {u for _, b in recover_segments(run_dir / "buffer").batches for u in b.column("uid").to_pylist()}
    slots = collections.Counter(u.split(".", 1)[0] for u in served)  # gen-<i>.<incarnation>-<group>-<k>
    tail = rows[-50:]
    return {
        "completed": status == "completed" and len(rows) == cfg.run.steps,
        "error": error,
        "answers": answers,
        "generator_counts": sorted({h.get("generators/count") for h in metrics.history} - {None}),
        "lost_acked": max(0, accepted - len(stored)) if accepted is not None else None,
        "trained_twice": sum(1 for c in served.values() if c > 1),
        "trained_by_slot": dict(slots),
        "rewards": [r["reward/mean"] for r in rows],
        # groups the buffer evicted as too stale (a generator admitting more than the trainer takes)
        "evicted_groups": max((h.get("buffer/evicted_groups", 0) for h in metrics.history), default=0),
        # mean staleness of the trained samples in each third of the run (1, 2, 1 generators in the plan)
        "staleness_by_third": [
            round(sum(r.get("staleness/mean", 0.0) for r in part) / max(len(part), 1), 2)
            for part in (
                rows[: len(rows) // 3],
                rows[len(rows) // 3 : 2 * len(rows) // 3],
                rows[2 * len(rows) // 3 :],
            )
        ],
        "final_reward": round(sum(r["reward/mean"] for r in tail) / max(len(tail), 1), 4),
        "wall_s": round(wall, 1),
    }


def windows(rewards: list[float], size: int) -> list[float]:
    return [
        round(sum(w) / len(w), 4) for w in (rewards[i : i + size] for i in range(0, len(rewards), size)) if w
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "elastic_run.jsonl"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    over = [f"run.steps={a.steps}", *a.overrides]
    plan = [(a.steps // 3, 2), (2 * a.steps // 3, 1)]  # the default has 1 generator: add one, remove one
    import ray

    try:  # one local Ray for both: a second ray.init in this process would join the first's address
        unchanged = one_run(over, [])
        elastic = one_run(over, plan)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    cu, ce = windows(unchanged["rewards"], a.window), windows(elastic["rewards"], a.window)
    out = {
        "completed": elastic["completed"],
        "scale_plan": plan,
        "answers": elastic["answers"],
        "generator_counts": elastic["generator_counts"],
        "lost_acked": elastic["lost_acked"],
        "trained_twice": elastic["trained_twice"],
        "trained_by_slot": elastic["trained_by_slot"],
        "final_reward": elastic["final_reward"],
        "unchanged_final_reward": unchanged["final_reward"],
        "unchanged_completed": unchanged["completed"],
        "curve_window": a.window,
        "curve": ce,
        "unchanged_curve": cu,
        "curve_max_diff": round(max((abs(x - y) for x, y in zip(ce, cu)), default=float("nan")), 4),
        "steps": a.steps,
        "wall_s": elastic["wall_s"],
        "unchanged_wall_s": unchanged["wall_s"],
        "evicted_groups": elastic["evicted_groups"],
        "unchanged_evicted_groups": unchanged["evicted_groups"],
        "staleness_by_third": elastic["staleness_by_third"],
        "unchanged_staleness_by_third": unchanged["staleness_by_third"],
        "error": elastic["error"] or unchanged["error"],
    }
    out["goal_met"] = bool(
        out["completed"]
        and out["lost_acked"] == 0
        and out["trained_twice"] == 0
        and out["trained_by_slot"].get("gen-1", 0) > 0
        and abs(out["final_reward"] - out["unchanged_final_reward"]) <= 0.05
    )
    record(out, a.results)


if __name__ == "__main__":
    main()
