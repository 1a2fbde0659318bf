"""The SGLang server process as SGLangEngine handles it: its error, its log's tail, its end, its
server-sent events, and its GPU memory handed back and taken again (colocated offload)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from stages.host_copy import MemoryHeld, device_holders
from stages.rollout.offload import KV_CACHE, MEMORY_SAVER, WEIGHTS, MemoryRelease, checked_tags

log = logging.getLogger("stages.rollout.sglang_engine")  # the engine's own log

RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"
FLUSH = "/flush_cache"  # with ?timeout=S it answers once the scheduler is fully idle (SGLang >= 0.5.17)
# SGLang's tags of each part (sglang.srt.constants): the CUDA graphs' memory goes and comes with the
# KV cache, as slime wakes them (after the weights and their push)
SGLANG_TAGS = {WEIGHTS: ("weights",), KV_CACHE: ("kv_cache", "cuda_graph")}
HOLD_POLL_S = 0.05  # a request held by a release looks for the wake this often


class EngineError(RuntimeError):
    """The SGLang server failed, refused a request or did not start; the message says which and why."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End the server and every process it started: they share the process group we created for it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # the leader may be gone while its schedulers still hold the GPU
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def dump_stacks(pgid: int, log_path: Path, timeout_s: float = 30.0) -> int:
    """Append the Python stacks of every process of a hung server's group (py-spy dump) to its log,
    before the server is ended: its own log says nothing of where a scheduler stopped, and SGLang's
    crash diagnostics find no scheduler left once the group is ended. All dumps share one `timeout_s`;
    `--nonblocking` reads the stacks without stopping the process (a process stuck in the GPU driver may
    not stop). Where py-spy is not installed, or cannot attach, the log says so. Returns how many
    processes were dumped; never raises (the relaunch that follows matters more than the diagnosis)."""
    try:
        return _dump_stacks(pgid, log_path, timeout_s)
    except OSError as e:
        log.warning("could not dump the stacks of hung server group %d into %s: %s", pgid, log_path, e)
        return 0


def _dump_stacks(pgid: int, log_path: Path, timeout_s: float) -> int:
    spy = shutil.which("py-spy")
    with open(log_path, "a") as logf:
        if spy is None:
            logf.write("\n=== hung server: no py-spy on PATH, so its stacks are not dumped\n")
            return 0
        dumped, deadline = 0, time.monotonic() + timeout_s
        for pid in _group_pids(pgid):
            logf.write(f"\n=== hung server: py-spy dump of pid {pid} ({_cmdline(pid)[:200]})\n")
            logf.flush()
            proc = subprocess.Popen(
                [spy, "dump", "--nonblocking", "--pid", str(pid)], stdout=logf, stderr=subprocess.STDOUT
            )
            try:
                rc = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                logf.write(f"(no dump within the {timeout_s:.0f}s all dumps share)\n")
                break
            if rc == 0:
                dumped += 1
            else:  # most often: not allowed to attach (ptrace); the error is above
                logf.write(
                    f"(py-spy exited with {rc}: it needs ptrace rights over the server, e.g. CAP_SYS_PTRACE)\n"
                )
    return dumped


def end_orphaned_servers(ports: list[int], timeout_s: float = 120.0) -> list[int]:
    """End the SGLang servers listening on `ports` whose engine's process died (their sessions outlive
    it): SIGKILL each one's process group, then wait until no process of it runs (zombies hold no GPU
    memory) and the port is free. Found by port, not by a pid recorded earlier: an engine watch
    relaunches a server under a new pid on the same port. Only a listener whose command line names
    sglang is ended. Returns the ports still held at the deadline."""
    groups = {}
    for port, pid in _listeners(ports).items():
        if "sglang" in _cmdline(pid):
            groups[port] = _pgid(pid)
    for g in set(groups.values()) - {None}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        held = sorted(set(_listeners(ports)) | {p for p, g in groups.items() if g and _group_running(g)})
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.2)


def _listeners(ports: list[int]) -> dict[int, int]:
    """port -> pid of the process listening on it (TCP, IPv4 or IPv6), from /proc."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                port = int(f[1].rsplit(":", 1)[1], 16)
                if f[3] == "0A" and port in ports:  # 0A: LISTEN
                    inodes[f"socket:[{f[9]}]"] = port
    found = {}
    for fd in Path("/proc").glob("[0-9]*/fd/*") if inodes else ():
        with contextlib.suppress(OSError):
            port = inodes.get(os.readlink(fd))
            if port is not None:
                found[port] = int(fd.parts[2])
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_pids(pgid: int) -> list[int]:
    """The processes of group `pgid` that still run (not zombies), from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            pids.append(int(stat.parent.name))
    return sorted(pids)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (not a zombie)."""
    return bool(_group_pids(pgid))


async def sse_events(resp):
    """Parse SGLang's server-sent events (`data: {json}` blocks, ending with `data: [DONE]`). Lines are
    split here rather than with readline(), which refuses lines above aiohttp's 128 KiB limit."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)


class SGLangMemory(MemoryRelease):
    """Mixed into SGLangEngine: its server's weights and KV cache released and resumed over HTTP
    (SGLang 0.5.17's /release_memory_occupation and /resume_memory_occupation, tags by part in
    SGLANG_TAGS). A release first holds new requests (`enter`, which generate() awaits) and waits for
    those outstanding: SGLang frees a KV cache only with no request running. Expects the engine's
    cfg, name, gpu_id, log_path, outstanding, _proc, _post and the fields `_init_memory` makes."""

    def _init_memory(self) -> None:
        self._released: set[str] = set()
        self._requests_held = False  # no new request is sent: something is released, or a release waits
        self._gate = threading.Lock()  # `_requests_held` and `outstanding` change together

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    async def enter(self, n: int) -> None:
        """Count `n` new requests as outstanding, once no release holds them."""
        while not self._enter(n):
            await asyncio.sleep(HOLD_POLL_S)

    def _enter(self, n: int) -> bool:
        with self._gate:
            if self._requests_held:
                return False
            if self.outstanding == 0:
                self._busy_since = time.perf_counter()
            self.outstanding += n
            return True

    def release_again(self) -> None:
        """A server relaunched while released starts with all its memory: release it again."""
        if self._released:
            self._wait_idle(time.monotonic() + self.cfg.control_timeout_s)
            self._post(RELEASE, {"tags": [g for t in sorted(self._released) for g in SGLANG_TAGS[t]]})

    def _wait_idle(self, deadline: float) -> None:
        """Until the server's scheduler is fully idle. A release asserts that it is, and a failed assertion
        kills the server; our count of outstanding requests reaches 0 earlier (the overlapped scheduler's
        last decode step, a /health probe's one-token generation, an abort still on its way). SGLang's
        deferred flush answers only once the scheduler is idle (slime flushes before a release too)."""
        left = max(1.0, deadline - time.monotonic())
        self._post(f"{FLUSH}?timeout={left:.1f}", {}, timeout=left + 10.0)

    def release_memory(self, tags: Sequence[str], timeout_s: float) -> float:
        t0 = time.perf_counter()
        todo = [t for t in checked_tags(tags) if t not in self._released]
        if not todo:
            return 0.0
        if MEMORY_SAVER not in self.cfg.extra_args:
            raise RuntimeError(
                f"{self.name}: releasing {todo} needs the server started with {MEMORY_SAVER} (the pipeline "
                "adds it when cluster.offload.rollout=true; add it to rollout.sglang.extra_args)"
            )
        with self._gate:
            self._requests_held = True
        deadline = time.monotonic() + timeout_s
        while self.outstanding and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_S)
        if self.outstanding:
            with self._gate:
                self._requests_held = bool(self._released)
            raise TimeoutError(
                f"{self.name}: release of {todo} waited {timeout_s:.0f}s (cluster.offload.timeout_s) for "
                f"{self.outstanding} outstanding request(s); an evaluation or a long response holds the "
                "server: raise cluster.offload.timeout_s or lower rollout.sampling.max_new_tokens"
            )
        try:
            self._wait_idle(deadline)
        except Exception:
            with self._gate:
                self._requests_held = bool(self._released)
            raise
        self._post(RELEASE, {"tags": [g for t in todo for g in SGLANG_TAGS[t]]}, timeout=timeout_s)
        self._released.update(todo)
        return time.perf_counter() - t0

    def resume_memory(self, tags: Sequence[str], timeout_s: float) -> float:
        t0 = time.perf_counter()
        todo = [t for t in checked_tags(tags) if t in self._released]
        if todo:
            try:
                self._post(RESUME, {"tags": [g for t in todo for g in SGLANG_TAGS[t]]}, timeout=timeout_s)
            except EngineError as e:  # typically out of memory: say who holds the GPU
                raise MemoryHeld(f"{e}; {self._holders()}") from None
            self._released.difference_update(todo)
        with self._gate:
            self._requests_held = bool(self._released)
        return time.perf_counter() - t0

    def _holders(self) -> str:
        try:
            import torch

            return device_holders(torch.device("cuda", self.gpu_id))
        except Exception as e:  # noqa: BLE001 - no CUDA in this process: the server's log says more
            return f"(GPU {self.gpu_id}'s processes unknown here: {e}; see {self.log_path})"

    def memory_bytes(self) -> int | None:
        """GPU memory of the server's processes (NVML, through torch; None without it)."""
        if self._proc is None:
            return None
        return gpu_bytes_of_tree(self._proc.pid)


def gpu_bytes_of_tree(pid: int) -> int | None:
    """GPU memory that process `pid` and its descendants hold on any GPU; None without NVML."""
    try:
        import psutil
        import pynvml

        pynvml.nvmlInit()
        pids = {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
        total, seen = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in pids:
                    seen = True
                    total += p.usedGpuMemory or 0
        # none of them on any GPU: in a container NVML may list the host's pids, so unknown, not 0
        return total if seen else None
    except Exception:  # noqa: BLE001 - no NVML (a CPU machine, a container without it): unknown
        return None
