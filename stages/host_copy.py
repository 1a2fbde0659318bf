"""Device memory handed back and taken again (colocated offload, cluster.offload): the bytes of a set of
tensors moved to host copies and their device memory freed, then restored bit for bit. Shared by the
trainer's state (stages/trainer/offload.py) and the torch engine's weights (stages/rollout/torch_engine.py).

It works on storages, not tensors: megatron's parameters and gradients are views into a few large
buffers (and `main_grad` into the gradient buffer), which hooks and the optimizer hold by reference.
Resizing each storage to 0 frees its memory and leaves every view, hook and optimizer reference in
place; resizing it back and copying the host bytes in restores all of them at once (FSDP1 and verl's
megatron offload free memory the same way). A view of a parked storage must not be read until it is
restored: there is no data behind it (a read is a segfault on the CPU, an illegal address on a GPU),
which is why the owners refuse to run while parked (Trainer, TorchEngine) rather than trust the order.

Host copies of a CUDA device are pinned and kept from one offload to the next (a pool by size: the
same storages come back every step), so only the first offload allocates. On the CPU the "host copy"
is a second CPU buffer: nothing is saved there, but the path is the one the GPU runs, and the freed
storages are really freed (what tests/test_offload*.py check).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class MemoryHeld(RuntimeError):
    """A wake could not get its device memory back; the message names what holds the device."""


@dataclass(eq=False)
class _Parked:
    name: str  # the first tensor seen on this storage (for messages)
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 [nbytes]; None: dropped (restored as zeros)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and their optimizer state), any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def unique_storages(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device, claimed: set[int] | None = None
) -> list[tuple[str, torch.UntypedStorage]]:
    """The distinct non-empty storages on `device` behind `named` tensors, each once (views share
    one), leaving out those whose data pointer is in `claimed` (and adding the rest to it)."""
    seen = claimed if claimed is not None else set()
    out = []
    for name, t in named:
        if t is None:
            continue
        t = local_tensor(t)
        if not on_device(t, device):
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        out.append((name, s))
    return out


def resident_bytes(storages: Iterable[torch.UntypedStorage]) -> int:
    return sum(s.nbytes() for s in storages)


def _bytes_of(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (made after any resize: a view keeps its old size)."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,))


def _grow(s: torch.UntypedStorage, nbytes: int) -> None:
    s.resize_(nbytes)


class HostStash:
    """Storages parked on the host and restored. `park(..., keep=False)` frees without a copy (state
    that is rebuilt anyway, e.g. gradients that the next step zeroes first): restored as zeros."""

    def __init__(self, device: torch.device, owner: str):
        self.device, self.owner = device, owner
        self._parked: list[_Parked] = []
        self._pool: dict[int, list[torch.Tensor]] = {}  # host buffers by size, reused across offloads

    @property
    def parked_bytes(self) -> int:
        return sum(p.nbytes for p in self._parked)

    def __bool__(self) -> bool:
        return bool(self._parked)

    def park(self, storages: list[tuple[str, torch.UntypedStorage]], *, keep: bool = True) -> int:
        """Copy (if `keep`) and free `storages`; returns the bytes freed."""
        if not storages:
            return 0
        bad = [name for name, s in storages if not s.resizable()]
        if bad:  # a storage that cannot be freed in place (e.g. mapped from a file): say which
            raise RuntimeError(
                f"{self.owner}: cannot offload {bad[:3]}: their memory is not resizable (mapped from a "
                "file, or shared); copy them into memory of their own first"
            )
        cuda = self.device.type == "cuda"
        parked = []
        for name, s in storages:
            n = s.nbytes()
            host = None
            if keep:
                host = self._host_buffer(n, pinned=cuda)
                host.copy_(_bytes_of(s), non_blocking=cuda)
            parked.append(_Parked(name, s, n, host))
        if cuda:  # the copies must have landed before their source goes
            torch.cuda.synchronize(self.device)
        for p in parked:
            p.storage.resize_(0)
        self._parked += parked
        if cuda:  # hand the freed blocks back to the driver: the other side allocates outside torch's cache
            # first the blocks a CUDA IPC push shared with a server that let go of them only after this
            # process had freed them: torch keeps such a block until ipc_collect (the 7B colocated run
            # on 2 H200s, 2026-11-28, kept its 15.2 GB push buffer through generation from step 7 on)
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return sum(p.nbytes for p in parked)

    def restore(self) -> int:
        """Every parked storage back on the device, bit for bit (dropped ones zeroed); returns the
        bytes. A device that cannot hold them raises MemoryHeld naming who holds it; what was already
        restored stays, the rest stays parked (a second call finishes the job)."""
        cuda = self.device.type == "cuda"
        done = 0
        try:
            while self._parked:
                p = self._parked[0]
                _grow(p.storage, p.nbytes)
                dst = _bytes_of(p.storage)
                if p.host is None:
                    dst.zero_()
                else:
                    dst.copy_(p.host, non_blocking=cuda)
                    self._pool.setdefault(p.nbytes, []).append(p.host)
                self._parked.pop(0)
                done += p.nbytes
        except torch.OutOfMemoryError as e:
            need = self.parked_bytes
            raise MemoryHeld(
                f"{self.owner}: cannot get {need / 1e9:.2f} GB back on {self.device} ({e}); "
                f"{device_holders(self.device)}"
            ) from None
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
        return done

    def _host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        return _pinned(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)


def _pinned(nbytes: int) -> torch.Tensor:
    """Page-locked host memory of exactly `nbytes`: torch's pinned allocator rounds every block up to a
    power of two, which for a 7B trainer's per-parameter optimizer state pins ~1.5-2x what is moved (two
    ranks' worth can exhaust the host). Plain memory registered with CUDA instead, unregistered when the
    buffer goes; torch's pinned allocator where registration fails."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    rt = torch.cuda.cudart()
    err = int(rt.cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        _clear_cuda_error()
        log.warning(
            "cudaHostRegister(%d bytes) failed (error %d): torch's pinned allocator instead", nbytes, err
        )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(t, rt.cudaHostUnregister, t.data_ptr())
    return t


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error, which a failed call leaves set and the next kernel launch's
    check would report as its own. torch's cudart binding has no cudaGetLastError: call it in the
    runtime library this process loaded (the same handle, so the same state). Best effort."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcudart.so" in line)
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration, AttributeError):
        pass


def device_holders(device: torch.device) -> str:
    """Who holds `device`'s memory, for a wake that cannot get its own back: the processes on the GPU
    (from NVML, through torch) and the free memory; on the CPU, the host's free memory."""
    if device.type != "cuda":
        try:
            import psutil

            return f"the host has {psutil.virtual_memory().available / 1e9:.1f} GB available"
        except ImportError:
            return "the host is out of memory"
    free, total = torch.cuda.mem_get_info(device)
    head = f"{free / 1e9:.1f} of {total / 1e9:.1f} GB free on {device}"
    try:
        procs = torch.cuda.list_gpu_processes(device)
    except Exception as e:  # noqa: BLE001 - NVML may be missing: the free memory still says something
        procs = f"(processes unknown: {e})"
    return f"{head}; held by: {procs.strip()}"
