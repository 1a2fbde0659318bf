"""Learning correctness of async training (issue #17): at equal trained samples, sync vs async with
staleness 4 and TIS vs async with staleness 4 and no correction, per seed, one invocation.

    python bench/gpu_learning.py [--config configs/gpu-2x-disaggregated.yaml] [--steps 150] [--seeds 0 1 2]
                                 [--staleness 4] [--out DIR] [--results bench/results/gpu_learning.jsonl]
                                 [--gpus N] [--variants V ...] [--prior DIR ...] [--prior-sync DIR ...]
                                 [a.b=c ...]

`--staleness K` bounds the async runs at K versions of lag instead of 4; the summary refuses `--prior`
runs at another bound (each async run's rows record it), as it refuses runs at another learning rate.
`--variants async_tis async_no_tis --prior-sync DIR` runs only the async variants and counts the sync
runs of an earlier study (a sync run has no bound): how a study at another bound costs no sync runs.

`--gpus N` with a one-GPU config (configs/gpu-1x-colocated.yaml) runs N of the (variant, seed) runs at
once, each in its own process on its own GPU, instead of one after another.

Every run trains `--steps` optimizer steps of the same batch size (so the same number of samples) on the
same task; only run.mode, run.max_staleness and trainer.loss.correction differ. On a GPU config the
task is SmolLM2-135M-Instruct on the exported basic_arithmetic JSONL with the `math` reward (the GPU
machine has no reasoning-gym), as bench/gpu_pipeline.sh runs it; `--config configs/default.yaml` runs
the same comparison on the CPU default (the torch engine), which is how the script is checked here.

Reported per variant: the final reward (mean over the last `--tail` steps, then over seeds), the mean
reward over every step (how fast it learnt: runs that converge end alike), the mean engine-vs-trainer
logprob gap of all trained tokens (`logp/abs_diff_train_rollout`), its mean staleness, and the share of
wall time generation stood paused for pushes (`stall_share`, the worst async run; the issue's goal for
every config is <= 5 %). Goal: async + TIS within the noise of sync's final reward (the spread over
seeds), and the uncorrected run measurably worse or its logprob gap measurably larger. The curves go to
OUT/learning_curves.png, every run's metrics to OUT/<variant>-seed<k>.jsonl. JSON last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _results import record
from _runs import moving_average, run
from pipeline_summary import stall_share

# the async variants run at run.max_staleness = --staleness (4 unless told)
VARIANTS = {
    "sync": ["run.mode=sync"],
    "async_tis": ["run.mode=async", "trainer.loss.correction=tis"],
    "async_no_tis": ["run.mode=async", "trainer.loss.correction=none"],
}
BOUND_KEY = "bench/staleness_bound"  # an async run's run.max_staleness, in the rows one_run writes
# what bench/gpu_pipeline.sh sets for the GPU configs (no reasoning-gym on the GPU machine)
GPU_TASK = ["rollout.data.source=bench/data/basic_arithmetic.jsonl", "rollout.reward.fn=math"]


def summarise(rows: list[dict], tail: int) -> dict:
    last = rows[-tail:]
    return {
        "steps": len(rows),
        "samples": int(sum(r["samples"] for r in rows)),
        "final_reward": round(statistics.mean(r["reward/mean"] for r in last), 4),
        "first_reward": round(statistics.mean(r["reward/mean"] for r in rows[:tail]), 4),
        # over every step: how fast it learnt, which the final reward misses once runs converge
        "mean_reward": round(statistics.mean(r["reward/mean"] for r in rows), 4),
        "logp_abs_diff": round(statistics.mean(r["logp/abs_diff_train_rollout"] for r in rows), 5),
        "staleness_mean": round(statistics.mean(r["staleness/mean"] for r in rows), 3),
        "wall_s": round(rows[-1]["time"] - rows[0]["time"], 1),
        # generation stalled by weight pushes (the issue's <= 5 %), as bench/gpu_async_vs_sync.py counts it
        "stall_share": async_stall_share(rows),
        "lr": rows[-1].get("lr"),  # the peak: with the default schedule the same at every step
        # an async run's run.max_staleness, which the metrics do not carry: one_run writes it into the rows
        "staleness_bound": rows[-1].get(BOUND_KEY),
    }


def async_stall_share(rows: list[dict], skip: int = 2) -> float | None:
    """The pushes' stall (bench/pipeline_summary.py's) from step `skip` + 1 on (start-up and the first
    pushes left out); None for a sync run, which pushes between batches with nothing generating (its
    rows log `push/seconds` instead)."""
    part = rows[skip:]
    return stall_share(part) if any("push/prev_seconds" in r for r in part) else None


def plot(curves: dict[str, list[list[float]]], out: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(curves.items(), ("black", "tab:blue", "tab:red"), strict=False):
        for i, r in enumerate(runs):
            ax.plot(moving_average(r, window), color=color, alpha=0.8, label=name if i == 0 else None)
    ax.set_xlabel("optimizer step (equal samples per step in every run)")
    ax.set_ylabel(f"reward (moving average of {window})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def one_run(config: str, overrides: list[str], out: Path, name: str, seed: int, staleness: int) -> list[dict]:
    """One variant at one seed; its metrics rows, also written to OUT/<variant>-seed<k>.jsonl."""
    # the SGLang server's log beside the run's (a server that died mid-run is explained there)
    logs = (
        [f"rollout.sglang.log_dir={(out / f'sglang-{name}-seed{seed}').resolve()}"] if "gpu" in config else []
    )
    bound = [] if name == "sync" else [f"run.max_staleness={staleness}"]
    rows, _ = run([*overrides, f"run.seed={seed}", *VARIANTS[name], *bound, *logs], config)
    if bound:  # so that a later summary (--prior) can tell which bound it ran at
        rows = [{**r, BOUND_KEY: staleness} for r in rows]
    (out / f"{name}-seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run_on_gpus(
    config: str, common: list[str], out: Path, jobs: list[tuple[str, int]], gpus: int, staleness: int
) -> None:
    """Each (variant, seed) in a process of its own pinned to one GPU, `gpus` at a time (a one-GPU
    config per run: colocated). A run that fails is named; the others go on."""
    import os
    import subprocess

    # the GPUs this process may use (a session that gives other GPUs to other work sets them)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible[:gpus] if visible else [str(i) for i in range(gpus)]
    if len(devices) < gpus:
        raise SystemExit(
            f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} has fewer"
        )
    queue, running, failed = list(jobs), {}, []
    while queue or running:
        while queue and len(running) < gpus:
            gpu = next(d for d in devices if d not in {g for g, _ in running.values()})
            name, seed = queue.pop(0)
            cmd = [
                sys.executable,
                __file__,
                "--config",
                config,
                "--out",
                str(out),
                "--staleness",
                str(staleness),
                "--_one",
                name,
                str(seed),
                *common,
            ]
            log = open(out / f"{name}-seed{seed}.log", "w")  # noqa: SIM115 - closed when the run ends
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[proc] = (gpu, (name, seed, log))
        time.sleep(2)
        for proc in [p for p in running if p.poll() is not None]:
            _, (name, seed, log) = running.pop(proc)
            log.close()
            if proc.returncode != 0:
                failed.append(f"{name} seed {seed} (rc {proc.returncode}, log {log.name})")
            print(json.dumps({"done": name, "seed": seed, "rc": proc.returncode}), flush=True)
    if failed:
        raise SystemExit(f"learning runs failed: {'; '.join(failed)}")


def prior_runs(
    sources: list[tuple[Path, tuple[str, ...]]], exclude: set[tuple[str, int]]
) -> dict[tuple[str, int], Path]:
    """(variant, seed) -> folder for the earlier runs in `sources` (each a folder and the variants taken
    from it), but for those in `exclude` (this invocation's own). A run found twice is refused: which
    one counts must not depend on the order of the folders."""
    found: dict[tuple[str, int], Path] = {}
    for folder, variants in sources:
        if not folder.is_dir():  # `--prior A key=value`: the override was taken for a folder
            raise SystemExit(
                f"--prior {folder}: no such folder (overrides go before --prior, which takes every word after it)"
            )
        for f in sorted(folder.glob("*-seed*.jsonl")):
            name, _, seed = f.stem.rpartition("-seed")
            key = (name, int(seed))
            if name not in variants or key in exclude:
                continue
            if key in found:
                raise SystemExit(f"{name} seed {seed} is in both {found[key]} and {folder}: give one of them")
            found[key] = folder
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpu-2x-disaggregated.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument(
        "--seeds", type=int, nargs="*", default=[0], help="seeds to run (none: only summarise --prior)"
    )
    ap.add_argument(
        "--staleness",
        type=int,
        default=4,
        help="run.max_staleness of the async variants (more versions of lag: more for the correction to do)",
    )
    ap.add_argument("--tail", type=int, default=10, help="final reward = mean over this many last steps")
    ap.add_argument("--out", default="gpu-out/learning")
    ap.add_argument("--results", default="", help="append the JSON (with device and date) to this .jsonl")
    ap.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="run one-GPU (colocated) runs side by side, one per GPU (0: in turn)",
    )
    ap.add_argument(
        "--prior",
        nargs="*",
        default=[],
        help="folders of earlier runs of the same settings (<variant>-seed<k>.jsonl) to count with these "
        "seeds: a device session too short for every seed adds its seeds to the last one's",
    )
    ap.add_argument(
        "--prior-sync",
        nargs="*",
        default=[],
        help="folders whose sync runs (and only those) count: a sync run has no staleness bound, so the sync "
        "runs of a study at one bound serve a study of the async runs at another",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="the variants to run here (the others come from --prior / --prior-sync)",
    )
    ap.add_argument("--device", default="", help="the card of the --prior runs, for a summary made elsewhere")
    ap.add_argument("--_one", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = "gpu" in Path(a.config).name
    if a._one:  # a child of run_on_gpus: its overrides are already complete
        one_run(a.config, a.overrides, out, a._one[0], int(a._one[1]), a.staleness)
        return
    common = [f"run.steps={a.steps}", "run.time_limit_s=0", *(GPU_TASK if gpu else []), *a.overrides]
    jobs = [(name, seed) for seed in a.seeds for name in a.variants]
    sources = [(Path(f), tuple(VARIANTS)) for f in a.prior] + [(Path(f), ("sync",)) for f in a.prior_sync]
    prior = prior_runs(sources, exclude=set(jobs))
    have = {*jobs, *prior}
    # a seed counts when every variant ran, here or before; one of this invocation's seeds that lacks one
    # is a mistake in the command, a prior seed that lacks one is left out (and said so)
    missing = {
        seed: [name for name in VARIANTS if (name, seed) not in have] for seed in sorted({s for _, s in have})
    }
    for seed, names in missing.items():
        if names and seed in a.seeds:
            raise SystemExit(
                f"seed {seed}: no {', '.join(names)} run, here (--variants) or in --prior/--prior-sync"
            )
        if names:
            print(f"seed {seed} left out: no {', '.join(names)} run in --prior/--prior-sync", file=sys.stderr)
    seeds = [seed for seed, names in missing.items() if not names]
    if not seeds:
        raise SystemExit(f"no seeds to run and no complete seed (all three variants) in --prior {a.prior}")
    if a.gpus:  # after the checks above: a command that cannot be summarised spends no GPU time
        run_on_gpus(a.config, common, out, jobs, a.gpus, a.staleness)
    per: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    curves: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for name, seed in [(name, seed) for seed in seeds for name in VARIANTS]:
        if (name, seed) in prior or a.gpus:
            folder = prior.get((name, seed), out)
            rows = [
                json.loads(line) for line in (folder / f"{name}-seed{seed}.jsonl").read_text().splitlines()
            ]
        else:
            rows = one_run(a.config, common, out, name, seed, a.staleness)
        per[name].append(summarise(rows, a.tail))
        curves[name].append([r["reward/mean"] for r in rows])
        print(json.dumps({"variant": name, "seed": seed, **per[name][-1]}), flush=True)
    # every run of one comparison at one learning rate: an override lost on the way (a session whose
    # --prior swallowed them) must not pass as another seed
    lrs = {f"{name}-seed{seed}": s["lr"] for name in VARIANTS for seed, s in zip(seeds, per[name])}
    if len({round(v, 12) for v in lrs.values() if v is not None}) > 1:
        raise SystemExit(
            f"these runs trained at different learning rates, so they are no seeds of one comparison: {lrs}"
        )
    # and at one staleness bound (runs written before the bound was recorded ran at 4, then fixed)
    bounds = {
        f"{name}-seed{seed}": s["staleness_bound"] or 4
        for name in VARIANTS
        if name != "sync"
        for seed, s in zip(seeds, per[name])
    }
    if set(bounds.values()) != {a.staleness}:
        raise SystemExit(
            f"these async runs ran at other staleness bounds than --staleness {a.staleness}: {bounds}"
        )
    plot(curves, out / "learning_curves.png", max(1, a.steps // 15))

    def final(name: str) -> float:
        return round(statistics.mean(s["final_reward"] for s in per[name]), 4)

    spread = round(statistics.stdev(s["final_reward"] for s in per["sync"]), 4) if len(seeds) > 1 else None
    result = {
        "bench": "gpu_learning" if gpu else "learning_cpu",
        "config": a.config,
        "overrides": a.overrides,
        "steps": a.steps,
        "seeds": seeds,
        "staleness_bound": a.staleness,
        "prior": {  # the earlier runs this comparison counts
            f"{name}-seed{seed}": str(folder)
            for (name, seed), folder in sorted(prior.items())
            if seed in seeds
        },
        "final_reward_sync": final("sync"),
        "final_reward_async_tis": final("async_tis"),
        "final_reward_async_no_tis": final("async_no_tis"),
        "mean_reward": {v: round(statistics.mean(s["mean_reward"] for s in per[v]), 4) for v in VARIANTS},
        "sync_seed_stdev": spread,
        "logp_abs_diff": {v: round(statistics.mean(s["logp_abs_diff"] for s in per[v]), 5) for v in VARIANTS},
        "staleness_mean": {
            v: round(statistics.mean(s["staleness_mean"] for s in per[v]), 3) for v in VARIANTS
        },
        "stall_share": {
            v: max((s["stall_share"] for s in per[v] if s["stall_share"] is not None), default=None)
            for v in VARIANTS
        },  # the worst run of each variant
        "runs": per,
        "plot": str(out / "learning_curves.png"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    import torch

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    record(result, a.results, device=a.device or here)


if __name__ == "__main__":
    main()
