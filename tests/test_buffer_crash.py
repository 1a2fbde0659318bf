"""Kill `python -m buffer serve` with SIGKILL mid-ingest, restart it on the same directory, and check
that the producer's resends leave every acknowledged uid stored exactly once and that consumed uids
are never served again."""

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from buffer.client import BufferClient
from buffer.demo import synthetic_samples
from buffer.segments import recover_segments

REPO = Path(__file__).resolve().parent.parent


def start_server(directory: Path, bind: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffer", "serve", "--dir", str(directory), "--bind", bind],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = proc.stdout.readline()
    if not line.startswith("buffer listening on "):
        proc.kill()
        raise AssertionError(f"server did not start: {line}{proc.stdout.read()}")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        proc.wait(20)
    proc.stdout.close()


@pytest.mark.timeout(120)
def test_sigkill_mid_ingest_loses_nothing_acked(tmp_path):
    directory = tmp_path / "buf"
    proc, addr = start_server(directory, "tcp://127.0.0.1:0")
    trainer = BufferClient(addr, timeout_s=20)
    producer = BufferClient(addr, producer="gen0", timeout_s=60, resend_s=0.3, window=6)
    try:
        first = synthetic_samples(6, prefix="pre")
        producer.put(first)
        consumed = trainer.fetch(3, version=0, max_staleness=10, timeout_s=5).column("uid").to_pylist()

        batches = [synthetic_samples(4, response_len=512, prefix=f"m{i}", seed=i) for i in range(120)]
        acked: list[int] = []
        failure: list[BaseException] = []

        def produce():
            try:
                for b in batches:
                    producer.submit(b)
                    acked.extend(a.seq for a in producer.collect())
                acked.extend(a.seq for a in producer.flush())
            except BaseException as e:  # surfaced below
                failure.append(e)

        t = threading.Thread(target=produce)
        t.start()
        deadline = time.monotonic() + 30
        while len(acked) < 5:
            assert time.monotonic() < deadline, "the producer never got going"
            time.sleep(0.01)
        stop(proc, signal.SIGKILL)  # mid-ingest: some messages acked, some in flight, some unsent
        killed_with_unacked = len(acked) < len(batches)
        time.sleep(0.3)
        proc, addr2 = start_server(directory, addr)
        assert addr2 == addr
        t.join(90)
        assert not failure, failure
        assert len(acked) == len(batches) and killed_with_unacked

        # Every uid the producer got an ack for is stored exactly once on disk.
        rec = recover_segments(directory)
        counts = collections.Counter(u for _, b in rec.batches for u in b.column("uid").to_pylist())
        expected = {s.uid for s in first} | {s.uid for b in batches for s in b}
        assert set(counts) == expected and max(counts.values()) == 1

        # Consumed before the crash: never served again. Everything else: served exactly once.
        ready = trainer.stats()["complete_groups"]
        served = trainer.fetch(ready, version=0, max_staleness=10, timeout_s=5).column("uid").to_pylist()
        assert trainer.fetch(1, version=0, max_staleness=10, timeout_s=0.2) is None
        assert not set(served) & set(consumed)
        assert sorted(served + consumed) == sorted(expected)
    finally:
        producer.close()
        trainer.close()
        stop(proc)
