"""Start `nproc` local ranks of a `python -m` module with the environment torchrun would give them, and
wait for all of them: the parallel checks (testing.py) and the offline converter (convert.py) use it.

torchrun's own start-up took ~1 s of every check on the 2-core CI machine and buys nothing for one node.
A rank that fails ends the others, which would otherwise wait for it in a collective until the timeout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

from buffer.net import free_port


class RanksFailed(RuntimeError):
    """A rank exited non-zero, or they ran out of time; the message has that rank's output."""


def run_ranks(module: str, args: list[str], nproc: int, timeout_s: float, threads: int = 1) -> None:
    """Run `python -m module *args` as ranks 0..nproc-1 of one torch.distributed world on this machine.
    Raises RanksFailed with the failing rank's last output."""
    path = os.environ.get("PYTHONPATH")  # kept after the repo: the GPU machine's wheels live there
    env = dict(
        os.environ, PYTHONPATH=os.getcwd() + (f":{path}" if path else ""), OMP_NUM_THREADS=str(threads)
    )
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    env.update(LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, "-m", module, *args]
    with contextlib.ExitStack() as stack:
        logs = [
            stack.enter_context(tempfile.TemporaryFile(mode="w+", errors="replace")) for _ in range(nproc)
        ]
        ranks: list[subprocess.Popen] = []
        failed_first, timed_out = None, False
        try:
            for r, log in enumerate(logs):
                env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                ranks.append(subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in ranks]  # every rank, each pass: any of them may fail first
                failed_first = next((r for r, c in enumerate(codes) if c), None)
                if failed_first is not None or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in ranks:  # the rest wait for the failed rank in a collective: end them
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failed_first is not None or timed_out:
            shown = failed_first if failed_first is not None else 0
            why = (
                f"ended after {timeout_s:g} s"
                if timed_out
                else f"rank {shown} exited {ranks[shown].returncode}"
            )
            logs[shown].seek(0)
            raise RanksFailed(
                f"{module} {' '.join(args)}: {why}; ranks exited {[p.returncode for p in ranks]}; "
                f"rank {shown}'s output:\n{logs[shown].read()[-4000:]}"
            )
