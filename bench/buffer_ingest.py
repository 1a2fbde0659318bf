"""Ingest throughput of the buffer over ZeroMQ, against what the transport and the disk can do.

For responses of 512, 2k and 8k tokens, measured in the same run:
  buffer/memory   BufferClient.submit (Samples -> Arrow on the client, the client's default window)
                  into `python -m buffer serve` without a directory; acked after indexing
  prebuilt_arrow  the same with Arrow batches built beforehand (a producer that builds Arrow itself)
  buffer/durable  the same into a durable buffer: acked after write + fsync of the segment
  durable_prebuilt_arrow  durable, from Arrow batches built beforehand
  raw_zmq         PUSH/PULL of the same bytes, message by message, over the same transport (tcp
                  loopback, a receiver in its own process; no acks, no work): the baseline of
                  `memory_vs_raw_zmq`, the issue's goal
  raw_zmq_keep    the same, the receiver keeping every message, as a buffer must (fresh memory for
                  every byte received, never reused; a dropping receiver reuses its memory for the next
                  message, which no store can do): `memory_vs_raw_zmq_keep`, for reference
  disk            write + fsync of the same bytes (each message's Arrow IPC form), one write and one
                  fsync per message, on the same filesystem
  raw_zmq_disk    raw_zmq whose receiver does what `disk` does with each message (write + fsync): the
                  durable transport with no buffer work at all (no acks, no checksum, no index).
                  `raw_zmq_disk_vs_disk` says how much of the disk rate ZeroMQ leaves on this
                  machine, i.e. what `durable_vs_disk` could reach here at best
  pickle          naive baseline: pickled Python objects with list fields over PUSH/PULL
  memory_steady   (--steady) buffer/memory into a server that first took as much data and had all of
                  it fetched: the memory of consumed samples is reused, as in a running pipeline
The buffer server runs as `python -m buffer serve` does anywhere, with the buffer's malloc settings
and a pre-faulted pool (buffer/memory.py); the raw receivers run as a plain ZeroMQ program would, with
glibc's defaults (so `raw_zmq_keep` shows what the pool saves).
The machine is shared and noisy, so each of `--runs` rounds measures every variant back to back, a
ratio is taken within each round, and the median over rounds is reported with its spread (min-max).
Prints one JSON line last; ratios (`memory_vs_raw_zmq`, `durable_vs_disk`, `vs_pickle`) are for 2k.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


_WARM = b"WARM"  # a pusher's first message, sent before the clock starts: the sink ignores it


def _sink(kind: str) -> None:
    """Child process: PULL until b"END" (one per pusher), unpickling if kind == pickle, holding on to
    every message if kind == keep (as a buffer must: its memory is never reused), writing and fsyncing
    every message to a new file if kind == disk:PATH (the disk baseline fed over ZeroMQ; the file is
    removed at the end); prints "messages bytes" (pickle: "samples bytes") once all have come."""
    import zmq

    path = kind.split(":", 1)[1] if kind.startswith("disk:") else None
    out = open(path, "xb", buffering=0) if path else None  # noqa: SIM115 - closed at the end

    s = zmq.Context.instance().socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 64)
    s.bind("tcp://127.0.0.1:0")
    print(s.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    n = nbytes = 0
    kept = []
    ends = int(os.environ.get("BENCH_SINK_ENDS", "1"))  # one b"END" per pusher
    while True:
        f = s.recv(copy=False)
        if len(f) in (3, 4) and f.bytes in (b"END", _WARM):
            if f.bytes == _WARM:
                continue
            ends -= 1
            if not ends:
                break
            continue
        n += len(pickle.loads(f.buffer)) if kind == "pickle" else 1
        nbytes += len(f)
        if kind == "keep":
            kept.append(f)
        elif out is not None:
            out.write(f.buffer)
            os.fsync(out.fileno())
    print(f"{n} {nbytes}", flush=True)
    if out is not None:
        out.close()
        os.unlink(path)


def _check_sink(line: str, want_n: int, want_bytes: int | None) -> None:
    n, nbytes = map(int, line.split())
    if n != want_n or (want_bytes is not None and nbytes != want_bytes):
        raise RuntimeError(f"the sink got {n} messages / {nbytes} bytes, expected {want_n} / {want_bytes}")


def _producer(spec: str) -> None:
    """Child process of `--producers N`: KIND,ADDR,TOKENS,MB,MSG_MB,PREFIX,WINDOW. Builds its messages,
    connects, prints "ready", waits for a line on stdin, then sends them all (kind buffer: submit +
    flush, every ack; kind raw: PUSH of each message's IPC bytes, then b"END") and prints "done"."""
    kind, addr, tokens, mb, msg_mb, prefix, window = spec.split(",")
    msgs = make_messages(int(tokens), float(mb), float(msg_mb), prefix)
    n = sum(len(m) for m in msgs)
    if kind == "buffer":
        from buffer.client import BufferClient

        c = BufferClient(addr, timeout_s=120, **({"window": int(window)} if int(window) else {}))
        c.stats()
    else:
        import zmq

        from buffer.frames import ipc_bytes
        from buffer.record import samples_to_batch

        payloads = [ipc_bytes(samples_to_batch(m)) for m in msgs]
        c = zmq.Context.instance().socket(zmq.PUSH)
        c.setsockopt(zmq.SNDHWM, 64)
        c.connect(addr)
        c.send(_WARM)  # the connection is up before the clock starts
    print(f"ready {n}", flush=True)
    if sys.stdin.readline().strip() != "go":  # the parent is gone: send nothing
        sys.exit(1)
    if kind == "buffer":
        for m in msgs:
            c.submit(m)
        accepted = sum(a.accepted for a in c.flush())
        assert accepted == n, f"{accepted} of {n} samples accepted"
        c.close()
    else:
        for pl in payloads:
            c.send(pl, copy=False)
        c.send(b"END")
        c.close(linger=-1)  # block until libzmq has sent everything (it would be lost at exit)
        zmq.Context.instance().term()
    print("done", flush=True)


def _shares(args, tag: str) -> list[tuple[float, str]]:
    """(MB, uid prefix) of each of the `args.producers` producers."""
    return [(args.total_mb / args.producers, f"{tag}w{k}-") for k in range(args.producers)]


def producer_messages(tokens: int, args, tag: str) -> list:
    """The messages of all `args.producers` producers together (what `_producer` builds in each)."""
    return [m for mb, prefix in _shares(args, tag) for m in make_messages(tokens, mb, args.msg_mb, prefix)]


def run_producers(kind: str, addr: str, tokens: int, args, tag: str, until=None) -> tuple[float, int]:
    """(seconds from "go" until every producer is done, and `until()` has returned; samples sent) for
    `args.producers` producer processes, each sending its share of `producer_messages`."""
    procs = []
    for mb, prefix in _shares(args, tag):
        spec = f"{kind},{addr},{tokens},{mb},{args.msg_mb},{prefix},{args.window}"
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--_produce", spec],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=_child_env(),
            )
        )
    try:
        n = 0
        for p in procs:
            line = p.stdout.readline().split()
            if not line or line[0] != "ready":
                raise RuntimeError(
                    f"a producer exited ({p.wait(30)}) before it was ready: see its stderr above"
                )
            n += int(line[1])
        t = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            if p.stdout.readline().strip() != "done":
                raise RuntimeError(f"a producer failed ({p.wait(30)}): see its stderr above")
        if until is not None:
            until()
        dt = time.perf_counter() - t
        for p in procs:
            p.wait(30)
    finally:
        for p in procs:
            _end(p)
    return dt, n


def _child_env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }


def spawn(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**_child_env(), **(env or {})},
    )
    line = p.stdout.readline().strip()
    if not line:
        raise RuntimeError(
            f"{' '.join(args)} exited ({p.wait(30)}) before printing its address: see its stderr above"
        )
    return p, line.split()[-1]


@dataclass
class PySample:  # the naive record: Python lists, as a first implementation would have it
    uid: str
    group_id: str
    prompt_ids: list = field(default_factory=list)
    response_ids: list = field(default_factory=list)
    rollout_logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    reward: float = 0.0


def make_messages(tokens: int, total_mb: float, msg_mb: float, prefix: str):
    from buffer.demo import synthetic_samples
    from buffer.record import samples_to_batch

    one = samples_to_batch(synthetic_samples(1, 1, tokens, 256)).nbytes
    per_msg = max(1, int(msg_mb * 2**20 // one))
    n_msgs = max(4, int(total_mb * 2**20 // (one * per_msg)))
    groups = max(1, per_msg // 4)
    return [synthetic_samples(groups, 4, tokens, 256, prefix=f"{prefix}{i}", seed=i) for i in range(n_msgs)]


def run_buffer(
    msgs, durable_dir: str | None, window: int, prefill=None, producers=None
) -> tuple[float, dict]:
    """Time `msgs` into a fresh server; with `prefill`, into one that first ingested `prefill` and had
    all of it fetched (consumed: its memory is free for reuse, the buffer's steady state). With
    `producers` = (tokens, args, tag), the timed ingest comes from `args.producers` processes instead
    (`run_producers`; their messages are `msgs`, split between them)."""
    args = ["-m", "buffer", "serve", "--capacity", str(10**9)]
    if durable_dir:
        args += ["--dir", durable_dir]
    p, addr = spawn(args)
    try:
        return _time_buffer(addr, msgs, window, prefill, producers)
    finally:
        p.terminate()
        p.wait(30)
        if durable_dir:
            shutil.rmtree(durable_dir, ignore_errors=True)


def prefill_and_consume(c, msgs) -> None:
    """Ingest `msgs` through client `c`, then fetch every complete group: the server's memory of them
    is free for reuse afterwards (the steady state of a running pipeline)."""
    for m in msgs:
        c.submit(m)
    c.flush()
    while n_groups := c.stats()["complete_groups"]:
        if c.fetch_table(min(256, n_groups), version=0, max_staleness=10**6, timeout_s=30) is None:
            raise RuntimeError("steady-state prefill: a fetch of complete groups came back empty")


def _time_buffer(addr: str, msgs, window: int, prefill, producers) -> tuple[float, dict]:
    from buffer.client import BufferClient

    c = BufferClient(addr, timeout_s=120, **({"window": window} if window else {}))
    c.stats()  # connected
    if prefill:
        prefill_and_consume(c, prefill)
    n = sum(len(m) if isinstance(m, list) else m.num_rows for m in msgs)
    if producers:
        dt, sent = run_producers("buffer", addr, *producers)
        assert sent == n and c.stats()["rows"] >= n, "the producers did not send the same samples"
    else:
        t = time.perf_counter()
        for m in msgs:
            c.submit(m)
        acks = c.flush()
        dt = time.perf_counter() - t
        assert sum(a.accepted for a in acks) == n, "not every sample was accepted"
    stats = c.stats()
    c.close()
    return dt, stats


def run_raw(payloads: list, kind: str, producers=None) -> float:
    """Seconds to PUSH `payloads` into a `_sink` of `kind` until it has them all (pickle: `payloads`
    are lists of objects, pickled in the timed loop); checks that every message arrived."""
    import zmq

    if kind.startswith("disk:"):  # a new file in that directory for every run
        kind = f"disk:{os.path.join(kind[5:], f'raw-zmq-disk-{time.monotonic_ns()}.bin')}"
    want_n = sum(len(pl) for pl in payloads) if kind == "pickle" else len(payloads)
    want_bytes = None if kind == "pickle" else sum(len(pl) for pl in payloads)
    if producers:  # (tokens, args, tag): the same bytes from args.producers pushing processes
        p, addr = spawn([__file__, "--_sink", kind], {"BENCH_SINK_ENDS": str(producers[1].producers)})
        try:
            got = []
            dt, _ = run_producers("raw", addr, *producers, until=lambda: got.append(p.stdout.readline()))
            _check_sink(got[0], want_n, want_bytes)
            p.wait(30)
        finally:
            _end(p)
        return dt
    p, addr = spawn([__file__, "--_sink", kind])
    s = zmq.Context.instance().socket(zmq.PUSH)
    try:
        s.setsockopt(zmq.SNDHWM, 64)
        s.connect(addr)
        s.send(_WARM)  # the connection is up before the clock starts
        t = time.perf_counter()
        for pl in payloads:
            s.send(pickle.dumps(pl, protocol=5) if kind == "pickle" else pl, copy=False)
        s.send(b"END")
        line = p.stdout.readline()
        dt = time.perf_counter() - t
        _check_sink(line, want_n, want_bytes)
        p.wait(30)
    finally:
        s.close(0)
        _end(p)
    return dt


def _end(p: subprocess.Popen) -> None:
    """Stop a child of this bench that is still running (only ours, by its handle)."""
    if p.poll() is None:
        p.kill()
        p.wait(30)


def run_disk(payloads: list, directory: str) -> float:
    path = os.path.join(directory, "disk-baseline.bin")
    f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed below, outside the timing
    t = time.perf_counter()
    for pl in payloads:
        f.write(pl)
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    f.close()
    os.unlink(path)
    return dt


def _pickle_messages(msgs: list) -> list:
    """The first eighth of the messages as naive records (Python lists), for the pickle baseline."""
    fields = ("prompt_ids", "response_ids", "rollout_logprobs", "versions", "loss_mask")
    return [
        [PySample(s.uid, s.group_id, *(s.array(f).tolist() for f in fields), s.reward) for s in m]
        for m in msgs[: max(1, len(msgs) // 8)]
    ]


def one_size(tokens: int, args, tmp: str) -> dict:
    from buffer.frames import ipc_bytes
    from buffer.record import samples_to_batch

    if args.producers > 1:
        return many_producers(tokens, args, tmp)
    msgs = make_messages(tokens, args.total_mb, args.msg_mb, f"t{tokens}-")
    batches = [samples_to_batch(m) for m in msgs]  # for the run that excludes Sample -> Arrow
    payloads = [ipc_bytes(b) for b in batches]  # every message's own bytes, for both baselines
    prefill = make_messages(tokens, args.total_mb, args.msg_mb, f"p{tokens}-") if args.steady else None
    nbytes = sum(p.size for p in payloads)
    n = sum(len(m) for m in msgs)
    py = _pickle_messages(msgs) if tokens == 2048 else None
    n_py = sum(len(m) for m in py) if py else 0
    rounds: list[dict] = []
    fsyncs = []
    for _ in range(args.runs):
        dt_durable, st = run_buffer(msgs, tempfile.mkdtemp(dir=tmp), args.window)
        fsyncs.append(st.get("segment_fsyncs", 0))
        r = {
            "memory": run_buffer(msgs, None, args.window)[0],
            "memory_prebuilt_arrow": run_buffer(batches, None, args.window)[0],
            "raw_zmq": run_raw(payloads, "raw"),
            "raw_zmq_keep": run_raw(payloads, "keep"),
            "durable": dt_durable,
            "durable_prebuilt_arrow": run_buffer(batches, tempfile.mkdtemp(dir=tmp), args.window)[0],
            "disk": run_disk(payloads, tmp),
            "raw_zmq_disk": run_raw(payloads, f"disk:{tmp}"),
        }
        if prefill:
            r["memory_steady"] = run_buffer(msgs, None, args.window, prefill)[0]
        if py:  # timed on fewer messages (pickling is slow), then scaled to the same sample count
            r["pickle"] = run_raw(py, "pickle") * n / n_py
        rounds.append(r)
    out = {
        "tokens": tokens,
        "samples": n,
        "bytes": nbytes,
        "msgs": len(msgs),
        "msg_samples": len(msgs[0]),
        "runs": args.runs,
        "segment_fsyncs": fsyncs,
    }
    return summarize(out, rounds)


def many_producers(tokens: int, args, tmp: str) -> dict:
    """`--producers N`: the buffer variants and raw ZeroMQ fed by N processes at once, each sending
    its share of the same messages (a pipeline's generators); the disk baseline as before."""
    from buffer.frames import ipc_bytes
    from buffer.record import samples_to_batch

    tag = f"t{tokens}-"
    msgs = producer_messages(tokens, args, tag)
    payloads = [ipc_bytes(samples_to_batch(m)) for m in msgs]
    prefill = make_messages(tokens, args.total_mb, args.msg_mb, f"p{tokens}-") if args.steady else None
    spec = (tokens, args, tag)
    rounds = []
    for _ in range(args.runs):
        r = {
            "memory": run_buffer(msgs, None, args.window, producers=spec)[0],
            "raw_zmq": run_raw(payloads, "raw", producers=spec),
            "durable": run_buffer(msgs, tempfile.mkdtemp(dir=tmp), args.window, producers=spec)[0],
            "disk": run_disk(payloads, tmp),
        }
        if prefill:
            r["memory_steady"] = run_buffer(msgs, None, args.window, prefill, producers=spec)[0]
        rounds.append(r)
    out = {
        "tokens": tokens,
        "producers": args.producers,
        "samples": sum(len(m) for m in msgs),
        "bytes": sum(p.size for p in payloads),
        "msgs": len(msgs),
        "msg_samples": len(msgs[0]),
        "runs": args.runs,
    }
    return summarize(out, rounds)


def summarize(out: dict, rounds: list[dict]) -> dict:
    """Median rates and within-round ratios over `rounds` ({variant: seconds}) into `out`."""
    n, nbytes = out["samples"], out["bytes"]
    for k in rounds[0]:
        rates = [n / r[k] for r in rounds]
        out[f"{k}_samples_s"] = round(statistics.median(rates))
        out[f"{k}_GB_s"] = round(nbytes / n * statistics.median(rates) / 1e9, 3)
        out[f"{k}_GB_s_spread"] = [
            round(nbytes / n * min(rates) / 1e9, 3),
            round(nbytes / n * max(rates) / 1e9, 3),
        ]
    for name, a, b in (
        ("memory_vs_raw_zmq", "memory", "raw_zmq"),
        ("memory_vs_raw_zmq_keep", "memory", "raw_zmq_keep"),
        ("memory_steady_vs_raw_zmq", "memory_steady", "raw_zmq"),
        ("prebuilt_arrow_vs_raw_zmq", "memory_prebuilt_arrow", "raw_zmq"),
        ("prebuilt_arrow_vs_raw_zmq_keep", "memory_prebuilt_arrow", "raw_zmq_keep"),
        ("durable_vs_disk", "durable", "disk"),
        ("durable_prebuilt_arrow_vs_disk", "durable_prebuilt_arrow", "disk"),
        ("raw_zmq_disk_vs_disk", "raw_zmq_disk", "disk"),
        ("durable_vs_raw_zmq_disk", "durable", "raw_zmq_disk"),
        ("vs_pickle", "memory", "pickle"),
    ):
        if a not in rounds[0] or b not in rounds[0]:
            continue
        ratios = [r[b] / r[a] for r in rounds]  # a rate ratio = inverse ratio of times
        out[name] = round(statistics.median(ratios), 3)
        out[f"{name}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller volumes (under a minute)")
    ap.add_argument(
        "--window", type=int, default=0, help="unacked ingest messages in flight (default: the client's)"
    )
    ap.add_argument("--msg-mb", type=float, default=4.0, help="target size of one ingest message")
    ap.add_argument("--runs", type=int, default=0, help="rounds (default: 5, or 3 with --quick)")
    ap.add_argument(
        "--total-mb",
        type=float,
        default=0,
        help="data per variant and round (default: 512, or 96 with --quick)",
    )
    ap.add_argument("--tokens", default="512,2048,8192", help="response lengths to measure")
    ap.add_argument(
        "--steady",
        action="store_true",
        help="also memory_steady: into a server whose earlier, as large ingest was all consumed",
    )
    ap.add_argument(
        "--producers",
        type=int,
        default=1,
        help="N > 1: the buffer and raw ZeroMQ fed by N producer processes at once (memory, durable, "
        "raw_zmq, disk, steady)",
    )
    ap.add_argument("--_sink", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_produce", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=float(os.environ.get("BENCH_TIMEOUT_S", 3600)),
        help="give up (printing every thread's stack) after this; children inherit it",
    )
    args = ap.parse_args()
    os.environ["BENCH_TIMEOUT_S"] = str(args.timeout_s)
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # no silent hang on a stuck child
    if args._sink:
        return _sink(args._sink)
    if args._produce:
        return _producer(args._produce)
    args.total_mb = args.total_mb or (96 if args.quick else 512)
    args.runs = args.runs or (3 if args.quick else 5)
    sizes = [int(t) for t in args.tokens.split(",")]
    # BENCH_DIR: where the durable buffer and the disk baseline write (default: the system temp dir).
    tmp = tempfile.mkdtemp(prefix="buffer-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        rows = [one_size(t, args, tmp) for t in sizes]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    r2k = next((r for r in rows if r["tokens"] == 2048), rows[0])
    result = {
        "bench": "buffer_ingest",
        "quick": args.quick,
        "runs": args.runs,
        "producers": args.producers,
        "tokens": r2k["tokens"],
    }
    for k in (
        "memory_vs_raw_zmq",
        "memory_vs_raw_zmq_keep",
        "memory_steady_vs_raw_zmq",
        "durable_vs_disk",
        "prebuilt_arrow_vs_raw_zmq",
        "prebuilt_arrow_vs_raw_zmq_keep",
        "durable_prebuilt_arrow_vs_disk",
        "raw_zmq_disk_vs_disk",
        "durable_vs_raw_zmq_disk",
    ):
        if k in r2k:
            result[k], result[f"{k}_spread"] = r2k[k], r2k[f"{k}_spread"]
    if "vs_pickle" in r2k:
        result["vs_pickle"], result["vs_pickle_spread"] = r2k["vs_pickle"], r2k["vs_pickle_spread"]
    result["by_tokens"] = {
        r["tokens"]: {k: v for k, v in r.items() if k.endswith(("_GB_s", "_samples_s", "_spread"))}
        for r in rows
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
