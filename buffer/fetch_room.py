"""The buffer server's fetch waiting room: fetches that cannot be answered yet wait here, and are
retried whenever data arrives or the version changes (buffer/server.py drives it from its loop).

Exactly-once delivery. A client resends a fetch, with the same request id, until it has its reply (its
server may have died and been restarted with the fetch lost, or with the reply lost after the rows were
logged as served). The pair (consumer, req) names the fetch:
  - a resend of a fetch still waiting updates its return address (and renews its lease);
  - a resend of the consumer's last *answered* fetch gets the same reply again (the same rows: the
    consumption log names the fetch each "served" record answered, and a restarted server rebuilds
    these replies from it and the segments, buffer/storage.py `recovered_replies`);
  - a fetch with a new request id acknowledges the consumer's previous reply (the client sends it only
    once it has that reply), which is then forgotten; a late resend of an acknowledged fetch is dropped.
So rows logged as served reach the trainer even when the server dies between the log's fsync and the
send, and no fetch ever gets rows another fetch received. A consumer waits on one fetch at a time: a
newer fetch supersedes its older one (a restarted trainer's), which is dropped unanswered.

Leases: a fetch that carries `lease_s` > 0 (buffer.client sends its resend period times a margin) is
dropped unanswered, consuming nothing, when no resend renewed it for lease_s: its requester is gone (a
trainer killed while its fetch waited), and serving it would hand groups to nobody.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import zmq

from buffer import wire
from buffer.frames import batches_to_frames
from buffer.storage import Buffer

_SERVED_MEMORY = 8192  # recent (consumer, req) acknowledged, to drop their late resends
_REPLIES_MEMORY = 1024  # consumers whose last reply is kept to answer a resend with (bounds the memory)
# a reply is sent again at most this often: the resends a client queued while its server was down arrive
# together after the restart, and one copy of a large batch answers them all
_REPLAY_GAP_S = 0.5

# TEST HOOK, for tests/test_buffer_exactly_once.py and bench/buffer_exactly_once.py only: with this set to
# N, the server process SIGKILLs itself right after the N-th fetch it serves with rows has been logged
# and fsynced as served, before the reply is sent (the window in which a crash used to lose the rows).
TEST_HOOK_KILL_AFTER_SERVED = "SLIPSTREAM_BUFFER_TEST_HOOK_KILL_AFTER_SERVED"


@dataclass
class _PendingFetch:
    envelope: list
    msg: wire.Fetch
    deadline: float
    started: float
    renewed: float  # when it (or a resend of it) last arrived: its lease runs from here


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
        # consumer -> (req, reply frames) of its last answered fetch, until a newer fetch acknowledges it
        self._replies: collections.OrderedDict[str, list] = collections.OrderedDict()  # [req, frames, sent]
        self.replayed = 0  # resends answered with their fetch's reply again
        self.leases_expired = 0  # fetches dropped unanswered because their requester stopped resending
        self._lease_check = float("inf")  # no lease ends before this (renewals only push ends later)
        for consumer, req in buffer.recovered_answered:
            self._served[(consumer, req)] = None
        for consumer, (req, pieces, groups) in buffer.recovered_replies.items():
            self._replies[consumer] = [req, fetch_reply_frames(req, pieces or None, groups), 0.0]
        self._kill_after = int(os.environ.get(TEST_HOOK_KILL_AFTER_SERVED, "0") or 0)

    def __len__(self) -> int:
        return len(self.waiting)

    def deadline(self, default: float) -> float:
        """The earliest deadline (or lease end) of a waiting fetch (`default` when none waits)."""
        return min([_expiry(f) for f in self.waiting], default=default)

    def add(self, env: list, msg: wire.Fetch, sock: zmq.Socket | None = None) -> None:
        """Admit a fetch (or a resend of one) to wait until `serve` answers it; a resend of the
        consumer's last answered fetch is answered again at once (on `sock`)."""
        if msg.num_groups < 1 or msg.max_staleness < 0 or not msg.timeout_s >= 0:
            raise wire.ProtocolError(
                "fetch needs num_groups >= 1, max_staleness >= 0 and timeout_s >= 0", "invalid_fields"
            )
        key = (msg.consumer, msg.req)
        last = self._replies.get(msg.consumer)
        if last is not None and last[0] == msg.req:  # its reply was lost (or crossed this resend)
            now = time.monotonic()
            if now - last[2] >= _REPLAY_GAP_S:
                self.replayed += 1
                last[2] = now
                self._replies.move_to_end(msg.consumer)
                self._send(sock, env, last[1])
            return
        if key in self._served:
            return
        if key in self._by_key:
            f = self._by_key[key]
            f.envelope, f.renewed = env, time.monotonic()
            return
        if last is not None:  # a new request id: the client has the previous reply
            self._acknowledge(msg.consumer)
        # a consumer waits on one fetch at a time: an older one still waiting belongs to a requester that
        # gave up on it or died (a restarted trainer), and serving it would consume groups nobody trains
        if self.drop(msg.consumer):
            self.superseded += 1
        now = time.monotonic()
        self._by_key[key] = f = _PendingFetch(env, msg, now + min(msg.timeout_s, 86400.0), now, now)
        if msg.lease_s > 0:
            self._lease_check = min(self._lease_check, now + msg.lease_s)
        self._consumer_fetch[msg.consumer] = key
        self.waiting.append(f)

    def drop(self, consumer: str) -> bool:
        """Forget `consumer`'s waiting fetch, unanswered (its requester is gone); True if there was one."""
        old = self._by_key.pop(self._consumer_fetch.pop(consumer, None), None)
        if old is not None:
            self.waiting.remove(old)
        return old is not None

    def _acknowledge(self, consumer: str) -> None:
        req = self._replies.pop(consumer)[0]
        self._served[(consumer, req)] = None
        if len(self._served) > _SERVED_MEMORY:
            self._served.popitem(last=False)

    def _expire_leases(self, now: float) -> None:
        if now < self._lease_check:  # one comparison per loop iteration, not a pass over the waiting
            return
        ends = [
            f.renewed + f.msg.lease_s
            for f in self.waiting
            if f.msg.lease_s > 0 and now < f.renewed + f.msg.lease_s
        ]
        self._lease_check = min(ends, default=float("inf"))
        for f in list(self.waiting):
            if f.msg.lease_s > 0 and now >= f.renewed + f.msg.lease_s:
                self.leases_expired += 1
                key = (f.msg.consumer, f.msg.req)
                self.waiting.remove(f)
                self._by_key.pop(key, None)
                if self._consumer_fetch.get(f.msg.consumer) == key:
                    del self._consumer_fetch[f.msg.consumer]

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
        self._expire_leases(now)  # before anything is served: a requester that is gone gets nothing
        if not self.waiting:
            return False
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
            res = self.buffer.fetch(
                f.msg.num_groups, f.msg.version, f.msg.max_staleness, consumer=f.msg.consumer, req=f.msg.req
            )
            ready = self.buffer.ready_groups()
            freed |= res.pieces is not None or res.evicted > 0
            if res.pieces is None and now < f.deadline:
                continue
            self.waiting.remove(f)
            key = (f.msg.consumer, f.msg.req)
            self._by_key.pop(key, None)
            if self._consumer_fetch.get(f.msg.consumer) == key:
                del self._consumer_fetch[f.msg.consumer]
            reason = ""
            if res.pieces is None:
                reason = (
                    f"timeout: {self.buffer.ready_groups()} complete groups ready, {f.msg.num_groups} asked"
                )
            frames = fetch_reply_frames(
                f.msg.req, res.pieces, res.num_groups, res.evicted, now - f.started, reason
            )
            # kept until the consumer's next fetch acknowledges it: a resend is answered with it again
            self._replies.pop(f.msg.consumer, None)
            self._replies[f.msg.consumer] = [f.msg.req, frames, time.monotonic()]
            while len(self._replies) > _REPLIES_MEMORY:
                self._acknowledge(next(iter(self._replies)))
            if res.pieces is not None and self._kill_after > 0:
                self._kill_after -= 1
                if self._kill_after == 0:  # TEST HOOK (see TEST_HOOK_KILL_AFTER_SERVED)
                    os.kill(os.getpid(), signal.SIGKILL)
            self._send(sock, f.envelope, frames)
        return freed


def _expiry(f: _PendingFetch) -> float:
    """When a waiting fetch must be looked at: its deadline, or its lease's end if sooner."""
    return min(f.deadline, f.renewed + f.msg.lease_s) if f.msg.lease_s > 0 else f.deadline
