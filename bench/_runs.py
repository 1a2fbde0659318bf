"""Shared helpers for the pipeline benchmarks: run a config in-process and read its metrics."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import load_config  # noqa: E402
from pipeline.orchestration.launcher import run_pipeline  # noqa: E402
from pipeline.series import moving_average  # noqa: E402, F401 - the benches' moving average


def run(overrides: list[str], config: str | None = None) -> tuple[list[dict], float]:
    """Run one pipeline; returns (per-step metrics rows, launch time as unix seconds)."""
    run_dir = Path(tempfile.mkdtemp(prefix="slipstream-bench-"))
    cfg = load_config(config, [f"run.dir={run_dir}", "metrics.progress=false", *overrides])
    t0 = time.time()
    res = run_pipeline(cfg)
    if res.status != "completed":
        raise SystemExit(f"benchmark run failed: {res.error}")
    return [h for h in res.history if "reward/mean" in h], t0
