"""`buffer-inspect summary` on a buffer of the default run's size (128k rows, 1000 versions, most of
them served): seconds to load the directory and print the summary. Goal (issue #18): under 2 s.

    .venv/bin/python bench/inspect_summary.py [--rows 128000]

Prints one JSON line last and appends it to bench/results/inspect_summary.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import RESULTS, record  # noqa: E402 - bench/ is on sys.path when a bench runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128_000)
    ap.add_argument("--versions", type=int, default=1000)
    a = ap.parse_args()
    from buffer.config import BufferConfig
    from buffer.demo import synthetic_samples
    from buffer.storage import Buffer
    from pipeline.inspect import main as inspect

    d = Path(tempfile.mkdtemp(prefix="bench-inspect-")) / "buf"
    groups = a.rows // 8 // a.versions
    buf = Buffer(BufferConfig(capacity_samples=a.rows * 2), d)
    for v in range(a.versions):  # as a run leaves it: each version's groups served two versions later
        buf.insert(synthetic_samples(groups, group_size=8, version=v, prefix=f"v{v}-", response_len=64))
        buf.fetch(groups, version=v + 2, max_staleness=2)
    buf.close()
    times = {}
    for mode in ("tables", "json"):
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            inspect(["summary", str(d)] + (["--json"] if mode == "json" else []))
        times[mode] = round(time.perf_counter() - t0, 3)
    out = {
        "bench": "inspect_summary",
        "rows": groups * 8 * a.versions,
        "versions": a.versions,
        "summary_s": times["tables"],
        "summary_json_s": times["json"],
        "goal_s": 2.0,
        "goal_met": times["tables"] < 2.0,
    }
    record(out, RESULTS / "inspect_summary.jsonl")


if __name__ == "__main__":
    main()
