"""How a bench records its result: one JSON line, with the machine and the date, appended to
bench/results/<bench>.jsonl and printed last. Imports nothing of the project (benches that import the
pipeline and those that must not both use it)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_box() -> str:
    """This machine as the results name a CPU run's device: "x86_64 cpu x2"."""
    return f"{platform.machine()} cpu x{os.cpu_count()}"


def record(out: dict, path: str | Path | None, *, device: str | None = None) -> None:
    """Add `device` (default: this CPU box) and today's date unless `out` has them, append the line to
    `path` (None or "": print only), and print it as the bench's last line."""
    out.setdefault("device", device or cpu_box())
    out.setdefault("date", datetime.date.today().isoformat())
    line = json.dumps(out)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)
