"""CPU weight transport over ZeroMQ: trainer -> built-in torch engines.

Topology: the trainer BINDS a ROUTER socket (`weights.bind`, port 0 = free port; read
`ZmqWeightSender.address`); each engine process runs a `WeightReceiver(address, engine)` that CONNECTS
a DEALER socket and announces itself with a `hello`. A push sends every registered engine the
snapshot as buckets, each one multipart message: [msgpack header, raw tensor bytes...]; the header
names version, bucket index, whether it is the last, and names/dtypes/shapes. The receiver applies
the complete update with `engine.update_weights(named_tensors, version)` and acks. An engine that
connects after a push gets the latest snapshot at once, so late joiners never run stale weights.

All socket work happens on one I/O thread per side (ZeroMQ sockets are not thread-safe).

With `curve` (the run's `CurveKeys`, buffer/curve.py) on both sides the sender accepts only
receivers holding the run's client key: a refused receiver's hello never arrives, so it gets no
weights, and the sender counts it in stats()["auth_refused"].
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
import uuid

import msgspec
import torch
import zmq

from buffer.curve import CurveKeys, secure_client, secure_server
from stages.weights.base import PushHandle, WeightPushError, WeightSender
from stages.weights.buckets import buckets

log = logging.getLogger(__name__)
PROTO = 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def _tensor_frame(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    # bf16 has no numpy dtype: ship the same bytes as int16 (the header keeps the real dtype)
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return memoryview(raw.numpy()).cast("B")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class ZmqWeightSender(WeightSender):
    takes_adapters = True  # its torch engines apply LoRA adapters over their base (WeightReceiver)

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        bucket_mb: int = 64,
        timeout_s: float = 120.0,
        min_engines: int = 0,
        curve: CurveKeys | None = None,
    ):
        """`min_engines`: a push first waits (within timeout_s) until this many engines said hello.
        `curve`: the run's keys; receivers must then hold them too."""
        self.bucket_bytes = bucket_mb << 20
        self.timeout_s = timeout_s
        self.min_engines = min_engines
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # unlimited send queue: a snapshot is one burst of large frames and must never be dropped;
        # ROUTER_MANDATORY turns a send to a vanished engine into an error instead of a silent drop
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._guard = secure_server(self._sock, curve) if curve is not None else None
        try:
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self._sock.bind(bind)
                self.address = bind
        except zmq.ZMQError:
            if self._guard is not None:  # its threads would outlive a sender that never existed
                self._sock.close(0)
                self._guard.close()
            raise
        self._jobs: queue.Queue = queue.Queue()
        self.engines: dict[bytes, dict] = {}  # identity -> hello info
        self._latest: tuple[int, list] | None = None
        self._stop = threading.Event()
        self._queue_lock = threading.Lock()
        self._forget: set[str] = set()  # engine names to drop (dead peers), handed to the I/O thread
        self._thread = threading.Thread(target=self._run, name="weights-sender", daemon=True)
        self._thread.start()

    # -- trainer-facing -----------------------------------------------------------------------------
    def push(self, version: int, named_tensors) -> PushHandle:
        fut: cf.Future = cf.Future()
        with self._queue_lock:  # the I/O thread's final drain takes it too: no job slips in after it
            if self._stop.is_set():
                raise WeightPushError(
                    f"weight sender on {self.address} is closed; push of version {version} refused"
                )
            self._jobs.put((version, list(named_tensors), fut))
        # the I/O thread enforces timeout_s itself and names the missing engines; the handle's own
        # deadline is a little later so that more specific error is the one the trainer sees
        return PushHandle(version, fut, self.timeout_s + 2.0, f"torch engines via {self.address}")

    def expect_engines(self, count: int) -> None:
        """Later pushes wait (within timeout_s) until `count` engines said hello."""
        self.min_engines = count

    def forget(self, engine: str) -> None:
        """Stop waiting for `engine` (its process died without a bye): later pushes, and one in
        progress, no longer wait for its ack. A replacement says hello under its own name."""
        with self._queue_lock:
            self._forget.add(engine)

    def close(self) -> None:
        """Stop the I/O thread; a delivery in progress fails with WeightPushError("closed"). The
        socket belongs to that thread (ZeroMQ sockets are not thread-safe): it closes it on its way out."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.warning("weights sender thread still busy 10 s after close(); it closes its socket on exit")

    def stats(self) -> dict:
        """Registered engines, and CURVE handshakes refused (0 without curve)."""
        return {
            "address": self.address,
            "engines": len(self.engines),
            "curve": self._guard is not None,
            "auth_refused": self._guard.refused if self._guard is not None else 0,
        }

    # -- I/O thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._poll_once(50)
                try:
                    version, named, fut = self._jobs.get_nowait()
                except queue.Empty:
                    continue
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self._deliver(version, named))
                    except Exception as e:  # noqa: BLE001 - handed to the trainer through the future
                        fut.set_exception(e)
        except BaseException as e:
            log.error("weights sender I/O thread on %s failed: %s", self.address, e)
            raise
        finally:
            self._sock.close(0)
            if self._guard is not None:
                self._guard.close()
            with self._queue_lock:
                self._stop.set()  # from here on push() refuses instead of queueing for a dead thread
                while True:  # pushes queued behind a close never run: say so, don't leave them pending
                    try:
                        _, _, fut = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(WeightPushError(f"weight sender on {self.address} was closed"))

    def _check_open(self, version: int) -> None:
        if self._stop.is_set():
            raise WeightPushError(
                f"weight sender on {self.address} closed during the push of version {version}"
            )

    def _poll_once(self, ms: int) -> list[tuple[bytes, dict]]:
        """Handle hellos (and engines to forget); return acks seen."""
        acks = []
        if self._forget:
            with self._queue_lock:
                gone, self._forget = self._forget, set()
            for ident in [i for i, hello in self.engines.items() if hello.get("engine") in gone]:
                self.engines.pop(ident)
                acks.append((ident, {"kind": "bye"}))  # a push in progress stops waiting for it
        while self._sock.poll(ms):
            ms = 0
            ident, raw = self._sock.recv_multipart()[:2]
            try:
                msg = _dec.decode(raw)
            except msgspec.DecodeError:
                msg = None
            if not isinstance(msg, dict):  # garbage must not end the I/O thread
                log.warning("weights: undecodable message from %r dropped", ident)
                continue
            if msg.get("kind") == "hello":
                known = ident in self.engines
                self.engines[ident] = msg
                if known:  # receivers repeat their hello while idle (see WeightReceiver): nothing new
                    continue
                log.info("weights: engine %s registered (version %s)", msg.get("engine"), msg.get("version"))
                if self._latest is not None:  # late joiner: bring it up to date right away
                    try:
                        self._send_all(ident, *self._latest)
                    except WeightPushError as e:
                        log.warning("weights: %s before it got version %d", e, self._latest[0])
            elif msg.get("kind") == "ack":
                acks.append((ident, msg))
            elif msg.get("kind") == "bye":
                self.engines.pop(ident, None)
                acks.append((ident, {"kind": "bye"}))
        return acks

    def _send_all(self, ident: bytes, version: int, parts: list) -> None:
        try:
            for header, frames in parts:
                self._sock.send_multipart([ident, header, *frames], copy=False)
        except zmq.ZMQError as e:
            self.engines.pop(ident, None)
            raise WeightPushError(f"engine {ident!r} at {self.address} is gone ({e})") from e

    def _encode(self, version: int, named) -> list:
        parts = []
        groups = list(buckets(named, self.bucket_bytes)) or [[]]  # an empty update still carries the version
        for i, group in enumerate(groups):
            header = _enc.encode(
                {
                    "kind": "bucket",
                    "proto": PROTO,
                    "version": version,
                    "index": i,
                    "final": i == len(groups) - 1,
                    "names": [n for n, _ in group],
                    "dtypes": [_dtype_name(t.dtype) for _, t in group],
                    "shapes": [list(t.shape) for _, t in group],
                }
            )
            parts.append((header, [_tensor_frame(t) for _, t in group]))
        return parts

    def _deliver(self, version: int, named) -> dict:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        while len(self.engines) < self.min_engines:
            if time.monotonic() > deadline:
                raise WeightPushError(
                    f"only {len(self.engines)} of {self.min_engines} engines connected to {self.address} within "
                    f"{self.timeout_s:.0f}s; start the engines' WeightReceiver with this address"
                )
            self._check_open(version)
            self._poll_once(50)
        parts = self._encode(version, named)
        self._latest = (version, parts)
        waiting = set(self.engines)
        lost = 0
        for ident in list(waiting):
            try:
                self._send_all(ident, version, parts)
            except WeightPushError as e:  # its process died: the launcher restarts (or names) it, and
                # the new incarnation gets the latest snapshot when it says hello
                log.warning("weights: %s; version %d goes to the others", e, version)
                waiting.discard(ident)
                lost += 1
        nbytes = sum(f.nbytes for _, frames in parts for f in frames)
        while waiting:
            self._check_open(version)
            left = deadline - time.monotonic()
            if left <= 0:
                names = [self.engines.get(i, {}).get("engine", i) for i in waiting]
                raise WeightPushError(
                    f"engines {names} did not apply version {version} within {self.timeout_s:.0f}s"
                )
            for ident, ack in self._poll_once(int(min(left, 0.05) * 1000)):
                if ack.get("kind") == "bye":  # shut down cleanly: nothing left to update there
                    waiting.discard(ident)
                    continue
                if ack.get("version") != version:
                    continue
                if not ack.get("ok"):
                    raise WeightPushError(
                        f"engine {ack.get('engine')} failed to apply version {version}: {ack.get('error')}"
                    )
                waiting.discard(ident)
        return {
            "version": version,
            "engines": len(self.engines),
            "engines_lost": lost,
            "bytes": nbytes,
            "seconds": time.monotonic() - t0,
        }


class WeightReceiver:
    """Engine side: a thread that connects to the trainer's sender and applies complete updates."""

    def __init__(self, address: str, engine, name: str = "", *, curve: CurveKeys | None = None):
        """`curve`: the run's keys, for a sender that requires them (without, it never answers)."""
        self.address = address
        self.curve = curve
        self.engine = engine
        self.name = name or f"engine-{id(engine):x}"
        self.applied: list[int] = []  # versions applied, in order (for tests and logs)
        self._applied_one = threading.Event()  # set at the first applied push (wait_applied)
        self.hello_every_s = 2.0
        self.error: str = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-receiver-{self.name}", daemon=True)
        self._thread.start()

    def wait_applied(self, timeout_s: float) -> bool:
        """Block until this receiver has applied a push (any version), at most `timeout_s`; whether it has."""
        return self._applied_one.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # a fixed routing id keeps this engine's identity across reconnects (the sender knows it by it)
        sock.setsockopt(zmq.ROUTING_ID, f"{self.name}-{uuid.uuid4().hex[:8]}".encode())
        if self.curve is not None:
            secure_client(sock, self.curve)
        sock.connect(self.address)

        def hello() -> None:
            msg = {"kind": "hello", "proto": PROTO, "engine": self.name, "version": self.engine.version}
            try:
                sock.send(_enc.encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # not connected yet: the next hello goes out
                pass

        hello()
        pending: dict[str, torch.Tensor] = {}
        version = None
        heard = time.monotonic()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    # Say hello again while idle: a trainer restarted after a crash binds the same
                    # address with a fresh sender that knows no engines; the socket reconnects on its
                    # own, and this is how the new sender learns of us (a known engine's hello is a no-op)
                    if time.monotonic() - heard > self.hello_every_s:
                        hello()
                        heard = time.monotonic()
                    continue
                heard = time.monotonic()
                header, *frames = sock.recv_multipart(copy=False)
                msg = _dec.decode(header.bytes)
                if msg.get("kind") != "bucket" or msg.get("proto") != PROTO:
                    continue
                if msg["version"] != version:  # a newer push supersedes a partial older one
                    pending, version = {}, msg["version"]
                pending.update(self._decode(msg, frames))
                if msg["final"]:
                    sock.send(_enc.encode(self._apply(version, pending)))
                    pending, version = {}, None
        except Exception as e:  # noqa: BLE001 - a broken receiver must fail the push, not leave quietly
            self.error = f"weight receiver {self.name} failed: {type(e).__name__}: {e}"
            log.exception("weight receiver %s failed", self.name)
            sock.send(_enc.encode(self._ack(version, self.error)), zmq.NOBLOCK)
            sock.close(linger=500)
            return
        # a clean shutdown deregisters, so later pushes do not wait for this engine
        try:
            sock.send(_enc.encode({"kind": "bye", "proto": PROTO, "engine": self.name}), zmq.NOBLOCK)
        except zmq.Again:  # no connection to say it on (e.g. the sender refused our CURVE handshake)
            pass
        sock.close(linger=500)

    def _decode(self, msg: dict, frames) -> dict[str, torch.Tensor]:
        out = {}
        for name, dt, shape, frame in zip(msg["names"], msg["dtypes"], msg["shapes"], frames):
            dtype = getattr(torch, dt)
            buf = bytearray(frame.buffer)  # own the bytes: the frame is released after this message
            out[name] = (
                torch.frombuffer(buf, dtype=dtype).reshape(shape) if buf else torch.empty(shape, dtype=dtype)
            )
        return out

    def _announce_adapters(self, tensors: dict) -> None:
        """An adapter push (trainer.lora.push=adapter) names adapter tensors the engine's model has no
        room for yet: the torch engine builds it before it applies the update (torch_model.py). SGLang
        servers with LoRA serving load them as an adapter of their own (sglang_lora.py)."""
        from stages.rollout.engine import is_adapter
        from stages.rollout.torch_model import announce_adapters

        shapes = {n: tuple(t.shape) for n, t in tensors.items() if is_adapter(n)}
        if not shapes or getattr(self.engine, "serves_adapters", False):
            return
        model = getattr(self.engine, "model", None)
        if model is None:
            raise ValueError(
                f"{type(self.engine).__name__} takes no LoRA adapters (trainer.lora.push=adapter needs the "
                "torch engine, or SGLang servers launched for LoRA serving); use trainer.lora.push=merge"
            )
        announce_adapters(model, shapes)

    def _ack(self, version, error: str | None = None) -> dict:
        """The answer to the sender for `version`: applied, or failed with `error`."""
        ack = {"kind": "ack", "proto": PROTO, "engine": self.name, "version": version, "ok": error is None}
        return ack if error is None else {**ack, "error": error}

    def _apply(self, version: int, tensors: dict) -> dict:
        try:
            self._announce_adapters(tensors)
            self.engine.update_weights(list(tensors.items()), version)
            self.applied.append(version)
            self._applied_one.set()
            return self._ack(version)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which fails the run with it
            self.error = f"{type(e).__name__}: {e}"
            log.exception("weights: applying version %s failed", version)
            return self._ack(version, self.error)
