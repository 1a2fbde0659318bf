"""Helpers of the GPU tests that run a whole pipeline and kill a part of it (tests/test_gpu_engine_restart.py,
tests/test_gpu_stage_restarts.py): the metrics rows so far, the run's processes found among its own
descendants, the logs a device session keeps."""

from __future__ import annotations

import json
import os
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
