"""The small records the replay buffer (buffer/storage.py) hands out and keeps per group: an ingest
`Plan` (what a batch would add, checked before anything changes), a `FetchResult`, and the group
index entries. Kept apart so storage.py holds only the buffer's behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from buffer import wire


@dataclass(slots=True, eq=False)
class _Group:
    gid: str
    size: int
    min_version: int | None = None  # oldest token version; None = no tokens (never stale)
    times_sampled: int = 0
    rows: list[tuple[int, int, int]] = field(default_factory=list)  # (group_index, chunk, row)
    uids: list[str] = field(default_factory=list)

    def staleness(self, version: int) -> int:
        return 0 if self.min_version is None else version - self.min_version


@dataclass
class Plan:
    """The outcome of `Buffer.plan`: what committing a batch would store."""

    batch: pa.RecordBatch | None  # the rows to store (None: nothing new)
    n_new: int = 0
    duplicates: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    runs: _Runs | None = field(default=None, repr=False)  # set by the fast path of Buffer.plan

    def ack(self, *, seq: int, trainer_version: int, req: int = 0) -> wire.IngestAck:
        """The producer's acknowledgement of this plan once committed (and durable)."""
        return wire.IngestAck(
            req=req,
            seq=seq,
            accepted=self.n_new,
            duplicates=self.duplicates,
            rejected=self.rejected,
            trainer_version=trainer_version,
            errors=self.errors,
        )


@dataclass(slots=True)
class _Runs:
    """A batch whose groups are each one run of consecutive rows, all new to the buffer (what a
    generator sends: whole groups). `starts[k]` is the first row of group k. Made by `Buffer.plan`
    from the batch's columns once, so that `commit` indexes it group by group, not row by row."""

    uids: list[str]
    gids: list[str]
    idxs: list[int]
    sizes: list[int]
    starts: list[int]


@dataclass
class FetchResult:
    """`pieces`: the served rows as zero-copy slices of stored batches (None: nothing served).
    `batch` combines them into one record batch (a copy when there are several pieces)."""

    pieces: list[pa.RecordBatch] | None
    num_groups: int = 0
    evicted: int = 0
    _batch: pa.RecordBatch | None = field(default=None, repr=False)

    @property
    def batch(self) -> pa.RecordBatch | None:
        if self._batch is None and self.pieces:
            self._batch = self.pieces[0] if len(self.pieces) == 1 else pa.concat_batches(self.pieces)
        return self._batch
