"""The buffer's ZeroMQ server: one ROUTER socket, one loop thread, one `Buffer` (plus its segment
writer thread).

Each loop iteration drains every message already queued (up to a bound) and commits the ingests: the
segment writer thread checksums, writes and fsyncs them in the background, one fsync for whatever
has queued up meanwhile (group commit), and wakes the loop through a pipe; an ingest's ack is sent
only once its write ticket is durable. So the loop keeps receiving and validating while the disk
works, and a producer keeping a window of unacked messages in flight keeps both busy. Fetches that
cannot be answered yet wait in the `FetchRoom` (buffer/fetch_room.py) and are retried whenever data
arrives or the version changes; their deadlines bound the poll timeout, so a waiting trainer never
blocks other clients. Ingests that do not fit (`capacity_samples`) are parked unacked in `_parked`
until a fetch or an eviction makes room: the producer's resends of a parked message are recognized by
(producer, seq) and not parked twice.

Anything malformed becomes an `Error(reason)` reply and a count in stats()["rejects"]; the loop
catches every exception per message, so no input can stop the server.

With `curve` (the run's `CurveKeys`, buffer/curve.py) the socket speaks CURVE and accepts only the
run's client key; a refused peer never gets a message through or a reply back, and is counted in
stats()["auth_refused"].
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa
import zmq

from buffer import wire
from buffer.config import BufferConfig
from buffer.curve import CurveGuard, CurveKeys, secure_server
from buffer.fetch_room import FetchRoom, fetch_reply_frames
from buffer.frames import frames_to_batches
from buffer.record import samples_to_batch
from buffer.storage import Buffer, Plan
from buffer.validate import check_batch, read_ipc_batch
from buffer.warm_up import warm_up

BIND_RETRY_S = 5.0  # how long a bind waits out "address in use" (bind_retrying)

log = logging.getLogger("buffer.server")

_DRAIN_MAX = 256  # messages handled per iteration before acking (bounds ack latency)
_ACK_MEMORY = 8192  # recent (producer, seq) -> ack, to answer resends with the original ack


@dataclass
class _ParkedIngest:
    envelope: list
    msg: wire.Ingest | wire.IngestBatch
    batch: pa.RecordBatch


class BufferServer:
    """Serve a `Buffer` over ZeroMQ.

    In a background thread:  srv = BufferServer(cfg, "runs/x/buffer").start(); srv.address; srv.stop()
    In the foreground:       BufferServer(cfg, dir).serve_forever()   (returns after stop())
    """

    def __init__(
        self,
        cfg: BufferConfig | None = None,
        directory: str | Path | None = None,
        *,
        bind: str | None = None,
        buffer: Buffer | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ):
        self.cfg = cfg or BufferConfig()
        self.bind_address = bind or self.cfg.bind
        directory = directory if directory is not None else (self.cfg.dir or None)
        self.buffer = buffer if buffer is not None else Buffer(self.cfg, directory)
        self.max_bytes = self.cfg.max_message_mb << 20
        self._ctx = context or zmq.Context.instance()
        self.curve = curve
        self._guard: CurveGuard | None = None  # counts refused CURVE handshakes while serving
        self._address: str | None = None
        self._bound = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.rejects: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self._fetches = FetchRoom(self.buffer, self._send)
        self._parked: list[_ParkedIngest] = []
        self._parked_keys: set[tuple[str, int]] = set()
        self._acks: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        # committed ingests waiting for their segment write: (ticket, key, envelope, ack), in order
        self._unacked: collections.deque[tuple[int, tuple[str, int] | None, list, bytes]] = (
            collections.deque()
        )
        self._pending_keys: set[tuple[str, int]] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The bound endpoint (with the real port when bind used port 0)."""
        if self._address is None:
            raise RuntimeError("BufferServer is not bound yet; call start() (or serve_forever()) first")
        return self._address

    def start(self, timeout_s: float = 30.0) -> BufferServer:
        self._thread = threading.Thread(target=self._run_thread, name="buffer-server", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout_s):
            raise TimeoutError(f"buffer server did not bind {self.bind_address} within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError(
                f"buffer server failed to start on {self.bind_address} (buffer.bind / --bind): {self._error}; "
                "pick a free port, or port 0 for any"
            )
        return self

    def _run_thread(self) -> None:
        try:
            self.serve_forever()
        except BaseException as e:  # surfaced by start()/stop()
            started = self._bound.is_set()
            self._error = e
            self._bound.set()
            if started:  # a failure to start is start()'s one-line error, not a traceback here
                log.exception("buffer server stopped with an error")

    def request_stop(self) -> None:
        """Ask the loop to end (safe from a signal handler); `stop()` also waits for it."""
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the background thread to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"buffer server thread did not stop within {timeout_s}s")
            self._thread = None

    def __enter__(self) -> BufferServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def serve_forever(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Frames far beyond the limit are dropped by ZeroMQ itself (the peer is disconnected), so a
        # rogue peer cannot make us allocate gigabytes; moderately oversized ones get an Error reply.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_bytes + (1 << 20))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.setsockopt(zmq.SNDHWM, 10000)
        # The segment writer thread wakes the loop through this pipe when a write became durable.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def wake() -> None:
            try:
                os.write(wake_w, b"\0")
            except OSError:  # pipe full (the loop has wake-ups pending anyway) or closed at shutdown
                pass

        self.buffer.on_durable(wake)
        guard = None
        try:
            if self.curve is not None:  # before bind: the first peer already meets CURVE
                guard = self._guard = secure_server(sock, self.curve)
            try:
                warm_up()
            except Exception:  # only a speed-up: a real ingest reports whatever this hit
                log.warning("ingest warm-up failed; serving anyway", exc_info=True)
            bind_retrying(sock, self.bind_address)
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound.set()
            self._loop(sock, wake_r)
        finally:
            sock.close(0)
            if guard is not None:
                guard.close()
            self.buffer.on_durable(None)
            self.buffer.close()
            os.close(wake_r)
            os.close(wake_w)

    # -- loop ----------------------------------------------------------------------------------------
    def _loop(self, sock: zmq.Socket, wake_r: int) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            wait = self._fetches.deadline(default=now + 0.1) - now
            changed = True  # an idle tick re-checks waiting fetches (versions, evictions)
            events = dict(poller.poll(max(0.0, min(wait, 0.1)) * 1000))
            if wake_r in events:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            if sock in events:
                changed = self._drain(sock)
            elif events:
                changed = False
            if self._unacked:
                self._send_durable_acks(sock)
            self._fetches.apply_drops()  # drop_fetches() from another thread
            if self._fetches and self._fetches.serve(sock, only_expired=not changed) and self._parked:
                self._unpark(sock)

    def _send_durable_acks(self, sock) -> None:
        """Send the acks whose segment writes are fsynced; fail them all if the writer failed."""
        durable = self.buffer.durable_ticket
        while self._unacked and self._unacked[0][0] <= durable:
            _, key, env, ack = self._unacked.popleft()
            self._pending_keys.discard(key)
            self._send(sock, env, [ack])
        err = self.buffer.write_error
        if err is not None and self._unacked:
            log.error(
                "segment write failed, %d ingests are answered with an error: %s", len(self._unacked), err
            )
            while self._unacked:
                _, key, env, ack = self._unacked.popleft()
                self._pending_keys.discard(key)
                self._acks.pop(key, None)
                req = wire.decode(ack).req
                reason = f"the buffer could not make this ingest durable (segment write failed: {err})"
                self._send(sock, env, [wire.encode(wire.Error(req=req, reason=reason))])

    def _drain(self, sock: zmq.Socket) -> bool:
        """Handle the queued messages; True if the data or the version changed."""
        changed = False
        for _ in range(_DRAIN_MAX):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.counters["messages"] += 1
            try:
                changed |= self._handle(sock, frames)
            except wire.ProtocolError as e:
                self._reject(sock, frames, str(e), e.category)
            except Exception as e:  # a bug, not the peer's fault: report it and keep serving
                log.exception("error handling a message")
                self._reject(sock, frames, f"internal error: {type(e).__name__}: {e}", "internal")
        return changed

    def _split(self, frames: list) -> tuple[list, list]:
        """[identity, (b"" if REQ), header, payload...] -> (envelope, body)."""
        if len(frames) > 2 and len(frames[1]) == 0:
            return [frames[0].bytes, b""], frames[2:]
        return [frames[0].bytes], frames[1:]

    def _handle(self, sock: zmq.Socket, frames: list) -> bool:
        env, body = self._split(frames)
        if not body:
            raise wire.ProtocolError("empty message (no header frame)", "frame_count")
        total = sum(len(f) for f in body)
        if total > self.max_bytes:
            raise wire.ProtocolError(
                f"message of {total} bytes exceeds max_message_mb={self.cfg.max_message_mb}; send "
                "smaller batches or raise buffer.max_message_mb",
                "oversized",
            )
        msg = wire.decode(body[0].buffer, self.max_bytes)
        if isinstance(msg, wire.IngestBatch) and msg.layout:
            if len(body) < 2:
                raise wire.ProtocolError("ingest_batch with a layout has no buffer frames", "frame_count")
        else:
            want = 2 if isinstance(msg, wire.IngestBatch) else 1
            if len(body) != want:
                raise wire.ProtocolError(
                    f"{type(msg).__name__} takes {want} frame(s) after the envelope, got {len(body)}",
                    "frame_count",
                )
        if isinstance(msg, wire.Ingest | wire.IngestBatch):
            return self._ingest(sock, env, msg, body)
        if isinstance(msg, wire.Fetch):
            self._fetches.add(env, msg, sock)
            return True
        if isinstance(msg, wire.SetVersion):
            self.buffer.set_version(msg.version)
            self.buffer.sync_log()
            self._send(sock, env, [wire.encode(wire.Ok(req=msg.req))])
            return True
        if isinstance(msg, wire.StatsRequest):
            self._send(sock, env, [wire.encode(wire.StatsReply(req=msg.req, stats=self.stats()))])
            return False
        if isinstance(msg, wire.Peek):
            batch = self.buffer.peek(max(0, msg.limit))
            self._send(sock, env, fetch_reply_frames(msg.req, None if batch is None else [batch]))
            return False
        raise wire.ProtocolError(
            f"{type(msg).__name__} is a reply kind; the buffer only accepts requests", "unexpected_kind"
        )

    # -- ingest --------------------------------------------------------------------------------------
    def _ingest(self, sock, env, msg, body) -> bool:
        key = (msg.producer, msg.seq)
        if key in self._pending_keys:  # a resend of one still being written: its ack will come
            self.counters["resends_while_writing"] += 1
            return False
        if key in self._acks:  # a resend whose ack got lost: answer with the original ack
            self.counters["resends_answered"] += 1
            self._send(sock, env, [self._acks[key]])
            return False
        if key in self._parked_keys:
            self.counters["resends_while_parked"] += 1
            return False
        if isinstance(msg, wire.IngestBatch):
            batch = self._read_batch(msg, body[1:])
            if batch.num_rows != msg.num_samples:
                raise wire.ProtocolError(
                    f"ingest_batch says num_samples={msg.num_samples} but the batch has {batch.num_rows} rows",
                    "invalid_arrow",
                )
            check_batch(batch)
        else:
            batch = samples_to_batch(msg.samples)
        if batch.num_rows > self.cfg.capacity_samples:
            raise wire.ProtocolError(
                f"ingest of {batch.num_rows} samples can never fit capacity_samples="
                f"{self.cfg.capacity_samples}; send smaller batches or raise buffer.capacity_samples",
                "too_large_for_capacity",
            )
        if self._parked:  # keep arrival order: nobody overtakes a parked message
            self._park(env, msg, batch)
            return False
        return self._try_commit(env, msg, batch)

    @staticmethod
    def _read_batch(msg: wire.IngestBatch, payload: list) -> pa.RecordBatch:
        if not msg.layout:
            return read_ipc_batch(payload[0].buffer)
        batches = frames_to_batches(msg.layout, payload)
        if len(batches) != 1:
            raise wire.ProtocolError(
                f"ingest_batch layout describes {len(batches)} record batches; expected exactly 1",
                "invalid_arrow",
            )
        return batches[0]

    def _try_commit(self, env, msg, batch: pa.RecordBatch) -> bool:
        plan: Plan = self.buffer.plan(batch, checked=True)
        if not self.buffer.has_room(plan.n_new):
            self._park(env, msg, batch)
            return False
        ticket = self.buffer.commit(plan)
        ack = wire.encode(plan.ack(seq=msg.seq, trainer_version=self.buffer.version, req=msg.req))
        key = (msg.producer, msg.seq)
        self._acks[key] = ack
        while len(self._acks) > _ACK_MEMORY:
            self._acks.popitem(last=False)
        self._pending_keys.add(key)
        self._unacked.append((ticket, key, env, ack))
        return plan.n_new > 0

    def _park(self, env, msg, batch) -> None:
        self.counters["backpressure_parked"] += 1
        self._parked.append(_ParkedIngest(env, msg, batch))
        self._parked_keys.add((msg.producer, msg.seq))

    def _unpark(self, sock) -> None:
        while self._parked:
            p = self._parked[0]
            before = len(self._parked)
            self._parked.pop(0)
            self._parked_keys.discard((p.msg.producer, p.msg.seq))
            self._try_commit(p.envelope, p.msg, p.batch)
            if len(self._parked) == before:  # it was parked again: still no room
                self._parked.insert(0, self._parked.pop())
                break
        self._send_durable_acks(sock)

    def drop_fetches(self, consumer: str) -> None:
        """Thread-safe: the consumer died (a trainer being restarted), so its waiting fetch must not take
        groups nobody will train; done by the server loop within ~0.1 s."""
        self._fetches.request_drop(consumer)

    # -- replies -------------------------------------------------------------------------------------
    def _send(self, sock, env: list, frames: list) -> None:
        try:
            sock.send_multipart(env + frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer is gone or not reading; it will resend if it cares
            self.counters["replies_dropped"] += 1

    def _reject(self, sock, frames, reason: str, category: str) -> None:
        self.rejects[category] += 1
        try:
            env, body = self._split(frames)
            req = 0
            try:  # echo the request id if there is a sane one, so the client can match the error
                got = msgspec.msgpack.decode(body[0].bytes).get("req", 0) if body else 0
                req = got if type(got) is int and 0 <= got < 2**63 else 0
            except Exception:
                req = 0
            self._send(sock, env, [wire.encode(wire.Error(req=req, reason=reason[:2000]))])
        except Exception:  # the reply itself failed; the reject is counted either way
            log.exception("could not send an error reply")

    def stats(self) -> dict:
        s = self.buffer.stats()
        s["rejects"] = dict(self.rejects)
        s["rejected_messages"] = sum(self.rejects.values())
        s["pending_fetches"] = len(self._fetches)
        s["superseded_fetches"] = self._fetches.superseded
        s["replayed_fetches"] = self._fetches.replayed  # resends answered with their first reply again
        s["expired_fetch_leases"] = self._fetches.leases_expired
        s["parked_ingests"] = len(self._parked)
        s["unacked_ingests"] = len(self._unacked)  # committed, waiting for their segment fsync
        s["address"] = self._address
        s["curve"] = self.curve is not None
        s["auth_refused"] = self._guard.refused if self._guard is not None else 0
        s.update(self.counters)
        return s


def bind_retrying(sock: zmq.Socket, address: str, wait_s: float = BIND_RETRY_S) -> None:
    """Bind, retrying "address in use" for up to `wait_s`: a buffer restarted on its old address (a heal,
    a test) may bind while ZeroMQ's I/O thread is still closing the old socket's listener, which
    `close()` only queues. Any other error, or one that lasts, is raised."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
