"""A buffer process's memory settings (buffer/memory.py): ingest lands in pages already mapped, and
`python -m buffer serve` runs with the settings from its start. Each check runs in a process of its
own: the settings are process-wide and must not leak into the test runner."""

import ctypes.util
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.client import BufferClient
from buffer.demo import synthetic_samples
from buffer.memory import BUFFER_GLIBC_TUNABLES, MARKER, buffer_env

REPO = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"), reason="glibc malloc settings"
)

# Allocate 64 MB in 4 MB messages (as ZeroMQ does for received frames), touch them, and report how
# many page faults that cost.
_FAULTS = """
import ctypes, resource, sys
from buffer.memory import reserve
got = reserve(int(sys.argv[1])) if sys.argv[1] != "none" else {}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [libc.malloc(4 << 20) for _ in range(16)]
for b in blocks:
    ctypes.memset(b, 1, 4 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, got.get("reserved_mb", 0))
"""


def _faults(arg: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, arg],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    faults, reserved = out.stdout.split()
    return int(faults), int(reserved)


@glibc
def test_reserved_memory_takes_messages_without_page_faults():
    plain, _ = _faults("none")
    reserved_faults, reserved_mb = _faults("128")
    assert reserved_mb == 128
    pages = (64 << 20) // resource.getpagesize()
    if plain < pages // 4:  # transparent huge pages (or large base pages): few faults to save anyway
        pytest.skip(f"64 MB of fresh memory took only {plain} faults here (huge pages)")
    assert reserved_faults < plain / 10, (plain, reserved_faults)


def test_buffer_env_keeps_the_users_tunables():
    env = buffer_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "X": "1"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.tcache_count=0:{BUFFER_GLIBC_TUNABLES}"
    assert env["X"] == "1" and env[MARKER] == "1"
    assert buffer_env({})["GLIBC_TUNABLES"] == BUFFER_GLIBC_TUNABLES


@glibc
@pytest.mark.timeout(60)
def test_serve_runs_with_the_settings_and_serves(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", MARKER)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffer", "serve", "--bind", "tcp://127.0.0.1:0", "--reserve-mb", "16"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    try:
        addr = proc.stdout.readline().split()[-1]
        assert "reserved=16MB" in proc.stdout.readline()
        # the same process, re-executed in place with the settings in its environment (glibc leaves
        # only the first of them in the environment block it shows, after reading them all)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"{MARKER}=1".encode() in environ
        assert any(e.startswith(b"GLIBC_TUNABLES=glibc.malloc.arena_max=1") for e in environ)
        c = BufferClient(addr, timeout_s=20)
        c.put(synthetic_samples(2, 4, 256, 16, prefix="mem"))
        got = c.fetch(2, version=0, max_staleness=10, timeout_s=10)
        assert sorted(got.column("uid").to_pylist()) == sorted(
            s.uid for s in synthetic_samples(2, 4, 256, 16, prefix="mem")
        )
        c.close()
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()
