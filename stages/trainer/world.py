"""Joining the torch.distributed world: the megatron backend (model.init_distributed, which then makes
megatron's groups) and the fsdp backend both start here."""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist


def join_world(timeout_s: float = 600.0) -> None:
    """Join the torch.distributed world (torchrun's environment), or make one of size 1 on a free
    loopback port: gloo on the CPU, NCCL on CUDA (one device per rank)."""
    if dist.is_initialized():
        return
    from buffer.net import free_port
    from stages.weights.sglang_protocol import align_nccl_env

    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        align_nccl_env()  # before the first communicator: the weight-push group must agree
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
        )


def leave_world() -> None:
    """Leave the world at a rank's normal end, before the interpreter finalizes. Without it gloo's worker
    threads may still hold finished async works (megatron's overlapped all-reduces) whose tensors, freed
    during finalization, abort the rank with "terminate called without an active exception" (seen
    about once in four CI runs). No barrier: the ranks are done with their collectives, and rank 0 may
    still write an export for longer than the group's timeout while the others leave."""
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_world_at_exit() -> None:
    """Call at a rank's normal end: leave_world() runs once the interpreter has joined its non-daemon
    threads (CPython runs atexit callbacks after them) and before it finalizes. An asynchronous
    checkpoint's writer thread that is still committing uses the world (its rank, the ranks' gather),
    so leaving at once, while it runs, would drop that last checkpoint."""
    atexit.register(leave_world)
