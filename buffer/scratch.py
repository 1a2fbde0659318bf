"""Recycled, aligned memory for the Arrow value buffers that record.samples_to_batch builds
(record.SCRATCH is the process's pool)."""

from __future__ import annotations

import threading

import pyarrow as pa


class _Lease:
    """Owner of one pooled block while Arrow buffers use it: when the last buffer (or slice) over the
    block is gone, Arrow drops its reference to this object and the block goes back to the pool."""

    __slots__ = ("block", "pool")

    def __init__(self, block: pa.Buffer, pool: ScratchPool):
        self.block, self.pool = block, pool

    def __del__(self):
        try:
            self.pool._give_back(self.block)
        except Exception:  # interpreter shutdown: the block is simply freed
            pass


class ScratchPool:
    """Recycled memory for the value buffers `samples_to_batch` builds.

    A producer converts batch after batch, and each batch's memory is released soon after (once its
    ingest is acked). Memory fresh from the OS costs a page fault and a zeroed page on first touch,
    and the allocator hands freed blocks back to the OS within milliseconds; measured on a 2-core
    box, that cost more than the copy itself. Here a block that every batch using it has released
    is handed to the next conversion, already mapped. A block is reused only once nothing refers to
    it any more (its `_Lease` is gone), so a batch the caller keeps is never overwritten. At most
    `max_bytes` of released blocks are kept; the rest are freed. Thread-safe (a lease may be
    released from any thread, and from a garbage collection inside `buffer` itself: hence an RLock).
    """

    def __init__(self, max_bytes: int = 128 << 20, min_bytes: int = 1 << 20):
        self.max_bytes = max_bytes  # twice the default ingest window (64 MB)
        self.min_bytes = min_bytes  # smaller requests get exact-size memory, outside the pool
        self._free: list[pa.Buffer] = []
        self._free_bytes = 0
        self._lock = threading.RLock()
        self.reused = self.allocated = 0

    def buffer(self, nbytes: int) -> tuple[memoryview, pa.Buffer]:
        """(writable view, Arrow buffer) of the same `nbytes`, 64-byte aligned, in a pooled block.
        Fill it through the view before handing the buffer to anyone."""
        if nbytes < self.min_bytes:  # small conversions (a server-side msgpack ingest, tests): exact
            block = pa.allocate_buffer(nbytes)  # size, never pooled, so a kept batch pins no more
            return memoryview(block).cast("B"), block
        block = None
        with self._lock:
            for i, b in enumerate(self._free):
                if nbytes <= b.size <= 2 * nbytes + (1 << 20):  # no small batch pins a large block
                    block = self._free.pop(i)
                    self._free_bytes -= block.size
                    self.reused += 1
                    break
        if block is None:
            # Arrow's allocator (64-byte aligned); rounded up so that batches of slightly different
            # sizes can reuse each other's blocks
            block = pa.allocate_buffer(nbytes + (-nbytes % (1 << 16)))
            self.allocated += 1
        view = memoryview(block).cast("B")[:nbytes]  # Arrow exports signed chars; bytes are unsigned
        return view, pa.foreign_buffer(block.address, nbytes, base=_Lease(block, self))

    def _give_back(self, block: pa.Buffer) -> None:
        with self._lock:
            if self._free_bytes + block.size <= self.max_bytes:
                self._free.append(block)
                self._free_bytes += block.size

    def clear(self) -> None:
        """Free every released block now."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
