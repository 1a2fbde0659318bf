"""Where an ingest spends its CPU: per-thread CPU time of the client and the buffer server process
for one timed ingest (the same messages as bench/buffer_ingest.py), next to its wall time.

A thread whose CPU time is close to the wall time is the one that bounds the rate; on a box with few
cores, the sum over threads against cores x wall shows whether the CPU is simply full.
  python bench/ingest_threads.py [--mb 512] [--steady] [--prebuilt] [--durable]
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

_HZ = os.sysconf("SC_CLK_TCK")


def thread_cpu_ms(pid: int) -> dict[str, float]:
    """{"name/tid": user+system CPU ms} for every thread of a process (Linux /proc)."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/stat") as f:
                stat = f.read()
            with open(f"{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[f"{name}/{task.rsplit('/', 1)[1]}"] = (int(fields[11]) + int(fields[12])) * 1000 / _HZ
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    d = {k: round(v - before.get(k, 0.0), 1) for k, v in after.items()}
    return {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0}


def main() -> None:
    import buffer_ingest as bi

    from buffer.client import BufferClient
    from buffer.record import samples_to_batch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=512, help="data per timed ingest")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steady", action="store_true", help="first ingest and consume as much data")
    ap.add_argument("--prebuilt", action="store_true", help="submit Arrow batches built beforehand")
    ap.add_argument("--durable", action="store_true", help="a durable buffer (in a temp dir)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=1800, help="give up (printing stacks) after this")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # no silent hang
    rows = []
    for run in range(args.runs):
        msgs = bi.make_messages(args.tokens, args.mb, 4.0, f"r{run}-")
        data = [samples_to_batch(m) for m in msgs] if args.prebuilt else msgs
        if args.prebuilt:  # own memory, out of the converter's scratch pool
            import pyarrow as pa

            data = [
                pa.RecordBatch.from_arrays([pa.concat_arrays([col]) for col in b.columns], schema=b.schema)
                for b in data
            ]
        tmp = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR")) if args.durable else None
        p, addr = bi.spawn(
            ["-m", "buffer", "serve", "--capacity", str(10**9), *(["--dir", tmp] if tmp else [])]
        )
        c = BufferClient(addr, timeout_s=120)
        try:
            rows.append(_timed(c, p.pid, args, run, data, msgs))
        finally:
            c.close()
            p.terminate()
            p.wait(30)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "ingest_threads",
                "mb": args.mb,
                "steady": args.steady,
                "prebuilt": args.prebuilt,
                "durable": args.durable,
                "cores": os.cpu_count(),
                "runs": rows,
            }
        )
    )


def _timed(c, server_pid: int, args, run: int, data: list, msgs: list) -> dict:
    import buffer_ingest as bi

    from buffer.record import samples_to_batch

    c.stats()
    if args.steady:
        bi.prefill_and_consume(c, bi.make_messages(args.tokens, args.mb, 4.0, f"p{run}-"))
    if args.prebuilt:
        nbytes = sum(b.nbytes for b in data)
    else:
        nbytes = sum(samples_to_batch(m).nbytes for m in msgs)
    s0, c0 = thread_cpu_ms(server_pid), thread_cpu_ms(os.getpid())
    t = time.perf_counter()
    for m in data:
        c.submit(m)
    c.flush()
    wall = time.perf_counter() - t
    s1, c1 = thread_cpu_ms(server_pid), thread_cpu_ms(os.getpid())
    return {
        "wall_ms": round(wall * 1000, 1),
        "GB_s": round(nbytes / wall / 1e9, 3),
        "server": delta(s0, s1),
        "client": delta(c0, c1),
    }


if __name__ == "__main__":
    main()
