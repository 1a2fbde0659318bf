"""`InProcBuffer`: the SampleSink / BatchSource ABCs over a `Buffer` in this process (no sockets).

For the embedded single-process pipeline, tests, and stages run against a recorded buffer directory.
Same semantics as the ZeroMQ path: puts are acked after the data is durable, a full buffer makes
`put` wait for room (back-pressure), `fetch` waits up to its timeout for enough complete groups.
Thread-safe: one lock around the Buffer, one condition for "something changed".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa

from buffer import wire
from buffer.config import BufferConfig
from buffer.record import Sample, samples_to_batch
from buffer.storage import Buffer
from buffer.transport import BatchSource, BufferUnavailable, SampleSink


class InProcBuffer(SampleSink, BatchSource):
    """InProcBuffer(buffer) or InProcBuffer(cfg=..., directory=...)."""

    def __init__(
        self,
        buffer: Buffer | None = None,
        *,
        cfg: BufferConfig | None = None,
        directory: str | Path | None = None,
    ):
        self.buffer = buffer if buffer is not None else Buffer(cfg or BufferConfig(), directory)
        self._cond = threading.Condition()
        self._seq = 0

    def put(self, samples: list[Sample] | pa.RecordBatch, timeout_s: float = 60.0) -> wire.IngestAck:
        batch = samples if isinstance(samples, pa.RecordBatch) else samples_to_batch(samples)
        if batch.num_rows > self.buffer.cfg.capacity_samples:
            raise ValueError(
                f"put of {batch.num_rows} samples can never fit capacity_samples="
                f"{self.buffer.cfg.capacity_samples}; put fewer at a time or raise buffer.capacity_samples"
            )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                plan = self.buffer.plan(batch)
                if self.buffer.has_room(plan.n_new):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferUnavailable(
                        f"in-process buffer stayed full ({self.buffer.live_rows}/"
                        f"{self.buffer.cfg.capacity_samples} samples) for {timeout_s}s; the trainer is not "
                        "fetching: check that it runs, or raise buffer.capacity_samples"
                    )
                self._cond.wait(left)
            self.buffer.commit(plan)
            self.buffer.sync()
            self._seq += 1
            self._cond.notify_all()
            return plan.ack(seq=self._seq, trainer_version=self.buffer.version)

    def fetch(
        self, num_groups: int, version: int, max_staleness: int, timeout_s: float = 60.0
    ) -> pa.RecordBatch | None:
        if num_groups < 1 or max_staleness < 0:
            raise ValueError("fetch needs num_groups >= 1 and max_staleness >= 0")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                res = self.buffer.fetch(num_groups, version, max_staleness)
                if res.batch is not None or res.evicted:
                    self._cond.notify_all()  # room was made: wake blocked producers
                if res.batch is not None:
                    return res.batch
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def set_version(self, version: int) -> None:
        with self._cond:
            self.buffer.set_version(version)
            self.buffer.sync()
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return self.buffer.stats()

    def close(self) -> None:
        with self._cond:
            self.buffer.close()
