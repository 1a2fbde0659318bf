"""The SGLang server process as SGLangEngine handles it: its error, its log's tail, and its end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


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
