"""Helpers of the GPU tests that run a whole pipeline and kill a part of it (tests/test_gpu_engine_restart.py,
tests/test_gpu_stage_restarts.py): the metrics rows so far, the run's processes found among its own
descendants, the logs a device session keeps."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "reward/mean" in row:
            rows.append(row)
    return rows


def sglang_servers(pid: int) -> list:
    """The SGLang servers the pipeline (process `pid`) started, found among its descendants (through
    Ray's raylet and the generator actor), never by name alone."""
    return descendants_running(pid, "sglang.launch_server")


def keep_logs(tmp_path: Path, run_dir: Path) -> None:
    """With SLIPSTREAM_TEST_ARTIFACTS set (bench/gpu_session.sh sets it), copy the run's log, metrics
    and SGLang logs there: a device session keeps only what it collects."""
    dest = os.environ.get("SLIPSTREAM_TEST_ARTIFACTS")
    if not dest:
        return
    import shutil

    out = Path(dest) / run_dir.parent.name
    out.mkdir(parents=True, exist_ok=True)
    for src in [
        tmp_path / "pipeline.log",
        run_dir / "metrics.jsonl",
        *sorted((run_dir / "sglang").glob("*.log")),
    ]:
        if src.exists():
            shutil.copy(src, out / src.name)


def fresh(rows: list[dict], killed_at: float) -> list[dict]:
    """The steps after the kill whose batches hold tokens the relaunched server generated (the
    generators' token count moved on since the first step after the kill)."""
    after = [r for r in rows if r["time"] > killed_at]
    return [r for r in after if r["generator/tokens"] > after[0]["generator/tokens"]]


def descendants_running(pid: int, marker: str) -> list:
    """Processes under `pid` (the pipeline's) whose command line holds `marker`: Ray names an actor's
    worker process `ray::<Class>...`, so "ray::TrainerActor" finds the trainer's ranks."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def pipeline_command(config: str, run_dir: Path, tmp_path: Path, *overrides: str) -> list[str]:
    """`python -m pipeline` on a GPU config with the exported prompts and `math` reward (no
    reasoning-gym on the GPU machine), SGLang without CUDA graphs (faster starts), run until stopped."""
    import sys

    return [
        sys.executable,
        "-m",
        "pipeline",
        "--config",
        config,
        f"run.dir={run_dir}",
        "run.steps=10000",
        "run.time_limit_s=900",  # a cap: the test stops the run once it saw what it waits for
        "metrics.tensorboard=false",
        "rollout.data.source=bench/data/basic_arithmetic.jsonl",
        "rollout.reward.fn=math",
        "rollout.sglang.disable_cuda_graph=true",
        f"rollout.sglang.log_dir={run_dir}/sglang",
        f"buffer.dir={tmp_path}/buffer",
        f"model.cache_dir={tmp_path}/models",
        *overrides,
    ]


@contextlib.contextmanager
def running_pipeline(cmd: list[str], repo: Path, tmp_path: Path, run_dir: Path):
    """The run as a process group of its own, logging to tmp_path/pipeline.log; yields (process, log
    path). On the way out a run still going is killed (its group) and the logs are kept."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": f"{repo}:{os.environ.get('PYTHONPATH', '')}"}
    log_path = tmp_path / "pipeline.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                # SGLang servers run in sessions of their own: their groups too, found before the
                # pipeline's end orphans them, so that the next test starts on free GPUs
                servers = sglang_servers(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                for server in servers:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(server.pid, signal.SIGKILL)
            keep_logs(tmp_path, run_dir)


def wait_for_steps(proc, run_dir: Path, log_path: Path, n: int, timeout_s: float = 420.0) -> None:
    """Until the run has trained `n` steps; fails with the log's tail if it ends or takes too long."""
    deadline = time.monotonic() + timeout_s
    while (done := len(steps(run_dir))) < n:
        assert proc.poll() is None, (
            f"the run ended (rc {proc.returncode}) after {done} of the {n} steps waited for:\n"
            + log_path.read_text()[-3000:]
        )
        assert time.monotonic() < deadline, f"{done} of {n} training steps within {timeout_s:.0f} s"
        time.sleep(2)
