"""Durable storage on disk: Arrow IPC segment files and the consumption log.

A buffer directory holds
  seg-000001.arrow, seg-000002.arrow, ...  Arrow IPC *stream* files (readable with
      `pyarrow.ipc.open_stream`), schema `buffer.record.ARROW_SCHEMA`, one record batch per accepted
      ingest. Each batch carries custom metadata `crc32` = a checksum of its logical content, so a torn
      or bit-flipped tail is detected on restart instead of being served.
  consumed.log  append-only records `[u32 length][u32 crc32][msgpack {op, v, uids}]`: which uids were
      served to the trainer (op "served", at trainer version v, with the (consumer, req) of the fetch it
      answered), evicted as too stale ("evicted"), and
      version announcements ("version").

Invariants: a segment batch is fsynced before its producer is acked (the writer thread fsyncs, the
server acks once the batch's ticket is durable); a "served" record is fsynced
before the batch leaves the buffer. So after any crash, everything acked is in a segment and
everything handed out is in the log. A new process never appends to an old segment: it starts the
next file, which keeps recovery of the old ones simple (their tail is torn at most once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa

from buffer.record import ARROW_SCHEMA, is_legacy_schema, upgrade_batch

SEGMENT_GLOB = "seg-*.arrow"
LOG_NAME = "consumed.log"
_LOG_HEAD = struct.Struct("<II")
_MAX_LOG_RECORD = 1 << 30  # a length above this can only be corruption


def segment_name(index: int) -> str:
    return f"seg-{index:06d}.arrow"


def _load_fast_crc32():
    """libdeflate's crc32 (the same CRC-32 as zlib's, computed with carry-less multiplication:
    measured 14 GB/s against zlib's 4 GB/s on this project's 2-core box), or None where the system
    has no libdeflate. Both give identical values, so segments are the same either way."""
    for name in ("libdeflate.so.0", ctypes.util.find_library("deflate")):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_fast_crc32 = _load_fast_crc32()


def _load_sync_file_range():
    """Linux's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE): start writing a range of a
    file back to disk without waiting for it (None elsewhere)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def crc32(data: pa.Buffer | np.ndarray | bytes, crc: int = 0) -> int:
    """zlib.crc32(data, crc), faster where libdeflate is installed (see `_load_fast_crc32`)."""
    if _fast_crc32 is None:
        return zlib.crc32(data, crc)
    if isinstance(data, pa.Buffer):  # libdeflate returns 0 for a null pointer whatever crc is
        return _fast_crc32(crc, data.address, data.size) if data.size else crc
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return _fast_crc32(crc, arr.ctypes.data, arr.nbytes) if arr.nbytes else crc


def _crc_array(arr: pa.Array, crc: int) -> int:
    """Fold an array's *logical* content into crc: independent of slicing and buffer padding, so the
    digest computed before writing equals the one computed after reading back."""
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_string(t):
        bufs = arr.buffers()
        offs = np.frombuffer(bufs[1], dtype="<i4", count=len(arr) + 1 + arr.offset)[arr.offset :]
        crc = crc32((offs - offs[0]).astype("<i4"), crc)
        if pa.types.is_string(t):
            return crc32(bufs[2].slice(int(offs[0]), int(offs[-1] - offs[0])), crc)
        child = arr.values
        width = child.type.byte_width
        lo, hi = (child.offset + int(offs[0])) * width, (child.offset + int(offs[-1])) * width
        values = child.buffers()[1]
        if hi == lo:  # only empty lists: a sender may leave the values buffer out altogether
            return crc
        return crc32(values.slice(lo, hi - lo), crc)
    width = t.byte_width
    return crc32(arr.buffers()[1].slice(arr.offset * width, len(arr) * width), crc)


def batch_crc(batch: pa.RecordBatch) -> int:
    crc = crc32(struct.pack("<q", batch.num_rows))
    for col in batch.columns:
        crc = _crc_array(col, crc)
    return crc


# -- segments ----------------------------------------------------------------------------------------
class SegmentWriter:
    """Appends record batches to numbered segment files from a writer thread.

    `append` checksums the batch and queues it, returning its ticket (1, 2, ...); the thread writes
    every queued batch and makes them durable with ONE fsync (group commit), then advances `durable`
    (every ticket <= it is on disk) and calls `on_durable()`. So the caller keeps receiving and
    validating while the disk works, and the checksums of the next batches are computed while the
    thread waits for fsync (measured: checksumming in the thread serialized it with the fsync and made
    the thread the bottleneck). Checksum, write and fsync release the GIL. `sync()` waits
    for everything queued. If a write fails, `error` is set, `durable` stops advancing and every later
    call raises it: nothing after the failure is ever reported durable.
    """

    def __init__(self, directory: Path, first_index: int, max_bytes: int):
        self.dir = directory
        self.index = first_index
        self.max_bytes = max_bytes
        self._sink: pa.OSFile | None = None
        self._writer = None
        self.bytes_written = 0
        self.fsyncs = 0  # group commits so far (each makes every batch queued before it durable)
        self.on_durable = None  # called from the writer thread after each fsync (keep it short)
        self.error: BaseException | None = None
        self.appended = 0  # highest ticket handed out
        self.durable = 0  # highest ticket fsynced
        self._queue: list[tuple[int, pa.RecordBatch, dict]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="segment-writer", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        path = self.dir / segment_name(self.index)
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, ARROW_SCHEMA)
        # The new file's directory entry must be durable too, or an fsynced segment can vanish.
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, batch: pa.RecordBatch) -> int:
        """Queue one batch for writing; returns its ticket (durable once `durable >= ticket`)."""
        meta = {"crc32": str(batch_crc(batch))}
        with self._cond:
            self._raise_if_failed()
            self.appended += 1
            self._queue.append((self.appended, batch, meta))
            self._cond.notify_all()
            return self.appended

    def sync(self) -> None:
        """Wait until everything appended so far is durable."""
        with self._cond:
            want = self.appended
            while self.durable < want and self.error is None:
                self._cond.wait()
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise OSError(f"segment writer in {self.dir} failed, nothing is acked since: {self.error}")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                todo, self._queue = self._queue, []
            try:
                for _, batch, meta in todo:
                    self._write(batch, meta)
                self._sink.flush()
                os.fsync(self._sink.fileno())
                self.fsyncs += 1
            except BaseException as e:  # surfaced to every caller from now on
                with self._cond:
                    self.error = e
                    self._cond.notify_all()
                if self.on_durable is not None:
                    self.on_durable()
                return
            with self._cond:
                self.durable = todo[-1][0]
                self._cond.notify_all()
            if self.on_durable is not None:
                self.on_durable()

    def _write(self, batch: pa.RecordBatch, meta: dict) -> None:
        if self._sink is not None and self._sink.tell() >= self.max_bytes:
            self._sink.flush()
            os.fsync(self._sink.fileno())  # the finished file is durable before the next one starts
            self._sink.close()
            self._sink = self._writer = None
            self.index += 1
        if self._sink is None:
            self._open()
        before = self._sink.tell()
        self._writer.write_batch(batch, custom_metadata=meta)
        after = self._sink.tell()
        self.bytes_written += after - before
        if _sync_file_range is not None:
            # start the disk on this batch now, while later ones are still being written: the group's
            # fsync then waits only for what is left (the data is durable only after that fsync)
            # whole pages only: the last, partly written one is rewritten by the next batch
            lo, hi = before - before % _PAGE, after - after % _PAGE
            if hi > lo:
                self._sink.flush()
                _sync_file_range(self._sink.fileno(), lo, hi - lo, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> None:
        """Write and fsync what is queued, stop the thread, close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._sink is not None:
            # No end-of-stream marker: readers treat EOF at a message boundary as the end, and a
            # segment therefore looks the same whether it was closed cleanly or not.
            self._sink.close()
            self._sink = self._writer = None


@dataclass
class SegmentReport:
    """What recovery found in one segment file."""

    name: str
    batches: int = 0
    rows: int = 0
    intact_bytes: int = 0
    torn_bytes: int = 0  # bytes after the last intact batch (0 for a clean file)
    problem: str = ""  # why reading stopped early ("" = clean)


@dataclass
class Recovered:
    batches: list[tuple[str, pa.RecordBatch]] = field(default_factory=list)
    reports: list[SegmentReport] = field(default_factory=list)
    next_index: int = 1


def read_segment(path: Path) -> tuple[list[pa.RecordBatch], SegmentReport]:
    """Read the intact prefix of one segment (memory-mapped, zero-copy) and report any torn tail."""
    rep = SegmentReport(path.name)
    size = path.stat().st_size
    out: list[pa.RecordBatch] = []
    if size == 0:
        rep.problem = "empty file (crashed right after creating it)"
        return out, rep
    src = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(src)
        legacy = not reader.schema.equals(ARROW_SCHEMA)
        if legacy and not is_legacy_schema(reader.schema):
            raise ValueError("schema differs from buffer.record.ARROW_SCHEMA (and from every older one)")
        rep.intact_bytes = src.tell()
        while True:
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            want = (meta or {}).get(b"crc32")
            if want is None or int(want) != batch_crc(batch):
                raise ValueError(f"checksum mismatch in batch {rep.batches}")
            batch.validate(full=True)
            out.append(upgrade_batch(batch) if legacy else batch)
            rep.batches += 1
            rep.rows += batch.num_rows
            rep.intact_bytes = src.tell()
    except (pa.ArrowException, ValueError, IndexError, OSError) as e:  # IndexError: offsets out of range
        rep.problem = str(e).splitlines()[0][:200] or type(e).__name__
    rep.torn_bytes = size - rep.intact_bytes
    if rep.torn_bytes and not rep.problem:
        rep.problem = "trailing bytes after the last batch"
    return out, rep


def recover_segments(directory: Path) -> Recovered:
    """Read every segment in order. A torn tail is cut off (moved aside as *.torn) so that later
    restarts see a clean file; what was intact is kept and what was cut is reported."""
    rec = Recovered()
    paths = sorted(directory.glob(SEGMENT_GLOB))
    for path in paths:
        batches, rep = read_segment(path)
        rec.batches.extend((path.name, b) for b in batches)
        rec.reports.append(rep)
        if rep.intact_bytes == 0 and not batches and not rep.torn_bytes:  # empty: nothing to keep
            path.unlink()
            rep.problem += "; removed"
        elif rep.torn_bytes:
            data = path.read_bytes()[rep.intact_bytes :]
            (directory / f"{path.name}.{rep.intact_bytes}.torn").write_bytes(data)
            if rep.intact_bytes == 0 or not batches:
                path.unlink()
            else:
                os.truncate(path, rep.intact_bytes)
    if paths:
        rec.next_index = int(paths[-1].stem.split("-")[1]) + 1
    return rec


# -- consumption log ------------------------------------------------------------------------------------
class LogRecord(msgspec.Struct, array_like=True):
    op: str  # "served" | "evicted" | "version"
    v: int  # trainer version at the time
    uids: list[str] = []  # "served": in the order the reply carried them
    consumer: str = ""  # "served": the fetch it answered, (consumer, request id), so that a resend of
    req: int = 0  # that fetch after a crash gets these rows again (older logs have neither: "", 0)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LogRecord)


class ConsumptionLog:
    """Append-only, checksummed record of what left the buffer (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self.records, good, self.torn_bytes = self._read(path)
        if self.torn_bytes:
            os.truncate(path, good)  # later appends must follow the last intact record
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the buffer
        self._dirty = False

    @staticmethod
    def _read(path: Path) -> tuple[list[LogRecord], int, int]:
        if not path.exists():
            return [], 0, 0
        data = path.read_bytes()
        out, pos = [], 0
        while pos + _LOG_HEAD.size <= len(data):
            n, crc = _LOG_HEAD.unpack_from(data, pos)
            body = data[pos + _LOG_HEAD.size : pos + _LOG_HEAD.size + n]
            if n > _MAX_LOG_RECORD or len(body) < n or zlib.crc32(body) != crc:
                break
            try:
                out.append(_dec.decode(body))
            except msgspec.DecodeError:
                break
            pos += _LOG_HEAD.size + n
        return out, pos, len(data) - pos

    def append(self, op: str, version: int, uids: list[str], consumer: str = "", req: int = 0) -> None:
        body = _enc.encode(LogRecord(op, version, uids, consumer, req))
        self._f.write(_LOG_HEAD.pack(len(body), zlib.crc32(body)) + body)
        self._dirty = True

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._f.fileno())
            self._dirty = False

    def close(self) -> None:
        self.sync()
        self._f.close()


def iter_log(directory: Path) -> Iterator[LogRecord]:
    """Read-only view of a directory's consumption log (for inspection)."""
    yield from ConsumptionLog._read(directory / LOG_NAME)[0]
