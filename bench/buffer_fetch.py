"""Time to serve one fetch of ~2M response tokens, against a memcpy of the same bytes.

`serve`: what the server does per fetch (choose groups, gather their rows into one record batch,
serialize it to the Arrow IPC reply frame), on a buffer filled the way producers fill it (many
ingest messages). `zmq`: the whole round trip through BufferServer + BufferClient on loopback TCP.
Prints one JSON line last with `fetch_vs_memcpy` (serve / memcpy) and `fetch_zmq_vs_memcpy`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from buffer.client import BufferClient  # noqa: E402
from buffer.config import BufferConfig  # noqa: E402
from buffer.convert import samples_to_batch  # noqa: E402
from buffer.demo import synthetic_samples  # noqa: E402
from buffer.server import BufferServer, ipc_bytes  # noqa: E402
from buffer.storage import Buffer  # noqa: E402


def filled(batches) -> Buffer:
    buf = Buffer(BufferConfig(durable=False, capacity_samples=10**9))
    for b in batches:
        buf.insert(b)
    return buf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="response tokens per sample")
    ap.add_argument("--batch-tokens", type=int, default=2 * 2**20, help="response tokens per fetch")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    groups = args.batch_tokens // args.tokens // 4
    per_msg = 16  # groups per ingest message: the fetch spans many stored batches
    batches = [
        samples_to_batch(synthetic_samples(per_msg, 4, args.tokens, 256, prefix=f"m{i}-", seed=i))
        for i in range(groups // per_msg)
    ]
    serve, nbytes = [], 0
    for _ in range(args.repeat):
        buf = filled(batches)
        t = time.perf_counter()
        out = buf.fetch(groups, 0, 0).batch
        payload = ipc_bytes(out)
        serve.append(time.perf_counter() - t)
        nbytes = payload.size
    src = np.frombuffer(payload, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t)
    fresh = []  # into a newly allocated buffer, as the serve path's outputs are (page faults included)
    for _ in range(args.repeat):
        t = time.perf_counter()
        np.array(src, copy=True)
        fresh.append(time.perf_counter() - t)
    zmq_t = []
    for _ in range(args.repeat):
        srv = BufferServer(
            BufferConfig(durable=False, capacity_samples=10**9), buffer=filled(batches)
        ).start()
        c = BufferClient(srv.address)
        c.stats()
        t = time.perf_counter()
        got = c.fetch(groups, 0, 0, timeout_s=30)
        zmq_t.append(time.perf_counter() - t)
        assert got.num_rows == groups * 4
        c.close()
        srv.stop()
    best = {"serve": min(serve), "memcpy": min(memcpy), "zmq": min(zmq_t)}
    print(
        json.dumps(
            {
                "bench": "buffer_fetch",
                "tokens_per_fetch": groups * 4 * args.tokens,
                "bytes": nbytes,
                "stored_batches": len(batches),
                "serve_ms": round(best["serve"] * 1e3, 2),
                "memcpy_ms": round(best["memcpy"] * 1e3, 2),
                "memcpy_fresh_ms": round(min(fresh) * 1e3, 2),
                "fetch_vs_memcpy_fresh": round(best["serve"] / min(fresh), 2),
                "zmq_roundtrip_ms": round(best["zmq"] * 1e3, 2),
                "fetch_vs_memcpy": round(best["serve"] / best["memcpy"], 2),
                "fetch_zmq_vs_memcpy": round(best["zmq"] / best["memcpy"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
