"""Arrow record batches as ZeroMQ frames, without serializing them (the buffer's fast wire form).

An Arrow IPC stream costs a copy of every byte on the sender (into one contiguous message) and, for a
reply made of several stored batches, a concatenation before that. Here every large Arrow buffer
(a token column's values, for instance) travels as its own ZeroMQ frame straight from the memory
that holds it (`copy=False`), and the receiver builds arrays over the received frames, zero-copy.

Layout of a message after its header (`IngestBatch.layout` / `FetchReply.layout` describe it):
  frame 0     every buffer smaller than INLINE_MAX, concatenated, each at an 8-byte aligned offset
  frame 1...  every other buffer, in order: one frame each, or several consecutive ones in one frame,
              each at the first 64-byte aligned offset after the previous one, the last ending the
              frame (the sender does that when they already lie so in one allocation, as the token
              columns of `samples_to_batch` do: one frame then costs both ends less than five)
`layout` holds one list per record batch: [num_rows, size of buffer 0, size of buffer 1, ...] over
the buffers of ARROW_SCHEMA's columns in schema order (`_SLOTS`: validity, offsets, data / values;
a list column adds its child's validity and values). Size -1 is an absent buffer (no validity bitmap
when there are no nulls). Arrays always start at offset 0: the sender rebases sliced columns (a
slice's offsets are rewritten, its values are a zero-copy window).

Nothing received is trusted: sizes and frame counts are checked here, and `pa.Array.from_buffers`
plus `buffer.validate.check_batch` (full validation) check the arrays before anything reads them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from buffer.record import ARROW_SCHEMA
from buffer.wire import ProtocolError

INLINE_MAX = 64 * 1024  # smaller buffers share frame 0 (a ZeroMQ frame costs ~µs; copying 64 KB is cheaper)
_ALIGN = 8
_LARGE_ALIGN = 64  # where a large buffer starts in a frame that holds several


def _kind(t: pa.DataType) -> str:
    if pa.types.is_string(t):
        return "string"
    if pa.types.is_list(t):
        return "list"
    return "fixed"


_KINDS = [_kind(f.type) for f in ARROW_SCHEMA]
_SLOTS = sum({"string": 3, "list": 4, "fixed": 2}[k] for k in _KINDS)  # buffers per batch


def _pad(n: int) -> int:
    return -n % _ALIGN


def _validity(arr: pa.Array) -> pa.Buffer | None:
    """The validity bitmap of an array with offset % 8 == 0 (others were materialized first)."""
    if arr.null_count == 0:
        return None
    bits = arr.buffers()[0]
    return bits.slice(arr.offset // 8, (len(arr) + 7) // 8)


def _fixed(arr: pa.Array) -> list:
    w = arr.type.byte_width
    return [_validity(arr), arr.buffers()[1].slice(arr.offset * w, len(arr) * w)]


def _array_buffers(arr: pa.Array, kind: str) -> list:
    """The buffers of `arr` as if it started at offset 0 (zero-copy except rebased offsets)."""
    if arr.null_count and arr.offset % 8:
        arr = pa.concat_arrays([arr])  # a bitmap not starting on a byte: materialize (invalid anyway)
    if len(arr) == 0:  # an empty array may have no buffers at all
        empty, zero = pa.py_buffer(b""), pa.py_buffer(np.zeros(1, "<i4"))
        return [None, empty] if kind == "fixed" else [None, zero, *([None] if kind == "list" else []), empty]
    if kind == "fixed":
        return _fixed(arr)
    offs = np.frombuffer(arr.buffers()[1], dtype="<i4", count=len(arr) + 1, offset=arr.offset * 4)
    lo, hi = int(offs[0]), int(offs[-1])
    offsets = (
        arr.buffers()[1].slice(arr.offset * 4, (len(arr) + 1) * 4) if lo == 0 else pa.py_buffer(offs - lo)
    )
    if kind == "string":
        return [_validity(arr), offsets, arr.buffers()[2].slice(lo, hi - lo)]
    return [_validity(arr), offsets, *_array_buffers(arr.values.slice(lo, hi - lo), "fixed")]


def batches_to_frames(batches: list[pa.RecordBatch]) -> tuple[list[list[int]], list]:
    """(layout, frames) for sending `batches` (ARROW_SCHEMA) with `send_multipart(copy=False)`."""
    layout: list[list[int]] = []
    small: list = []
    small_len = 0
    large: list = []
    for batch in batches:
        sizes = [batch.num_rows]
        for col, kind in zip(batch.columns, _KINDS):
            for buf in _array_buffers(col, kind):
                if buf is None:
                    sizes.append(-1)
                    continue
                sizes.append(buf.size)
                if buf.size >= INLINE_MAX:
                    large.append(buf)
                else:
                    small.append(buf)
                    small_len += buf.size
                    if _pad(small_len):
                        small.append(b"\0" * _pad(small_len))
                        small_len += _pad(small_len)
        layout.append(sizes)
    return layout, [b"".join(small), *_coalesce(large)]


def _coalesce(large: list[pa.Buffer]) -> list:
    """The large buffers as frames: a run of buffers that already lie in one allocation the way a
    shared frame holds them (each at the first 64-byte aligned offset after the previous one) goes
    as one frame over that memory; any other buffer as its own frame."""
    frames: list = []
    run: list[pa.Buffer] = []

    def flush() -> None:
        if len(run) == 1:
            frames.append(memoryview(run[0]))
        elif run:
            start = run[0].address
            span = run[-1].address + run[-1].size - start
            frames.append(memoryview(pa.foreign_buffer(start, span, base=tuple(run))))
        run.clear()

    parent = None
    for buf in large:
        p = _root(buf)
        if run and p is not None and parent is not None and (p.address, p.size) == parent:
            start, end = run[0].address, run[-1].address + run[-1].size
            if buf.address == start + _up(end - start, _LARGE_ALIGN):
                run.append(buf)
                continue
        flush()
        run.append(buf)
        parent = None if p is None else (p.address, p.size)
    flush()
    return frames


def _root(buf: pa.Buffer) -> pa.Buffer | None:
    """The allocation a (slice of a slice of a) buffer lies in; None if it is not a slice."""
    root = buf.parent
    while root is not None and root.parent is not None:
        root = root.parent
    return root


def _up(n: int, align: int) -> int:
    return n + (-n % align)


def _bad(reason: str) -> ProtocolError:
    return ProtocolError(f"Arrow frames do not match their layout: {reason}", "invalid_arrow")


def _aligned(frame) -> pa.Buffer:
    buf = pa.py_buffer(frame.buffer if hasattr(frame, "buffer") else frame)
    return buf if buf.address % _ALIGN == 0 else pa.py_buffer(buf.to_pybytes())


def frames_to_batches(layout: list[list[int]], frames: list) -> list[pa.RecordBatch]:
    """Rebuild the record batches of `batches_to_frames` from received frames (zero-copy for the large
    buffers). Raises ProtocolError (invalid_arrow) when frames and layout disagree."""
    if not frames:
        raise _bad("no frames")
    f0 = frames[0]
    # A large frame 0 is its own allocation: used in place. A small one may sit in a buffer that
    # ZeroMQ shares between several received messages, which a stored batch must not pin: copied.
    small = _aligned(f0) if len(f0) >= INLINE_MAX else pa.py_buffer(bytes(getattr(f0, "buffer", f0)))
    large = frames[1:]
    pos = li = 0
    lpos = 0  # where the next large buffer may start in large[li]
    cur: pa.Buffer | None = None
    out = []
    for sizes in layout:
        if len(sizes) != _SLOTS + 1 or sizes[0] < 0:
            raise _bad(f"a batch entry has {len(sizes)} numbers, expected {_SLOTS + 1}")
        bufs: list[pa.Buffer | None] = []
        for s in sizes[1:]:
            if s < -1:
                raise _bad(f"buffer size {s}")
            if s == -1:
                bufs.append(None)
            elif s < INLINE_MAX:
                if pos + s > small.size:
                    raise _bad("frame 0 is shorter than its buffers")
                bufs.append(small.slice(pos, s))
                pos += s + _pad(s)
            else:
                if li >= len(large):
                    raise _bad(f"frame {li + 1} missing (a buffer of {s} bytes)")
                if cur is None:
                    cur = _aligned(large[li])
                start = _up(lpos, _LARGE_ALIGN)
                if start + s > cur.size:
                    raise _bad(f"frame {li + 1} is not {s} bytes (or does not end with them)")
                bufs.append(cur if start == 0 and s == cur.size else cur.slice(start, s))
                lpos = start + s
                if lpos == cur.size:
                    li, lpos, cur = li + 1, 0, None
        out.append(_build(sizes[0], bufs))
    if lpos:
        raise _bad(f"frame {li + 1} has {cur.size - lpos} bytes after its buffers")
    if li != len(large) or pos < small.size:
        raise _bad(f"{len(large) - li} extra frames, {max(0, small.size - pos)} extra bytes in frame 0")
    return out


def _build(rows: int, bufs: list) -> pa.RecordBatch:
    cols = []
    it = iter(bufs)
    try:
        for field, kind in zip(ARROW_SCHEMA, _KINDS):
            t = field.type
            nulls = lambda b: 0 if b is None else -1  # noqa: E731 - -1: count from the bitmap
            if kind == "fixed":
                v, d = next(it), next(it)
                cols.append(pa.Array.from_buffers(t, rows, [v, d], nulls(v)))
            elif kind == "string":
                v, o, d = next(it), next(it), next(it)
                cols.append(pa.Array.from_buffers(t, rows, [v, o, d], nulls(v)))
            else:
                v, o, cv, cd = next(it), next(it), next(it), next(it)
                ct = t.value_type
                n = 0 if cd is None else cd.size // ct.byte_width
                child = pa.Array.from_buffers(ct, n, [cv, cd], nulls(cv))
                cols.append(pa.Array.from_buffers(t, rows, [v, o], nulls(v), children=[child]))
        return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise _bad(str(e).splitlines()[0][:200]) from None


def ipc_bytes(batch: pa.RecordBatch) -> pa.Buffer:
    """One record batch as an Arrow IPC stream (the FetchReply payload)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()
