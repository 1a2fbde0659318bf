"""Where an SGLang server spends a weight load: SGLang's own torch profiler (POST /start_profile, CPU
activity with Python stacks) around one call, summarised from its trace as the Python functions and ops
that took the server's time, by self time and by inclusive time, with their call counts.

    from sglang_profile import profiled
    summary = profiled(url, lambda: sender.push(v, named).result(), "/tmp/prof")

The profiler's Python tracing slows Python code several times over, so the figures say where the time
goes (shares, calls), not how long an unprofiled load takes: the bench measures that separately.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

ROOT = "update_weights_from_distributed"  # the scheduler's call that receives and loads a bucket


def profiled(url: str, call, out_dir: str, *, root: str = ROOT, top: int = 25) -> dict:
    """call() with the server at `url` profiled; the summary of the trace it wrote (see summarise)."""
    import requests

    out = Path(out_dir).resolve()  # the server resolves a relative folder against its own directory
    out.mkdir(parents=True, exist_ok=True)
    profile_id = f"weights-load-{time.time_ns()}"  # this call's trace only, whatever the folder holds
    body = {"output_dir": str(out), "activities": ["CPU"], "with_stack": True, "record_shapes": False}
    body["profile_id"] = profile_id
    requests.post(url + "/start_profile", json=body, timeout=60).raise_for_status()
    try:
        call()
    finally:
        # the server writes its trace before it answers
        requests.post(url + "/stop_profile", timeout=600).raise_for_status()
    traces = sorted(out.glob(f"{profile_id}-TP-0*.trace.json.gz"))  # TP rank 0's
    if not traces:
        return {"error": f"the server wrote no trace {profile_id}-TP-0*.trace.json.gz into {out}"}
    return summarise(traces[0], root=root, top=top)


def short(name: str) -> str:
    """A Python function event's name without its directories: "qwen3_moe.py(1102): load_weights"."""
    return name.rsplit("/", 1)[-1]


def summarise(path, *, root: str = ROOT, top: int = 25) -> dict:
    """The events under each outermost Python call whose name ends with `root` (every bucket's load in
    the trace), on that call's thread: total time, then the `top` names by self time (time not inside a
    nested event) and by inclusive time, each with its call count."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    roots = [e for e in events if e.get("cat") == "python_function" and e["name"].endswith(root)]
    # outermost only: a root inside another is the same load seen through a wrapper
    roots = [r for r in roots if not any(o is not r and _inside(r, o) for o in roots)]
    if not roots:
        return {"error": f"no call named *{root} in {path}"}
    self_us: dict[str, float] = defaultdict(float)
    incl_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for r in roots:
        inner = sorted(
            (
                e
                for e in events
                if (e["pid"], e["tid"]) == (r["pid"], r["tid"]) and _inside(e, r) and e is not r
            ),
            key=lambda e: (e["ts"], -e["dur"]),
        )
        stack: list[dict] = []
        for e in inner:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:  # its time is not its parent's own
                self_us[short(stack[-1]["name"])] -= e["dur"]
            name = short(e["name"])
            self_us[name] += e["dur"]
            # a recursive call's time is counted once, by its outermost frame
            if not any(short(s["name"]) == name for s in stack):
                incl_us[name] += e["dur"]
            calls[name] += 1
            stack.append(e)

    def table(d: dict[str, float]) -> list[list]:
        return [[n, round(us / 1e3, 2), calls[n]] for n, us in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {
        "loads": len(roots),
        "total_ms": round(sum(r["dur"] for r in roots) / 1e3, 2),
        "by_self_ms": table(self_us),  # [name, ms, calls]
        "by_inclusive_ms": table(incl_us),
    }


def _inside(e: dict, outer: dict) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


if __name__ == "__main__":
    import sys

    print(json.dumps(summarise(sys.argv[1]), indent=1))
