"""ZeroMQ CURVE for the sockets that cross hosts (buffer ingest/fetch, the CPU weight transport).

A run makes one `CurveKeys` (a server and a client keypair) and hands it to its stages. A server
socket (`secure_server`) then speaks CURVE only and admits exactly the run's client key, so knowing
the server's public key is not enough; a refused peer never gets past the handshake, so nothing it
sends is seen or answered, and the returned `CurveGuard` counts it (from a socket monitor).

ZeroMQ allows one ZAP handler per context, and the buffer server, the weight sender and tests share
`zmq.Context.instance()`: so a context has one handler, shared by reference count, and each secured
socket its own ZAP domain naming the one client key it admits. Imports only zmq and the stdlib.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# What libzmq 4.3 reports on the server for a refused peer: no CURVE at all (mechanism mismatch) and
# a wrong server key (cannot decrypt HELLO) are PROTOCOL, a client key other than the run's is AUTH
# (our ZAP handler said 400), NO_DETAIL is a handshake that failed without a reason (no ZAP handler).
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "no CURVE or a wrong server key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "a client key that is not the run's",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


@dataclass(frozen=True)
class CurveKeys:
    """The run's keys, z85 bytes (40 characters each). Pickles, so Ray can hand it to actors; its repr
    shows the public keys only."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before connect) a CURVE client of the run's servers."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> CurveGuard:
    """Make `sock` (before bind) a CURVE server that accepts only the run's client key. Close the
    returned guard after the socket; its `refused` counts refused handshakes."""
    domain = f"slipstream-{uuid.uuid4().hex}".encode()
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = domain
    # with no ZAP handler reachable, libzmq would admit any client that knows the server key: refuse
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    _ZapHandler.register(sock.context, domain, z85.decode(keys.client_public))
    try:
        return CurveGuard(sock, domain)
    except BaseException:
        _ZapHandler.unregister(sock.context, domain)
        raise


class CurveGuard:
    """Counts the refused handshakes of one secured socket (a monitor read on its own thread)."""

    def __init__(self, sock: zmq.Socket, domain: bytes):
        self.refused = 0
        self._ctx, self._domain = sock.context, domain
        addr = f"inproc://curve-monitor-{uuid.uuid4().hex}"
        sock.monitor(addr, sum(_REFUSALS))  # the events are bit flags
        self._mon = self._ctx.socket(zmq.PAIR)
        self._mon.linger = 0
        self._mon.connect(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="curve-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._mon.poll(100):
                    continue
                event = parse_monitor_message(self._mon.recv_multipart())["event"]
                if event in _REFUSALS:
                    self.refused += 1
                    # a peer with a wrong server key retries every ~100 ms: log refusal 1, 2, 4, 8...
                    if self.refused & (self.refused - 1) == 0:
                        log.warning(
                            "CURVE refused a peer (%s); %d refused so far", _REFUSALS[event], self.refused
                        )
        finally:
            self._mon.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        _ZapHandler.unregister(self._ctx, self._domain)


class _ZapHandler:
    """One context's ZAP handler (RFC 27): 200 for the client key a secured socket's domain accepts,
    400 for anything else. Started by the first secured socket of the context, stopped with the last."""

    _lock = threading.Lock()
    _running: dict[int, _ZapHandler] = {}  # id(context) -> its handler

    def __init__(self, ctx: zmq.Context):
        self.allowed: dict[bytes, bytes] = {}  # ZAP domain -> accepted client public key (32 raw bytes)
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)  # fails if another handler (e.g. zmq.auth) serves this context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="curve-zap", daemon=True)
        self._thread.start()

    @classmethod
    def register(cls, ctx: zmq.Context, domain: bytes, client_key: bytes) -> None:
        with cls._lock:
            handler = cls._running.get(id(ctx))
            if handler is None:
                handler = cls._running[id(ctx)] = cls(ctx)
            handler.allowed[domain] = client_key

    @classmethod
    def unregister(cls, ctx: zmq.Context, domain: bytes) -> None:
        with cls._lock:
            handler = cls._running.get(id(ctx))
            if handler is None:
                return
            handler.allowed.pop(domain, None)
            if not handler.allowed:
                del cls._running[id(ctx)]
                handler._stop.set()
                handler._thread.join(5)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                # [version, request id, domain, address, routing id, mechanism, client key]
                req = self._sock.recv_multipart()
                ok = len(req) == 7 and req[5] == b"CURVE" and self.allowed.get(req[2]) == req[6]
                status = [b"200", b"OK"] if ok else [b"400", b"not this run's client key"]
                self._sock.send_multipart([b"1.0", req[1] if len(req) > 1 else b"", *status, b"", b""])
        finally:
            # unbind now (close frees the endpoint only later) so a handler started right after can bind
            with contextlib.suppress(zmq.ZMQError):
                self._sock.unbind(_ZAP_ENDPOINT)
            self._sock.close(0)
