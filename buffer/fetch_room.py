"""The buffer server's fetch waiting room: fetches that cannot be answered yet wait here, and are
retried whenever data arrives or the version changes (buffer/server.py drives it from its loop).

A client resends a fetch until it has its reply (its server may have died and been restarted with the
fetch lost): a resend updates the waiting fetch's return address, and one that crosses its reply is
dropped, so a fetch is served at most once by a server. A consumer waits on one fetch at a time: a newer
fetch supersedes its older one (a restarted trainer's), which is dropped unanswered.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import zmq

from buffer import wire
from buffer.frames import batches_to_frames
from buffer.storage import Buffer

_SERVED_MEMORY = 8192  # recent (consumer, req) already answered, to drop resends that cross the reply


@dataclass
class _PendingFetch:
    envelope: list
    msg: wire.Fetch
    deadline: float
    started: float


def fetch_reply_frames(
    req: int,
    pieces: list[pa.RecordBatch] | None,
    num_groups: int = 0,
    evicted: int = 0,
    waited: float = 0.0,
    reason: str = "",
) -> list:
    """A FetchReply with `pieces` (record batches, e.g. zero-copy slices of stored ones) as buffer frames:
    nothing is concatenated or serialized here; the client combines them if it needs one batch."""
    layout, frames = batches_to_frames(pieces) if pieces else ([], [])
    head = wire.encode(
        wire.FetchReply(
            req=req,
            num_groups=num_groups,
            num_samples=sum(b.num_rows for b in pieces) if pieces else 0,
            evicted_stale=evicted,
            waited_s=waited,
            reason=reason,
            layout=layout,
        )
    )
    return [head, *frames]


class FetchRoom:
    """The waiting fetches of one server; `send(sock, envelope, frames)` replies to a client."""

    def __init__(self, buffer: Buffer, send: Callable[[zmq.Socket, list, list], None]):
        self.buffer = buffer
        self._send = send
        self.waiting: list[_PendingFetch] = []
        self._by_key: dict[tuple[str, int], _PendingFetch] = {}
        self._consumer_fetch: dict[str, tuple[str, int]] = {}  # consumer -> its waiting fetch's key
        self.superseded = 0
        self._drop_requests: list[str] = []  # consumers whose waiting fetch to drop (request_drop)
        self._served: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.waiting)

    def deadline(self, default: float) -> float:
        """The earliest deadline of a waiting fetch (`default` when none waits)."""
        return min([f.deadline for f in self.waiting], default=default)

    def add(self, env: list, msg: wire.Fetch) -> None:
        """Admit a fetch (or a resend of one) to wait until `serve` answers it."""
        if msg.num_groups < 1 or msg.max_staleness < 0 or not msg.timeout_s >= 0:
            raise wire.ProtocolError(
                "fetch needs num_groups >= 1, max_staleness >= 0 and timeout_s >= 0", "invalid_fields"
            )
        key = (msg.consumer, msg.req)
        if key in self._served:
            return
        if key in self._by_key:
            self._by_key[key].envelope = env
            return
        # a consumer waits on one fetch at a time: an older one still waiting belongs to a requester that
        # gave up on it or died (a restarted trainer), and serving it would consume groups nobody trains
        if self.drop(msg.consumer):
            self.superseded += 1
        now = time.monotonic()
        self._by_key[key] = f = _PendingFetch(env, msg, now + min(msg.timeout_s, 86400.0), now)
        self._consumer_fetch[msg.consumer] = key
        self.waiting.append(f)

    def drop(self, consumer: str) -> bool:
        """Forget `consumer`'s waiting fetch, unanswered (its requester is gone); True if there was one."""
        old = self._by_key.pop(self._consumer_fetch.pop(consumer, None), None)
        if old is not None:
            self.waiting.remove(old)
        return old is not None

    def request_drop(self, consumer: str) -> None:
        """Thread-safe: `drop(consumer)` at the server loop's next `apply_drops`."""
        self._drop_requests.append(consumer)

    def apply_drops(self) -> None:
        while self._drop_requests:  # request_drop() from another thread
            self.drop(self._drop_requests.pop())

    def serve(self, sock: zmq.Socket, only_expired: bool = False) -> bool:
        """Answer every waiting fetch that can be served or has expired; True if room was freed (groups
        taken or stale ones evicted), so parked ingests may fit now."""
        now = time.monotonic()
        freed = False
        newest = max(self.waiting, key=lambda f: f.msg.version)  # one eviction pass, not one per fetch
        if self.buffer.policy.enforces_staleness and newest.msg.version >= self.buffer.version:
            freed = self.buffer.evict_stale(newest.msg.version, newest.msg.max_staleness) > 0
        ready = self.buffer.ready_groups()
        for f in list(self.waiting):
            if only_expired and now < f.deadline:
                continue
            # a fetch that cannot be served yet costs a comparison, not a pass over the buffer: 10,000
            # waiting fetches used to make every loop iteration (and so every ingest ack) slow
            if f.msg.num_groups > ready and now < f.deadline:
                continue
            res = self.buffer.fetch(f.msg.num_groups, f.msg.version, f.msg.max_staleness)
            ready = self.buffer.ready_groups()
            freed |= res.pieces is not None or res.evicted > 0
            if res.pieces is None and now < f.deadline:
                continue
            self.waiting.remove(f)
            key = (f.msg.consumer, f.msg.req)
            self._by_key.pop(key, None)
            if self._consumer_fetch.get(f.msg.consumer) == key:
                del self._consumer_fetch[f.msg.consumer]
            self._served[key] = None
            if len(self._served) > _SERVED_MEMORY:
                self._served.popitem(last=False)
            reason = ""
            if res.pieces is None:
                reason = (
                    f"timeout: {self.buffer.ready_groups()} complete groups ready, {f.msg.num_groups} asked"
                )
            frames = fetch_reply_frames(
                f.msg.req, res.pieces, res.num_groups, res.evicted, now - f.started, reason
            )
            self._send(sock, f.envelope, frames)
        return freed
