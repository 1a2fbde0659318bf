"""Buffer sub-config (`buffer:` section of a run config)."""

from __future__ import annotations

from typing import Literal

import msgspec


class BufferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bind: str = "tcp://127.0.0.1:0"  # ZeroMQ address; port 0 picks a free port. Loopback unless you mean it.
    dir: str = ""  # durable segment directory; empty = <run dir>/buffer
    durable: bool = True  # fsync each ingest to Arrow IPC segments before acking
    capacity_samples: int = 4096  # above this, ingest is not acked (back-pressure) until there is room
    policy: Literal["fifo", "staleness_fifo", "uniform"] = "staleness_fifo"
    max_times_sampled: int = 1  # uniform policy only: a sample is retired after this many uses
    segment_max_mb: int = 64  # roll to a new segment file after this size
    max_message_mb: int = 256  # larger ZeroMQ frames are rejected with a reason
    # heap a buffer process faults in at start, so that ingest lands in mapped pages (buffer/memory.py);
    # the process keeps its high-water mark of memory from then on. 0: malloc settings only.
    reserve_mb: int = 256
