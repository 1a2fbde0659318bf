"""What parked fetches cost the buffer server: the ingest ack latency with N long-timeout fetches
waiting for groups that never come, against the same server with none (the baseline, same run).

    .venv/bin/python bench/parked_fetches.py [--parked 10000] [--acks 20]

Prints one JSON line last: {"ack_ms_idle", "ack_ms_parked", "parked", ...} (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import RESULTS, record  # noqa: E402 - bench/ is on sys.path when a bench runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parked", type=int, default=10000)
    ap.add_argument("--acks", type=int, default=20)
    a = ap.parse_args()
    import zmq

    from buffer import wire
    from buffer.client import BufferClient
    from buffer.config import BufferConfig
    from buffer.demo import synthetic_samples
    from buffer.server import BufferServer

    server = BufferServer(BufferConfig(durable=False, capacity_samples=10**7)).start()
    producer = BufferClient(server.address, producer="bench", timeout_s=60)

    def ack_ms(tag: str) -> float:
        times = []
        for i in range(a.acks):
            t0 = time.perf_counter()
            # groups of 4 with 3 samples sent: never complete, so the parked fetches stay parked
            producer.put(synthetic_samples(1, prefix=f"{tag}{i}")[:3])
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    idle = ack_ms("idle")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    for req in range(1, a.parked + 1):  # each waits up to an hour for 1000 complete groups
        sock.send(
            wire.encode(
                wire.Fetch(
                    req=req,
                    consumer=f"bench-{req}",  # one waiting fetch per consumer (a newer one supersedes it)
                    num_groups=1000,
                    version=0,
                    max_staleness=10**6,
                    timeout_s=3600.0,
                )
            )
        )
    deadline = time.monotonic() + 120
    while producer.stats()["pending_fetches"] < a.parked:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"only {producer.stats()['pending_fetches']} of {a.parked} fetches parked in 120 s"
            )
        time.sleep(0.05)
    parked = ack_ms("parked")
    cpu0 = time.process_time()
    time.sleep(2.0)  # the server thread lives in this process: its idle CPU over 2 s
    idle_cpu = (time.process_time() - cpu0) / 2.0
    sock.close(0)
    producer.close()
    server.stop()
    out = {
        "ack_ms_idle": round(idle, 3),
        "ack_ms_parked": round(parked, 3),
        "parked": a.parked,
        "idle_cpu_share_with_parked": round(idle_cpu, 3),
    }
    record(out, RESULTS / "parked_fetches.jsonl")


if __name__ == "__main__":
    main()
