"""Process-level networking helpers shared by every layer (no imports from stages/ or the orchestration)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _split(address: str) -> tuple[str, str, str]:
    """ "tcp://127.0.0.1:5555" -> ("tcp://", "127.0.0.1", ":5555"); a bare host has no scheme or port."""
    scheme, sep, rest = address.rpartition("://")
    host, colon, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    return scheme + sep, host, colon + port


def is_loopback(address: str) -> bool:
    """True for "tcp://127.0.0.1:5555", "127.0.0.1", "http://localhost:30000" and the like."""
    return _split(address)[1] in LOOPBACK


def on_host(address: str, host: str) -> str:
    """A loopback address moved to `host` ("tcp://127.0.0.1:0" -> "tcp://10.0.0.5:0"): on a cluster of
    several nodes a stage must be reachable from the others. An address the user chose is kept."""
    scheme, old, port = _split(address)
    return f"{scheme}{host}{port}" if old in LOOPBACK else address
