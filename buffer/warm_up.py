"""A fresh buffer server's warm-up: the ingest path run once before it serves (BufferServer calls it)."""

from __future__ import annotations

from buffer import wire
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.frames import batches_to_frames, frames_to_batches
from buffer.record import samples_to_batch
from buffer.segments import batch_crc
from buffer.storage import Buffer
from buffer.validate import check_batch


def warm_up() -> None:
    """Run a two-sample ingest through every step of the ingest path (frames, validation, dedup,
    indexing, checksum, a fetch) on a throwaway in-memory buffer before serving. The first call of
    many of these steps imports modules or builds kernels and signatures (pyarrow.compute, numpy),
    which cost a fresh server ~10-20 ms on its first ingest messages: a server pays that once, here,
    instead of while a producer waits for its first acks."""
    batch = samples_to_batch(synthetic_samples(1, 2, 8, 4, prefix="warm-up"))
    layout, frames = batches_to_frames([batch])
    (got,) = frames_to_batches(layout, [bytes(f) for f in frames])
    check_batch(got)
    batch_crc(got)
    buf = Buffer(BufferConfig(durable=False, capacity_samples=16))
    buf.commit(buf.plan(got, checked=True))
    buf.fetch(1, 0, 0)
    wire.decode(
        wire.encode(wire.IngestAck(req=1, seq=1, accepted=2, duplicates=0, rejected=0, trainer_version=0))
    )
