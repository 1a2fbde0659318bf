"""Checkpoints written while the trainer steps on (trainer.async_save): the snapshot goes into shared
memory, a writer process of this rank plans and writes the shards and (rank 0) commits, a thread of the
trainer relays between them and the other ranks. async_checkpoint.py has the steps and the protocol.

Why a process of its own and not a thread of the trainer, or megatron's AsyncCallsQueue (measured:
docs/checkpoints.md). A save's plan and write are Python that holds the GIL for most of their ~12 ms of
CPU (tiny-qwen2 on the 2-core CPU box), which the trainer's thread needs between its torch calls (on
GPUs it keeps launching kernels): with a core free, a checkpoint after every step cost +4 to +5 % step
time from this process and +10 to +11 % from a thread of the trainer (+14 to +16 % synchronous). With
both cores busy with the trainer's torch threads no work beside it is free (+14 to +22 %, a thread +21
to +24 %); a niced writer only waited for cycles, and the next save for it. megatron's AsyncCallsQueue forks the
trainer for every save (12-26 ms for the 440 MB trainer on this box) and finalizes with a collective
on the default group, which can only run at the next save: `latest` would lag a checkpoint interval.

The shared memory is files in /dev/shm (or, short of room there, beside the checkpoints) that both
processes map, unlinked once the writer has them: a kill leaves nothing behind. With several ranks the
exchange and the outcome go over a gloo group of the checkpoint's own, made at the first background
save: the training's collectives run on the default group meanwhile, and two threads' collectives on
one group would be matched in different orders on different ranks.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from stages.trainer.async_checkpoint import (
    WAIT_TIMEOUT_S,
    CheckpointWriteError,
    SaveJob,
    commit,
    finish,
    prepare_folder,
    sent,
    write_shards,
)

log = logging.getLogger(__name__)

SHM = "/dev/shm"


class Arena:
    """Where the snapshots' tensors go: segments of shared memory, reused save after save (one save is
    in flight at a time). `reserve` makes room for a part, `keep(tensor)` copies one in and returns
    where it is: (segment, offset, dtype, shape), which the writer turns back into a tensor over the
    same memory."""

    def __init__(self, spill_dir: str):
        self.spill_dir = spill_dir  # where segments go when /dev/shm has no room
        self.segments: list[tuple[str, torch.Tensor]] = []  # (path until the writer maps it, bytes)
        self._seg, self._off = 0, 0

    def reset(self) -> None:
        self._seg, self._off = 0, 0

    def reserve(self, nbytes: int, count: int) -> None:
        """Room for `count` tensors of `nbytes` together, in one segment: the first from here on with
        that room, or a new one of that size (the same saves find the same segments again)."""
        need = nbytes + 64 * count  # each tensor starts 64-byte aligned
        while self._seg < len(self.segments) and self._off + need > self.segments[self._seg][1].numel():
            self._seg, self._off = self._seg + 1, 0
        if self._seg == len(self.segments):
            self.segments.append(self._new(max(need, 1 << 20)))

    def keep(self, t: torch.Tensor) -> tuple:
        """Copy `t` in (after reserve() made room for it); where it is."""
        n = t.numel() * t.element_size()
        start = -(-self._off // 64) * 64
        seg = self.segments[self._seg][1]
        if start + n > seg.numel():
            raise RuntimeError(f"checkpoint arena: {n} bytes past its reserved room ({seg.numel() - start})")
        seg[start : start + n].view(t.dtype).view(t.shape).copy_(t)  # the device-to-host copy on GPUs
        self._off = start + n
        return (self._seg, start, str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def _new(self, size: int) -> tuple[str, torch.Tensor]:
        """A new segment, its space reserved (posix_fallocate: no SIGBUS on a full /dev/shm later)."""
        st = os.statvfs(SHM) if os.path.isdir(SHM) else None
        folder = SHM if st is not None and st.f_bavail * st.f_frsize > 2 * size else self.spill_dir
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f".slipstream-ckpt-{os.getpid()}-{len(self.segments)}-{time.time_ns()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        return path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def unlink_mapped(self, upto: int) -> None:
        """The writer mapped segments [0, upto): their files can go (the mappings stay)."""
        for i in range(upto):
            path, data = self.segments[i]
            if path:
                os.unlink(path)
                self.segments[i] = ("", data)

    def close(self) -> None:
        self.unlink_mapped(len(self.segments))
        self.segments = []


class WriterProcess:
    """This rank's writer: `python -m stages.trainer.async_checkpoint_writer`, spoken to over two pipes.
    `hook` ("module:function", *arguments): called in the writer before it serves (tests slow its
    writes down or make them fail there: async_checkpoint_check.hold_writes)."""

    def __init__(self, hook: tuple[str, ...] = ()):
        to_child, self._to = os.pipe()
        self._from, from_child = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=root + (f":{path}" if path else ""), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", __name__, "--fds", str(to_child), str(from_child), *hook]
        self.proc = subprocess.Popen(cmd, pass_fds=(to_child, from_child), env=env, cwd=root)
        os.close(to_child), os.close(from_child)
        self._send, self._recv = Connection(self._to, readable=False), Connection(self._from, writable=False)

    def call(self, *msg: Any) -> Any:
        """Send a request, return the writer's answer; raises CheckpointWriteError for its error."""
        try:
            self._send.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            status, *answer = pickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError) as e:
            code = self.proc.poll()
            raise CheckpointWriteError(f"the checkpoint writer process ended (exit code {code}): {e}") from e
        if status != "ok":
            raise CheckpointWriteError(f"the checkpoint writer: {answer[0]}")
        return answer[0]

    def close(self, timeout_s: float = 30.0) -> None:
        for c in (self._send, self._recv):
            c.close()  # the writer reads the end of its input and exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "the checkpoint writer (pid %d) did not exit in %gs; killing it", self.proc.pid, timeout_s
            )
            self.proc.kill()
            self.proc.wait()


class BackgroundSave:
    """At most one save in flight: snapshot into the arena (the trainer's thread), then a thread that
    relays it to the writer process and exchanges with the other ranks while the trainer steps on.

    The thread is no daemon: an interpreter that exits while it writes waits for the commit (a trainer
    that never called wait() still leaves its last checkpoint complete); a kill does not wait, and
    leaves the previous checkpoint the latest."""

    def __init__(self, spill_dir: str, timeout_s: float = WAIT_TIMEOUT_S, hook: tuple[str, ...] = ()):
        self.timeout_s, self.hook = timeout_s, hook
        self.arena = Arena(spill_dir)
        self.writer = WriterProcess(hook)  # now: its start-up (imports) overlaps the trainer's
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None
        self._error: BaseException | None = None
        self._group: Any = None

    def ready(self) -> None:
        """Before a snapshot (after wait()): a writer that died is replaced, with new shared memory (the
        files of the old one are gone once it had mapped them)."""
        if self.writer.proc.poll() is not None:
            log.warning("the checkpoint writer exited (%s); starting a new one", self.writer.proc.returncode)
            self.writer.close()
            self.arena.close()
            self.arena, self.writer = Arena(self.arena.spill_dir), WriterProcess(self.hook)

    @property
    def store(self) -> Arena:
        """snapshot_part's `store`: use between ready() and start()."""
        return self.arena

    def start(self, job: SaveJob) -> None:
        """Write and commit `job` (its tensors kept by keep()) in the background; wait() first."""
        if self._thread is not None:
            raise RuntimeError(f"checkpoint {self._job.name} is still in flight: wait() before a new save")
        group = self._write_group()
        self._job, self._error = job, None
        self._thread = threading.Thread(target=self._run, args=(job, group), name=f"ckpt-{job.name}")
        self._thread.start()

    def _run(self, job: SaveJob, group: Any) -> None:
        try:
            prepare_folder(job, group)
            segments = [path for path, _ in self.arena.segments]
            mine, error = None, None
            rank, world = dist.get_rank(), dist.get_world_size()
            try:
                mine = self.writer.call("write", job, segments, rank, world)  # one rank: committed too
            except CheckpointWriteError as e:
                error = f"rank {rank}: {e}"
            self.arena.unlink_mapped(len(segments))
            if world == 1 and error is None:
                log.info(
                    "checkpoint saved: %s (%.3fs after its snapshot)",
                    job.path,
                    time.monotonic() - job.started,
                )
                return

            def commit_fn(every: list) -> None:  # rank 0's writer has its own sent(): None in its place
                self.writer.call("commit", [None, *every[1:]])

            finish(job, mine, error, group, commit_fn)
        except BaseException as e:  # raised in the trainer's thread at its next save or wait()
            self._error = e
        finally:
            self.arena.reset()

    def _write_group(self) -> Any:
        if self._group is None and dist.get_world_size() > 1:  # collective: every rank saves at once
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    def wait(self) -> str | None:
        """Block until the save in flight is committed (at most timeout_s); returns its folder, or None
        when there was none. Raises its CheckpointWriteError, or TimeoutError."""
        if self._thread is None:
            return None
        self._thread.join(self.timeout_s)
        job = self._job
        if self._thread.is_alive():
            raise TimeoutError(
                f"checkpoint {job.path} is still being written {self.timeout_s:g}s after the wait for it "
                f"began, and the trainer starts no save while one is in flight: check the file system "
                f"under {job.root} (full, slow, hung) and that no rank died; `latest` names the last "
                "complete checkpoint"
            )
        error, self._thread, self._job, self._error = self._error, None, None, None
        if error is not None:
            raise error
        return job.path

    def close(self) -> None:
        """wait(), then end the writer process and free the shared memory."""
        try:
            self.wait()
        finally:
            self.writer.close()
            self.arena.close()


# -- the writer process ------------------------------------------------------------------------------
def serve(inp: Connection, out: Connection) -> None:
    """Answer "write" (SaveJob, its segments, rank, world size: plan and write this rank's shards,
    answer sent(); with one rank, commit at once and answer None) and "commit" (the ranks' sent(), this
    rank's as None: rank 0 commits the job it wrote) until the trainer closes the pipe."""
    mapped: list[mmap.mmap] = []
    cache: dict = {}  # write_shards' plans, kept from save to save
    job, plans = None, []
    while True:
        try:
            kind, *args = pickle.loads(inp.recv_bytes())
        except EOFError:
            return
        try:
            if kind == "write":
                (job, segments, rank, world), plans = args, []  # no plans of an earlier job's
                _as_rank(rank, world)
                for path in segments[len(mapped) :]:
                    with open(path, "r+b") as f:
                        mapped.append(mmap.mmap(f.fileno(), 0))
                _unpack(job, mapped)
                plans = write_shards(job, rank, cache)
                answer = sent(plans) if world > 1 else commit(job, plans, [sent(plans)])
            else:
                every = [sent(plans) if theirs is None else theirs for theirs in args[0]]
                answer = commit(job, plans, every)
                job, plans = None, []
            out.send_bytes(pickle.dumps(("ok", answer), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # its traceback to the trainer's log (the writer's stderr is the trainer's)
            traceback.print_exc()
            out.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))


def _as_rank(rank: int, world: int) -> None:
    """megatron's conversion and DCP's decentralized plan ask the default process group for the rank
    and world size (the files are named by the rank): the writer has a fake one of its trainer's rank,
    which no collective of the write needs."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    if (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise RuntimeError(
            f"a writer of rank {dist.get_rank()} of {dist.get_world_size()} got rank {rank} of {world}"
        )


def _unpack(job: SaveJob, mapped: list[mmap.mmap]) -> None:
    """The job's tensors, from (segment, offset, dtype, shape) to tensors over the shared memory, each
    with a storage of its own size (megatron's writer copies a tensor whose storage is larger, and the
    cached plans of write_shards hold these tensors)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def view(v: Any) -> Any:
        if isinstance(v, ShardedTensor):
            seg, start, dtype, shape = v.data
            dt, n = getattr(torch, dtype), torch.Size(shape).numel()
            flat = (
                torch.frombuffer(mapped[seg], dtype=dt, count=n, offset=start)
                if n
                else torch.empty(0, dtype=dt)
            )
            v.data = flat.view(shape)
        return v

    for snap in job.parts:
        dict_list_map_inplace(view, snap.sharded)


def _die_with_the_trainer() -> None:
    """A trainer killed mid-write takes its writer along (Linux: PR_SET_PDEATHSIG), so that no orphan
    goes on writing into a folder a restarted trainer may be writing the same version into."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):  # not Linux: the writer ends at its next read instead
        return
    if os.getppid() == 1:  # the trainer died before the line above
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the checkpoint writer of one trainer rank (not for people)")
    ap.add_argument("--fds", nargs=2, type=int, required=True)
    ap.add_argument("hook", nargs="*", help="module:function and its arguments, called first (tests)")
    a = ap.parse_args(argv)
    _die_with_the_trainer()
    torch.set_num_threads(1)
    if a.hook:
        import importlib

        module, _, fn = a.hook[0].partition(":")
        getattr(importlib.import_module(module), fn)(*a.hook[1:])
    serve(Connection(a.fds[0], writable=False), Connection(a.fds[1], readable=False))


if __name__ == "__main__":
    main()
