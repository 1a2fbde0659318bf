"""Time to serve one fetch of ~2M response tokens, against a memcpy of the same bytes.

`serve`: what the server does per fetch (choose groups, take zero-copy slices of the stored batches
they live in, lay those out as reply frames: buffer.frames), on a buffer filled the way producers
fill it (many ingest messages, so one fetch spans many stored batches). `serve_ipc`, for reference,
is the previous reply form: the slices concatenated into one record batch, then serialized to one
Arrow IPC stream. `zmq` / `zmq_table`: the whole round trip through BufferServer + BufferClient on
loopback TCP, `fetch` (the client combines the pieces into one record batch) and `fetch_table` (it
does not); `raw_zmq`: a DEALER/ROUTER round trip of the same bytes as one frame, for the transport.
Each figure is the median of --repeat runs, with its spread (min-max).
Prints one JSON line last with `fetch_vs_memcpy` (serve / memcpy) and `fetch_zmq_vs_memcpy`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from buffer.client import BufferClient  # noqa: E402
from buffer.config import BufferConfig  # noqa: E402
from buffer.demo import synthetic_samples  # noqa: E402
from buffer.frames import (
    batches_to_frames,  # noqa: E402
    ipc_bytes,  # noqa
)
from buffer.record import samples_to_batch  # noqa: E402
from buffer.server import BufferServer  # noqa: E402
from buffer.storage import Buffer  # noqa: E402


def filled(batches) -> Buffer:
    buf = Buffer(BufferConfig(durable=False, capacity_samples=10**9))
    for b in batches:
        buf.insert(b)
    return buf


def stat(times: list[float]) -> dict:
    return {
        "ms": round(statistics.median(times) * 1e3, 2),
        "spread_ms": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
    }


def raw_roundtrip(payload: bytes, repeat: int) -> list[float]:
    ctx = zmq.Context.instance()
    srv = ctx.socket(zmq.ROUTER)
    port = srv.bind_to_random_port("tcp://127.0.0.1")

    def serve():
        for _ in range(repeat + 1):
            ident, _ = srv.recv_multipart()
            srv.send_multipart([ident, payload], copy=False)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = ctx.socket(zmq.DEALER)
    c.connect(f"tcp://127.0.0.1:{port}")
    out = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        c.send(b"x")
        c.recv(copy=False)
        if i:  # the first one connects
            out.append(time.perf_counter() - t0)
    t.join()
    c.close(0)
    srv.close(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="response tokens per sample")
    ap.add_argument("--batch-tokens", type=int, default=2 * 2**20, help="response tokens per fetch")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    groups = args.batch_tokens // args.tokens // 4
    per_msg = 16  # groups per ingest message: the fetch spans many stored batches
    batches = [
        samples_to_batch(synthetic_samples(per_msg, 4, args.tokens, 256, prefix=f"m{i}-", seed=i))
        for i in range(groups // per_msg)
    ]
    serve, serve_ipc, nbytes, nframes = [], [], 0, 0
    for _ in range(args.repeat):
        buf = filled(batches)
        t = time.perf_counter()
        pieces = buf.fetch(groups, 0, 0).pieces
        _, frames = batches_to_frames(pieces)
        serve.append(time.perf_counter() - t)
        nbytes, nframes = sum(len(f) for f in frames), len(frames)
        buf = filled(batches)
        t = time.perf_counter()
        payload = ipc_bytes(buf.fetch(groups, 0, 0).batch)
        serve_ipc.append(time.perf_counter() - t)
    src = np.frombuffer(payload, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy, fresh = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.array(src, copy=True)  # into newly allocated memory (page faults included)
        fresh.append(time.perf_counter() - t)
    zmq_t, zmq_table = [], []
    for _ in range(args.repeat):
        for combine, out in ((True, zmq_t), (False, zmq_table)):
            srv = BufferServer(
                BufferConfig(durable=False, capacity_samples=10**9), buffer=filled(batches)
            ).start()
            c = BufferClient(srv.address)
            c.stats()
            t = time.perf_counter()
            got = (
                c.fetch(groups, 0, 0, timeout_s=30) if combine else c.fetch_table(groups, 0, 0, timeout_s=30)
            )
            out.append(time.perf_counter() - t)
            assert got.num_rows == groups * 4
            c.close()
            srv.stop()
    raw = raw_roundtrip(payload.to_pybytes(), args.repeat)
    med = {k: statistics.median(v) for k, v in (("serve", serve), ("memcpy", memcpy), ("zmq", zmq_t))}
    print(
        json.dumps(
            {
                "bench": "buffer_fetch",
                "repeat": args.repeat,
                "tokens_per_fetch": groups * 4 * args.tokens,
                "bytes": nbytes,
                "reply_frames": nframes,
                "stored_batches": len(batches),
                "serve": stat(serve),
                "serve_ipc": stat(serve_ipc),
                "memcpy": stat(memcpy),
                "memcpy_fresh": stat(fresh),
                "zmq_roundtrip": stat(zmq_t),
                "zmq_roundtrip_table": stat(zmq_table),
                "raw_zmq_roundtrip": stat(raw),
                "fetch_vs_memcpy": round(med["serve"] / med["memcpy"], 2),
                "fetch_vs_memcpy_fresh": round(med["serve"] / statistics.median(fresh), 2),
                "fetch_zmq_vs_memcpy": round(med["zmq"] / med["memcpy"], 2),
                "fetch_zmq_vs_raw_zmq": round(med["zmq"] / statistics.median(raw), 2),
                "fetch_table_zmq_vs_raw_zmq": round(statistics.median(zmq_table) / statistics.median(raw), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
