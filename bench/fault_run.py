"""The default run with a random stage killed (SIGKILL) every ~30 s, beside an unfaulted run of the
same config in the same invocation: does the run heal itself and finish, does any acknowledged sample
get lost or any sample trained twice, and does it learn as well?

    .venv/bin/python bench/fault_run.py [--steps 1000] [--kill-every-s 30] [--stages generator,buffer,trainer] [a.b=c ...]

Every stage is healed: a generator gets a new incarnation, the buffer restarts on its directory and
address, the trainer group restarts from its newest checkpoint (every 100 steps here, in both runs).
Acknowledged = stored by the buffer (it acks after
fsync); lost = accepted by the buffer when training ended but not on disk afterwards; trained twice = a uid served more
than once in the consumption log; generated twice = a prompt (generator slot, data position: the
`slipstream_data_pos` the generator tags each group's samples with) stored in more than one group, e.g. by
a healed generator that drew it again; evicted = samples the buffer evicted (consumption log), for both
runs. Prints one JSON line last and appends it to
bench/results/fault_run.jsonl: {"completed", "kills", "lost_acked", "trained_twice", "final_reward",
"unfaulted_final_reward", ...}. Goal: completed, 0, 0, final reward within 0.05 of the unfaulted run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import record  # noqa: E402 - bench/ is on sys.path when a bench runs


def one_run(
    overrides: list[str], kill_every_s: float, seed: int, stages: list[str], config: str | None = None
) -> dict:
    import ray

    from buffer.segments import iter_log, recover_segments
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import Pipeline, StageFailed, start_ray
    from pipeline.orchestration.metrics import MetricsWriter
    from pipeline.orchestration.progress import Progress
    from stages.rollout.generator import DATA_POS_KEY

    run_dir = Path(tempfile.mkdtemp(prefix="slipstream-fault-"))
    cfg = load_config(config, [f"run.dir={run_dir}", "metrics.progress=false", *overrides])
    start_ray(cfg)
    metrics = MetricsWriter(run_dir, tensorboard=False)
    pipe = Pipeline(cfg, run_dir)
    kills: list[str] = []
    stop = threading.Event()
    rng = random.Random(seed)

    def killer():
        while not stop.wait(kill_every_s * rng.uniform(0.7, 1.3)):
            stage = rng.choice(stages)
            actor = {"buffer": pipe.buffer, "trainer": pipe.trainer}.get(stage) or rng.choice(pipe.generators)
            try:  # "server": one of a generator's SGLang servers (its engine watch relaunches it)
                pids = ray.get(
                    actor.engine_pids.remote() if stage == "server" else actor.pid.remote(), timeout=30
                )
            except Exception:  # noqa: BLE001 - it is being replaced right now: try at the next tick
                continue
            pids = pids if isinstance(pids, list) else [pids]
            if not pids:  # a server being relaunched right now
                continue
            os.kill(rng.choice(pids), signal.SIGKILL)
            kills.append(stage)

    status, error, accepted = "completed", "", None
    t0 = time.monotonic()
    try:
        pipe.start()
        if kill_every_s > 0:
            threading.Thread(target=killer, daemon=True).start()
        pipe.train(metrics, Progress(cfg.run.steps, enabled=False))
        stop.set()
        accepted = ray.get(pipe.buffer.stats.remote(), timeout=60).get("accepted")
    except StageFailed as e:
        status, error = "failed", str(e)
    finally:
        stop.set()
        pipe.shutdown(failed=status != "completed")
        metrics.close()
        ray.shutdown()
    wall = time.monotonic() - t0
    rows = [h for h in metrics.history if "reward/mean" in h]
    log_records = list(iter_log(run_dir / "buffer"))
    served = collections.Counter(u for r in log_records if r.op == "served" for u in r.uids)
    evicted = {u for r in log_records if r.op == "evicted" for u in r.uids}
    batches = [b for _, b in recover_segments(run_dir / "buffer").batches]
    stored = {u for b in batches for u in b.column("uid").to_pylist()}
    prompt_of: dict[str, tuple] = {}  # group id -> (generator slot, epoch, index of its prompt)
    for b in batches:
        cols = (b.column(c).to_pylist() for c in ("group_id", "generator_id", "metadata"))
        for gid, gen, meta in zip(*cols, strict=True):
            pos = json.loads(meta or "{}").get(DATA_POS_KEY)
            if pos is not None and gid not in prompt_of:
                prompt_of[gid] = (gen.split(".")[0], *pos)  # gen-<i>.<incarnation>: the slot
    groups_per_prompt = collections.Counter(prompt_of.values())
    tail = rows[-50:]
    return {
        "completed": status == "completed" and len(rows) == cfg.run.steps,
        "error": error,
        "steps": len(rows),
        "kills": len(kills),
        "kills_by_stage": dict(collections.Counter(kills)),
        "restarts": rows[-1].get("run/restarts", 0) if rows else 0,
        # the buffer's accepted count when training ended: each of those was fsynced before its ack, so
        # all must be on disk now (later accepts, during shutdown, only add to `stored`)
        "lost_acked": max(0, accepted - len(stored)) if accepted is not None else None,
        "stored": len(stored),
        "accepted_at_end": accepted,
        "trained_twice": sum(1 for c in served.values() if c > 1),
        "generated_twice": sum(1 for c in groups_per_prompt.values() if c > 1),
        "groups_tagged": len(prompt_of),
        "evicted": len(evicted),
        "evicted_share": round(len(evicted) / max(len(stored), 1), 4),
        "served": len(served),
        "final_reward": round(sum(r["reward/mean"] for r in tail) / max(len(tail), 1), 4),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--kill-every-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stages",
        default="generator,buffer,trainer",
        help="comma list of stages to kill (and `server`: an SGLang server of a generator, on GPUs)",
    )
    ap.add_argument(
        "--config",
        default=None,
        help="a config file (default: the embedded CPU default); on GPUs e.g. configs/gpu-2x-disaggregated.yaml "
        "model.name=DIR rollout.data.source=bench/data/basic_arithmetic.jsonl rollout.reward.fn=math",
    )
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "fault_run.jsonl"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    over = [f"run.steps={a.steps}", "trainer.checkpoint_every=100", *a.overrides]
    stages = a.stages.split(",")
    clean = one_run(over, 0.0, a.seed, stages, a.config)
    print(f"unfaulted: {json.dumps(clean)}", flush=True)
    faulted = one_run(over, a.kill_every_s, a.seed, stages, a.config)
    print(f"faulted:   {json.dumps(faulted)}", flush=True)
    out = {
        **{
            k: faulted[k]
            for k in (
                "completed",
                "kills",
                "kills_by_stage",
                "restarts",
                "lost_acked",
                "trained_twice",
                "generated_twice",
                "evicted",
                "evicted_share",
                "final_reward",
            )
        },
        "unfaulted_generated_twice": clean["generated_twice"],
        "unfaulted_evicted": clean["evicted"],
        "unfaulted_evicted_share": clean["evicted_share"],
        "unfaulted_final_reward": clean["final_reward"],
        "unfaulted_completed": clean["completed"],
        "steps": a.steps,
        "kill_every_s": a.kill_every_s,
        "config": a.config or "default",
        "wall_s": faulted["wall_s"],
        "unfaulted_wall_s": clean["wall_s"],
        "error": faulted["error"],
    }
    out["goal_met"] = bool(
        out["completed"]
        and out["lost_acked"] == 0
        and out["trained_twice"] == 0
        and abs(out["final_reward"] - out["unfaulted_final_reward"]) <= 0.05
    )
    import torch

    gpus = torch.cuda.device_count()
    record(out, a.results, **({"device": f"{gpus}x {torch.cuda.get_device_name(0)}"} if gpus else {}))


if __name__ == "__main__":
    main()
