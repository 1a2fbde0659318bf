"""How stages talk to the buffer: two small ABCs, implemented over ZeroMQ (buffer.client) and
in-process (buffer.inproc), so a stage's code does not care where the buffer lives."""

from __future__ import annotations

from abc import ABC, abstractmethod

import pyarrow as pa

from buffer.record import Sample
from buffer.wire import IngestAck


class BufferUnavailable(RuntimeError):
    """The buffer did not answer in time; the message says which address and what to check."""


class SampleSink(ABC):
    """Generator side. `put` returns only once the buffer acked (made durable) the samples."""

    @abstractmethod
    def put(self, samples: list[Sample], timeout_s: float = 60.0) -> IngestAck:
        """Send samples; resend until acked; raise BufferUnavailable after timeout_s."""

    def evicted_groups(self, producer: str) -> int:
        """How many of `producer`'s groups (by Sample.generator_id) the buffer evicted as too stale.
        They will never be trained on, so a generator's admission control must stop counting them as
        pending; otherwise each eviction shrinks its window for good (and enough of them starve the
        trainer). 0 where the sink cannot tell."""
        stats = getattr(self, "stats", None)
        return int(stats().get("evicted_groups_by_producer", {}).get(producer, 0)) if stats else 0

    def close(self) -> None:  # noqa: B027
        pass


class BatchSource(ABC):
    """Trainer side."""

    @abstractmethod
    def fetch(
        self, num_groups: int, version: int, max_staleness: int, timeout_s: float
    ) -> pa.RecordBatch | None:
        """Complete groups trainable at `version` (one record batch, buffer.record.ARROW_SCHEMA), or
        None if fewer than num_groups were available within timeout_s."""

    @abstractmethod
    def set_version(self, version: int) -> None:
        """Announce the trainer's policy version (generators see it in their acks)."""

    @abstractmethod
    def stats(self) -> dict:
        """Buffer counters (rows, groups, evictions, rejects, ...)."""

    def close(self) -> None:  # noqa: B027
        pass
