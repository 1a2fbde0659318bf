"""Resident memory for ingest: messages land in pages that are already mapped.

ZeroMQ allocates every received message with malloc in its I/O thread, and the buffer keeps those
bytes (they are the Arrow columns it serves). With glibc's defaults each multi-MB message is a fresh
mmap, or heap that free() trimmed back to the kernel earlier, so every page of it faults and is zeroed
on first touch: on the 2-core box that was a third of the ingest time (bench/RESULTS.md, "Buffer").
A buffer server therefore
  - keeps everything in one malloc arena (`arena_max=1`: the I/O thread and the loop share it),
  - serves messages up to 32 MB from the heap instead of mmap (`mmap_threshold`),
  - does not hand freed heap back to the kernel (`trim_threshold`; up to 2 GiB of free heap at its
    top are kept): what the trainer consumed is reused for the next ingest, and the process keeps its
    high-water mark of memory, like a database's pool,
  - and faults `reserve_mb` of heap in at start (`reserve`), so even the first ingests skip the faults.
The settings apply to the whole process, so only buffer processes make them: `python -m buffer serve`
and the pipeline's buffer actor (`BUFFER_GLIBC_TUNABLES` in its environment, so every thread of it
uses them from its start). On a libc that is not glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger(__name__)

_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value
_TRIM_THRESHOLD = (1 << 62) - 1
_PIECE = 8 << 20  # reserve in pieces below the mmap threshold, so they come from (and return to) the heap

# For a process started for the buffer: the same settings from its first malloc on, in every thread.
BUFFER_GLIBC_TUNABLES = (
    f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={_MMAP_THRESHOLD}"
    f":glibc.malloc.trim_threshold={_TRIM_THRESHOLD}"
)


# set beside GLIBC_TUNABLES: a process that has it was started with the settings (glibc may rewrite
# GLIBC_TUNABLES in the environment it hands over, so its value is no proof)
MARKER = "SLIPSTREAM_BUFFER_MALLOC"


def buffer_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the buffer's malloc settings added to GLIBC_TUNABLES."""
    env = dict(os.environ if env is None else env)
    have = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{have}:{BUFFER_GLIBC_TUNABLES}" if have else BUFFER_GLIBC_TUNABLES
    env[MARKER] = "1"
    return env


def is_glibc() -> bool:
    return _libc() is not None


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if not hasattr(libc, "gnu_get_libc_version"):  # mallopt's parameters below are glibc's
            return None
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def reserve(mb: int) -> dict:
    """Apply the malloc settings to this process and fault `mb` MiB of heap in (0: settings only).
    Call it before the buffer's ZeroMQ socket exists (its I/O thread then shares the arena). Returns
    what was done, for the server's stats; an empty dict where the libc is not glibc."""
    libc = _libc()
    if libc is None:
        log.debug("buffer memory: not glibc, malloc settings left alone")
        return {}
    t0 = time.perf_counter()
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    for param, value in (
        (M_ARENA_MAX, 1),
        (M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, 2**31 - 1),  # an int parameter: the largest it takes (2 GiB of slack)
    ):
        if libc.mallopt(param, value) != 1:
            log.warning(
                "buffer memory: mallopt(%d, %d) was refused; ingest may page-fault more", param, value
            )
    pieces = []
    try:
        for _ in range(max(0, mb) * (1 << 20) // _PIECE):
            p = libc.malloc(_PIECE)
            if not p:
                break
            ctypes.memset(p, 0, _PIECE)  # fault the pages in now
            pieces.append(p)
    finally:
        for p in pieces:
            libc.free(p)  # back to the heap, which keeps them (trim threshold)
    got = len(pieces) * _PIECE >> 20
    return {"reserved_mb": got, "reserve_s": round(time.perf_counter() - t0, 3)}
