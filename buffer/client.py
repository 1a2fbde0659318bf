"""`BufferClient`: the ZeroMQ client of the buffer, for generators (SampleSink) and trainers (BatchSource).

One DEALER socket. Ingest is pipelined: `submit` sends a batch and returns at once while up to
`window` messages and `window_mb` of payload are unacked; every unacked message is resent after `resend_s` (the server drops
duplicates by uid and answers a resend with the original ack), so a restart of the buffer costs
nothing but a resend. `put` = submit + wait for that ack. Each request carries a request id that the
reply echoes, so a late reply to an abandoned request is never taken for the answer to a new one.

Fetches are delivered exactly once: a fetch is resent with the same request id until its reply comes
(the server answers a resend of a fetch it already served with the same rows, also after a restart:
buffer/fetch_room.py), and the client moves to a new request id only once it has the reply, which is
what tells the server the reply arrived. A fetch that gave up (BufferUnavailable) keeps its request id
for the next fetch, so rows served to it while it was not listening are not lost. Waiting fetches carry
a lease that the resends renew: a trainer that died while its fetch waited consumes nothing.
A client is thread-safe: its public calls are serialised on one lock.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import zmq

from buffer import wire
from buffer.curve import CurveKeys, secure_client
from buffer.frames import batches_to_frames, frames_to_batches
from buffer.record import Sample, samples_to_batch
from buffer.transport import BatchSource, BufferUnavailable, SampleSink


def _locked(method):
    """Run a public client call under the client's lock (see BufferClient._lock)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return call


@dataclass
class _InFlight:
    frames: list
    sent_at: float
    nbytes: int = 0
    resends: int = 0


def _reply_batches(reply: wire.FetchReply, frames: list) -> list[pa.RecordBatch]:
    """The record batches of a FetchReply (buffer frames, zero-copy; or one IPC stream)."""
    if reply.layout:
        return frames_to_batches(reply.layout, frames[1:])
    return [pa.ipc.open_stream(pa.py_buffer(frames[1].buffer)).read_next_batch()]


class BufferClient(SampleSink, BatchSource):
    """Client of a `BufferServer` at `address` (e.g. "tcp://127.0.0.1:5555").

    producer: stable id of this producer (dedup of resends is by uid; this names it in logs/acks).
    window: unacked ingest messages allowed in flight before `submit` waits.
    window_mb: unacked payload allowed in flight before `submit` waits (one message always goes).
        Bytes in flight, not messages, are what keep a link with latency busy: at the default, 4 MB
        messages keep 16 in flight, which hides the ack round trip (segment fsync included).
    resend_s: resend an unacked ingest after this long.
    timeout_s: default for how long any call waits before raising BufferUnavailable.
    max_batch_samples: `put` splits larger lists into messages of this many samples.
    curve: the run's `CurveKeys`, for a buffer that requires CURVE (buffer/curve.py); without them
        such a buffer refuses the connection and every call times out.
    """

    def __init__(
        self,
        address: str,
        *,
        producer: str | None = None,
        window: int = 32,
        window_mb: float = 64.0,
        resend_s: float = 2.0,
        timeout_s: float = 60.0,
        max_batch_samples: int = 1024,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ):
        if window < 1 or window_mb <= 0:
            raise ValueError(
                f"window={window}, window_mb={window_mb}: no message could be sent; use window >= 1 and "
                "window_mb > 0"
            )
        self.address = address
        self.producer = producer or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.window, self.resend_s, self.timeout_s = window, resend_s, timeout_s
        self.window_bytes = int(window_mb * 2**20)
        self.max_batch_samples = max_batch_samples
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        self._curve = curve is not None
        if curve is not None:
            secure_client(self._sock, curve)
        self._sock.connect(address)
        self._seq = itertools.count(1)
        # request ids start at a random point: the server remembers served fetches by (consumer, id),
        # and a restarted trainer's client must not reuse its predecessor's ids
        self._req = itertools.count(random.randrange(1 << 32))
        self._inflight: dict[int, _InFlight] = {}
        self._acks: dict[int, wire.IngestAck] = {}  # acked but not yet collected by put()
        self._errors: dict[int, str] = {}
        # A ZeroMQ socket must never be touched by two threads at once (that corrupts libzmq's heap);
        # generators call put() from several asyncio worker threads, so every public call holds this.
        self._lock = threading.RLock()
        self.trainer_version = 0  # from the latest ack
        # the request id of a fetch that has no reply yet (it gave up): the next fetch repeats it
        self._fetch_req: int | None = None
        self.last_fetch: wire.FetchReply | None = None

    # -- ingest (SampleSink) -----------------------------------------------------------------------
    @_locked
    def submit(self, samples: list[Sample] | pa.RecordBatch, timeout_s: float | None = None) -> int:
        """Send one ingest message without waiting for its ack (waits only while the window is full).
        Returns its seq; `wait(seq)` or `flush()` collect acks."""
        batch = samples if isinstance(samples, pa.RecordBatch) else samples_to_batch(samples)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        # The batch's buffers go out as frames straight from its memory (no serialization copy); they
        # stay referenced by _inflight until acked, for resends.
        layout, payload = batches_to_frames([batch])
        nbytes = sum(len(f) for f in payload)
        while self._inflight and (
            len(self._inflight) >= self.window
            or sum(f.nbytes for f in self._inflight.values()) + nbytes > self.window_bytes
        ):
            self._pump(
                deadline,
                f"a free slot in the window of {self.window} unacked messages / {self.window_bytes >> 20} MB",
                waited=timeout_s,
            )
        seq = next(self._seq)
        head = wire.encode(
            wire.IngestBatch(
                req=seq, producer=self.producer, seq=seq, num_samples=batch.num_rows, layout=layout
            )
        )
        frames = [head, *payload]
        self._inflight[seq] = _InFlight(frames, time.monotonic(), nbytes)
        self._send(frames)
        return seq

    @_locked
    def wait(self, seq: int, timeout_s: float | None = None) -> wire.IngestAck:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while seq not in self._acks and seq not in self._errors:
            self._pump(deadline, f"the ack of ingest seq {seq}", waited=timeout_s)
        if seq in self._errors:
            raise wire.ProtocolError(
                f"buffer at {self.address} rejected ingest seq {seq}: {self._errors.pop(seq)}"
            )
        return self._acks.pop(seq)

    @_locked
    def collect(self) -> list[wire.IngestAck]:
        """Acks received so far and not yet collected (non-blocking; errors raise as in `wait`)."""
        return [self.wait(s, 0) for s in sorted(set(self._acks) | set(self._errors))]

    @_locked
    def flush(self, timeout_s: float | None = None) -> list[wire.IngestAck]:
        """Wait until every submitted message is acked; returns the acks not yet collected."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while self._inflight:
            self._pump(
                deadline, f"the acks of {len(self._inflight)} unacked ingest messages", waited=timeout_s
            )
        return self.collect()

    @_locked
    def put(self, samples: list[Sample] | pa.RecordBatch, timeout_s: float | None = None) -> wire.IngestAck:
        """Send samples (split into messages of max_batch_samples, pipelined) and return once all are
        acked, i.e. durable in the buffer. The returned ack sums the counts of the messages."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        batch = samples if isinstance(samples, pa.RecordBatch) else samples_to_batch(samples)
        step = max(1, self.max_batch_samples)
        seqs = [self.submit(batch.slice(i, step), timeout_s) for i in range(0, max(batch.num_rows, 1), step)]
        acks = [self.wait(s, timeout_s) for s in seqs]
        return wire.IngestAck(
            seq=seqs[-1],
            accepted=sum(a.accepted for a in acks),
            duplicates=sum(a.duplicates for a in acks),
            rejected=sum(a.rejected for a in acks),
            trainer_version=acks[-1].trainer_version,
            errors=[e for a in acks for e in a.errors],
        )

    # -- trainer side (BatchSource) ------------------------------------------------------------------
    @_locked
    def fetch(
        self,
        num_groups: int,
        version: int,
        max_staleness: int,
        timeout_s: float = 60.0,
        *,
        grace_s: float = 10.0,
    ) -> pa.RecordBatch | None:
        """Complete groups as one record batch, or None if the buffer had fewer within timeout_s.
        Raises BufferUnavailable if the server does not answer within timeout_s + grace_s.
        (`fetch_table` returns the same rows without combining them into one batch: no copy.)"""
        table = self.fetch_table(num_groups, version, max_staleness, timeout_s, grace_s=grace_s)
        if table is None:
            return None
        batches = table.to_batches()
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)

    @_locked
    def fetch_table(
        self,
        num_groups: int,
        version: int,
        max_staleness: int,
        timeout_s: float = 60.0,
        *,
        grace_s: float = 10.0,
    ) -> pa.Table | None:
        """Like `fetch`, as a Table whose chunks are the received record batches, zero-copy over the
        reply's frames (stages/trainer/packing.to_token_batch accepts a Table as it is)."""
        if self._fetch_req is None:
            self._fetch_req = next(self._req) + (1 << 40)
        reply, frames = self._request(
            wire.Fetch(
                consumer=self.producer,
                num_groups=num_groups,
                version=version,
                max_staleness=max_staleness,
                timeout_s=timeout_s,
                lease_s=self.fetch_lease_s,
            ),
            timeout_s + grace_s,
            # resent until answered: a server that died and came back on its directory lost the fetch,
            # or its reply; it answers a resend of a fetch it served with the same rows
            resend=True,
            req=self._fetch_req,
        )
        self._fetch_req = None  # we have the reply: the next fetch's new id acknowledges it
        self.last_fetch = reply
        if reply.num_samples == 0:
            return None
        return pa.Table.from_batches(_reply_batches(reply, frames))

    @_locked
    def set_version(self, version: int) -> None:
        self._request(wire.SetVersion(version=version), self.timeout_s)

    @_locked
    def stats(self) -> dict:
        return self._request(wire.StatsRequest(), self.timeout_s)[0].stats

    @_locked
    def peek(self, limit: int = 100) -> pa.RecordBatch | None:
        """Up to `limit` live samples, without consuming them (for inspection)."""
        reply, frames = self._request(wire.Peek(limit=limit), self.timeout_s)
        if not reply.num_samples:
            return None
        batches = _reply_batches(reply, frames)
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)

    @_locked
    def close(self) -> None:
        self._sock.close(0)

    # -- plumbing ------------------------------------------------------------------------------------
    def _send(self, frames: list) -> bool:
        try:
            self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected yet / queue full: the resend timer retries
            return False

    def _unavailable(self, what: str, waited: float) -> BufferUnavailable:
        # A CURVE refusal looks like silence from here (the handshake fails, no reply ever comes), so
        # the hint names it as one possible cause.
        keys = (
            "that this client holds this run's CURVE keys (the buffer refuses and counts others: "
            "auth_refused in its stats)"
            if self._curve
            else "that it does not require CURVE keys (a multi-node run's buffer does; a client started "
            "outside the run cannot connect)"
        )
        return BufferUnavailable(
            f"buffer at {self.address} did not send {what} within {waited:.1f}s; check that the buffer "
            f"server is running and reachable there (python -m buffer serve --bind {self.address}), "
            f"whether it is full (back-pressure holds acks until the trainer fetches: see its stats), and "
            f"{keys}"
        )

    def _pump(
        self, deadline: float, what: str, until: float | None = None, waited: float = 0.0
    ) -> list | None:
        """Wait for one reply until `until` (default: deadline), resending overdue ingests. Acks and
        ingest errors are filed; any other reply is returned as [msg, frames]. Raises
        BufferUnavailable once `deadline` has passed."""
        now = time.monotonic()
        if now >= deadline:
            raise self._unavailable(what, waited or self.timeout_s)
        until = deadline if until is None else min(until, deadline)
        next_resend = min((f.sent_at + self.resend_s for f in self._inflight.values()), default=until)
        if self._sock.poll(max(0.0, min(until, next_resend) - now) * 1000, zmq.POLLIN):
            frames = self._sock.recv_multipart(copy=False)
            try:
                msg = wire.decode(frames[0].buffer)
            except wire.ProtocolError:
                return None  # not from a slipstream buffer; ignore
            if isinstance(msg, wire.IngestAck):
                if self._inflight.pop(msg.seq, None) is not None:
                    self._acks[msg.seq] = msg
                    self.trainer_version = msg.trainer_version
                return None
            if isinstance(msg, wire.Error) and msg.req in self._inflight:
                del self._inflight[msg.req]
                self._errors[msg.req] = msg.reason
                return None
            return [msg, frames]
        now = time.monotonic()
        for f in self._inflight.values():
            if now - f.sent_at >= self.resend_s:
                f.sent_at, f.resends = now, f.resends + 1
                self._send(f.frames)
        return None

    @property
    def fetch_lease_s(self) -> float:
        """The lease a waiting fetch of this client holds in the server: its resends (every resend_s)
        renew it, so only a client that stopped resending (it died) loses it."""
        return max(5.0 * self.resend_s, 2.0)

    def _request(self, msg: wire.Msg, timeout_s: float, resend: bool = True, req: int | None = None):
        """Send a request and wait for the reply carrying its request id (resending if idempotent)."""
        # disjoint from ingest seqs, which use req = seq
        msg.req = next(self._req) + (1 << 40) if req is None else req
        kind = msg.__struct_config__.tag
        head = [wire.encode(msg)]
        start = time.monotonic()
        deadline = start + timeout_s
        wait_s = getattr(msg, "timeout_s", None)  # a fetch's own wait in the server
        next_send = 0.0
        while True:
            if time.monotonic() >= next_send:
                if wait_s is not None and next_send:  # a resend waits only what is left of it (a
                    # restarted server would otherwise hold it past this client's deadline)
                    msg.timeout_s = max(0.0, wait_s - (time.monotonic() - start))
                    head = [wire.encode(msg)]
                self._send(head)
                next_send = time.monotonic() + (self.resend_s if resend else float("inf"))
            got = self._pump(deadline, f"a reply to {kind}", until=next_send, waited=timeout_s)
            if got is None:
                continue
            reply, frames = got
            if reply.req != msg.req:
                continue  # a late reply to an abandoned request
            if isinstance(reply, wire.Error):
                if req is not None and self._fetch_req == req:
                    self._fetch_req = None  # refused: answered, nothing was served
                raise wire.ProtocolError(f"buffer at {self.address} rejected {kind}: {reply.reason}")
            return reply, frames
