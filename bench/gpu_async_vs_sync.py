"""Async vs sync on GPUs, the same config in both modes, one invocation (issue #17): SmolLM2-135M-Instruct
on reasoning-gym gsm_symbolic (exported to bench/data/gsm_symbolic.jsonl: the GPU machine has no
reasoning-gym), up to 1024 new tokens, groups of 8, the same number of optimizer steps in each mode.

    python bench/gpu_async_vs_sync.py [--config configs/gpu-2x-disaggregated.yaml] [--steps 30]
                                      [--staleness 4,8] [a.b=c ...]

Needs the `gpu` extra (docs/gpu.md). Each mode runs `bash bench/gpu_pipeline.sh` (run directory under
--out, default $OUT or gpu-out/, as avs-<mode>). Timing is over the steady part: from the end of step `--skip` to the last step, so the
engines' start-up and the first (NCCL warm-up) push are left out of both.

JSON (last line): `speedup` = sync seconds per step / async seconds per step (goal >= 1.8 on 2 GPUs,
disaggregated); `engine_busy_share` (async: 1 - the engines' idle share), `trainer_idle_share` (async:
the trainer's share of wall time spent waiting for data), `engine_util` = the async run's generated
tokens/s over the offline ceiling below (same GPU, model, prompts, sampling, max_new_tokens and
concurrency; goal >= 0.8), and each mode's figures. `--staleness K,K` adds async runs at
those run.max_staleness bounds (`async_by_staleness`, each judged the same way): admission control
keeps at most (staleness + 1) x batch_groups groups ahead of the trainer, and with a long length tail
that cap sets how full the engine is. `--offline-only` measures just the two ceilings below;
`--skip-sync` leaves the sync run (and `speedup`) out.

Two ceilings for engine_util, both on the rollout GPU after the runs: `offline_throughput` (SGLang's
Engine API in-process, no HTTP) and `generator_throughput` (the run's own generator, server and client
with its in-flight caps, no trainer, no staleness bound, no pushes). `engine_util` is the async run's
tokens/s over the faster of the two (`engine_util_vs_engine_api`, `engine_util_vs_generator_only`:
each alone): on 4x H100 without CUDA graphs the Engine API gave 7.5k tokens/s where the pipeline
made 14.1k, so it alone is no ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import record  # noqa: E402 - bench/ is on sys.path when a bench runs
from pipeline_summary import stall_share  # noqa: E402 - bench/ is on sys.path when a bench runs

from pipeline.orchestration.metrics import read_history  # noqa: E402


def steady(rows: list[dict], skip: int) -> dict:
    rows = [r for r in rows if "reward/mean" in r]
    if len(rows) <= skip + 2:
        raise SystemExit(f"only {len(rows)} steps logged; need more than {skip + 2}")
    part = rows[skip:]
    span = part[-1]["time"] - part[0]["time"]

    def mean(key):
        vals = [r[key] for r in part[1:] if isinstance(r.get(key), int | float)]
        return round(statistics.mean(vals), 4) if vals else None

    gen = part[-1]["generator/tokens"] - part[0]["generator/tokens"]
    return {
        # the engines' idle share over this window; `generator/idle_share` itself counts from the
        # engines' start, start-up included (rows of runs before the sums were logged have only that)
        "engine_idle_share": window_idle_share(part)
        if window_idle_share(part) is not None
        else mean("generator/idle_share"),
        "steps": len(rows),
        "s_per_step": round(span / (len(part) - 1), 3),
        "samples_per_s": round(sum(r["samples"] for r in part[1:]) / span, 2),
        "rollout_tokens_per_s": round(gen / span, 1),
        "trainer_wait_share": round(sum(r["time/data_wait_s"] for r in part[1:]) / span, 3),
        "stall_share": stall_share(part),  # sync pushes between batches: 0
        "train_s_mean": mean("time/train_s"),
        "staleness_mean": mean("staleness/mean"),
        # how full the engines were kept (sequences in flight at each step's end), and the work lost to
        # the staleness bound (samples the buffer evicted as too stale, over the window)
        "requests_in_flight_mean": mean("generator/requests_in_flight"),
        "evicted_stale": part[-1].get("buffer/evicted_stale", 0) - part[0].get("buffer/evicted_stale", 0),
        "reward_first": round(statistics.mean(r["reward/mean"] for r in rows[:3]), 3),
        "reward_last": round(statistics.mean(r["reward/mean"] for r in rows[-3:]), 3),
    }


def window_idle_share(rows: list[dict]) -> float | None:
    """Idle share of the engines between the first and the last row, from their cumulative seconds;
    None without them (runs before they were logged) or when they went back (a healed generator
    counts afresh)."""
    keys = ("generator/engine_busy_s", "generator/engine_idle_s")
    if not all(k in r for k in keys for r in (rows[0], rows[-1])):
        return None
    busy, idle = (rows[-1][k] - rows[0][k] for k in keys)
    if busy < 0 or idle < 0 or busy + idle <= 0:
        return None
    return round(idle / (busy + idle), 4)


def _device() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"


def offline_throughput(config: str, overrides: list[str], n_prompts: int, log: Path) -> dict:
    """SGLang's own generation throughput (sglang.Engine in this process, no HTTP) on the rollout's
    GPU: the run's model, chat-templated prompts, sampling and group size, at the generator's
    concurrency (max_inflight_groups x group_size requests in flight), over n_prompts x group_size
    requests. A child process, so its GPU memory is gone when it returns. The generator's concurrency
    is rollout.max_inflight_requests where set, else max_inflight_groups x group_size."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pipeline.config import load_config
from stages.models import resolve_model
from stages.rollout.build import load_source
cfg = load_config({config!r}, {overrides!r} + ["model.cache_dir=/tmp/models-offline"])
r = cfg.rollout
running = r.max_inflight_requests or r.max_inflight_groups * r.group_size
source, _ = load_source(cfg.rollout.data, cfg.model)
prompts = [next(source).ids for _ in range({n_prompts})]
import sglang
gpu = 1 if cfg.cluster.num_gpus > 1 and not cfg.cluster.colocate else 0  # where the run's engine was
llm = sglang.Engine(model_path=str(resolve_model(cfg.model)), dtype=cfg.model.dtype, skip_tokenizer_init=True,
    mem_fraction_static=r.sglang.mem_fraction_static, disable_cuda_graph=r.sglang.disable_cuda_graph,
    disable_radix_cache=True, enable_fp32_lm_head=cfg.model.fp32_lm_head, base_gpu_id=gpu,
    max_running_requests=running)
params = dict(temperature=r.sampling.temperature, top_p=r.sampling.top_p, max_new_tokens=r.sampling.max_new_tokens)
llm.generate(input_ids=prompts[:8], sampling_params=params)  # warm-up
ids = [p for p in prompts for _ in range(r.group_size)]
t0 = time.perf_counter()
outs = llm.generate(input_ids=ids, sampling_params=params)
dt = time.perf_counter() - t0
tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
llm.shutdown()
print(json.dumps(dict(tokens_per_s=round(tokens / dt, 1), tokens=tokens, seconds=round(dt, 2), requests=len(ids),
    max_running_requests=running, sglang=sglang.__version__)))
"""
    return _child(code, "offline throughput (sglang.Engine)", log)


def generator_throughput(config: str, overrides: list[str], n_groups: int, log: Path) -> dict:
    """The pipeline's generator alone: the SGLang server launched as the run launches it (same
    server arguments, stream interval included), driven by the same client and the same in-flight caps
    (rollout.max_inflight_groups / max_inflight_requests), groups scored as in the run, but no trainer,
    no staleness bound and no weight pushes; the groups go nowhere. Over n_groups groups after a
    warm-up, tokens of finished groups / seconds. What the pipeline loses against it is what the
    trainer's pace, admission and pushes cost; what it gains over sglang.Engine is the server's."""
    # the run's reward (bench/gpu_pipeline.sh: the GPU machine has no reasoning-gym) and model cache
    overrides = ["rollout.reward.fn=math", "model.cache_dir=/tmp/models-offline", *overrides]
    code = f"""
import asyncio, json, sys, time
sys.path.insert(0, {str(ROOT)!r})
from buffer import wire
from pipeline.config import load_config
from stages.rollout.build import build_engine
from stages.rollout.generator import Generator
from stages.rollout.run import RolloutRun
cfg = load_config({config!r}, {overrides!r})
gpu = 1 if cfg.cluster.num_gpus > 1 and not cfg.cluster.colocate else 0  # where the run's engine was
cfg = load_config({config!r}, {overrides!r} + [f"rollout.sglang.base_gpu_id={{gpu}}"])

class Discard:
    def put(self, samples, timeout_s=60.0):
        return wire.IngestAck(seq=0, accepted=len(samples), duplicates=0, rejected=0, trainer_version=0)
    def close(self):
        pass

args = (cfg.rollout, cfg.model, RolloutRun(seed=cfg.run.seed, max_staleness=cfg.run.max_staleness,
    routing_replay=cfg.trainer.routing_replay))
engine = build_engine(*args)
try:
    asyncio.run(Generator(*args, Discard(), engine, "warm", batch_groups=0).run(max_groups=8))
    gen = Generator(*args, Discard(), engine, "offline", batch_groups=0)
    t0 = time.perf_counter()
    stats = asyncio.run(gen.run(max_groups={n_groups}))
    dt = time.perf_counter() - t0
finally:
    engine.close()
r = cfg.rollout
print(json.dumps(dict(tokens_per_s=round(stats["tokens"] / dt, 1), tokens=stats["tokens"], seconds=round(dt, 2),
    groups=stats["groups_finished"], max_inflight_groups=r.max_inflight_groups,
    max_inflight_requests=r.max_inflight_requests)))
"""
    return _child(code, "generator-only throughput", log)


def _child(code: str, what: str, log: Path) -> dict:
    """Run a measurement in a child process (its GPU memory is gone when it returns); its output
    goes to `log`, its last stdout line is the result."""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (log: {log}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpu-2x-disaggregated.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="", help="output directory (default $OUT, else gpu-out/)")
    # several times the concurrency, so that the drain at the end (the length tail) is a small part of it
    ap.add_argument("--offline-prompts", type=int, default=384, help="prompts (x group_size requests)")
    ap.add_argument("--offline-only", action="store_true")
    ap.add_argument("--skip-sync", action="store_true", help="no sync run: engine_util only, speedup null")
    ap.add_argument(
        "--staleness",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="also run async at these run.max_staleness values, comma-separated (4,8)",
    )
    ap.add_argument("--results", default="", help="append the JSON (with device and date) to this .jsonl")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out or os.environ.get("OUT") or ROOT / "gpu-out")
    common = [
        f"run.steps={a.steps}",
        "run.time_limit_s=0",
        "rollout.data.source=bench/data/gsm_symbolic.jsonl",
        "rollout.sampling.max_new_tokens=1024",
        "rollout.group_size=8",
        "trainer.micro_batch_tokens=16384",
        "rollout.sglang.disable_cuda_graph=true",
        *a.overrides,
    ]
    if a.offline_only:
        engine_api = offline_throughput(a.config, common, a.offline_prompts, out / "offline-engine.log")
        gen_only = generator_throughput(a.config, common, a.offline_prompts, out / "offline-generator.log")
        print(json.dumps({"offline_throughput": engine_api, "generator_throughput": gen_only}))
        return

    def run_mode(name: str, extra: list[str]) -> dict:
        # gpu_pipeline.sh sets the data source to basic_arithmetic; the later override here wins
        cmd = ["bash", "bench/gpu_pipeline.sh", "--out", str(out), a.config, name, "0", *extra, *common]
        r = subprocess.run(cmd, cwd=ROOT, timeout=1800)
        row = {"rc": r.returncode, **steady(read_history(out / name / "run" / "metrics.jsonl"), a.skip)}
        print(json.dumps({name: row}), flush=True)
        return row

    # --skip-sync: no speedup in this line (a device session too short for the sync run's ~9 minutes)
    s = None if a.skip_sync else run_mode(f"avs{a.tag}-sync", ["run.mode=sync"])
    y = run_mode(f"avs{a.tag}-async", ["run.mode=async"])
    # the same async run at other staleness bounds: admission (run.max_staleness) caps how many groups
    # are in flight, and with a long length tail that cap, not the engine, sets the throughput
    more = {}
    for k in a.staleness:  # one that fails is recorded as such; the result still comes out
        try:
            more[k] = run_mode(f"avs{a.tag}-async-s{k}", ["run.mode=async", f"run.max_staleness={k}"])
        except (SystemExit, subprocess.TimeoutExpired) as e:
            more[k] = {"error": str(e)}
    offline = offline_throughput(a.config, common, a.offline_prompts, out / "offline-engine.log")
    gen_only = generator_throughput(a.config, common, a.offline_prompts, out / "offline-generator.log")
    # judged against the faster of the two: SGLang's Engine API, and the same server and client as the
    # run without a trainer (on H100 without CUDA graphs the Engine API came out at half the latter)
    ceiling = max(offline["tokens_per_s"], gen_only["tokens_per_s"])

    def judged(row: dict) -> dict:
        return {
            "speedup": None if s is None else round(s["s_per_step"] / row["s_per_step"], 3),
            "engine_busy_share": None
            if row["engine_idle_share"] is None
            else round(1 - row["engine_idle_share"], 3),
            "trainer_idle_share": row["trainer_wait_share"],
            "engine_util": round(row["rollout_tokens_per_s"] / ceiling, 3),
            "engine_util_vs_engine_api": round(row["rollout_tokens_per_s"] / offline["tokens_per_s"], 3),
            "engine_util_vs_generator_only": round(row["rollout_tokens_per_s"] / gen_only["tokens_per_s"], 3),
        }

    result = {
        "bench": "gpu_async_vs_sync",
        "config": a.config,
        "overrides": a.overrides,
        **judged(y),  # the config as it is
        "offline_throughput": offline,
        "generator_throughput": gen_only,
        "sync": s,
        "async": y,
        "async_by_staleness": {
            str(k): row if "error" in row else {**judged(row), **row} for k, row in more.items()
        },
        "device": _device(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    record(result, a.results)


if __name__ == "__main__":
    main()
