"""The torch engine's colocated offload (TorchEngine's, which inherits it; stages/rollout/offload.py has
the protocol): a release or a wake is queued for the engine thread, which applies it between decode
steps once no sequence is running (new ones are held meanwhile, `_held`). Releasing the weights moves
them to a host copy and frees their storage (stages/host_copy.py); the KV cache lives only while
sequences run, so releasing it is that wait. A wake restores the weights bit for bit; requests flow
again once nothing is released."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from stages.host_copy import unique_storages
from stages.rollout.offload import WEIGHTS, MemoryRelease, checked_tags
from stages.rollout.torch_batch import kv_pairs


@dataclass(eq=False)
class MemOp:  # a release or wake of tags, applied by the engine thread
    release: bool
    tags: tuple[str, ...]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class TorchMemoryRelease(MemoryRelease):
    """Mixed into TorchEngine: expects its _cond, _closed, _thread, _pending, _batch, _inflight(), model,
    device, and the offload fields (_memops, _released, _held, _stash) its constructor makes."""

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    def release_memory(self, tags, timeout_s: float) -> float:
        t0 = time.perf_counter()
        todo = tuple(t for t in checked_tags(tags) if t not in self._released)
        if todo:
            self._memop(MemOp(True, todo), timeout_s)
        return time.perf_counter() - t0

    def resume_memory(self, tags, timeout_s: float) -> float:
        t0 = time.perf_counter()
        todo = tuple(t for t in checked_tags(tags) if t in self._released)
        if todo:
            self._memop(MemOp(False, todo), timeout_s)
        return time.perf_counter() - t0

    def memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        params = unique_storages(self.model.named_parameters(), self.device)
        b = self._batch
        cache = sum(k.nbytes + v.nbytes for k, v in kv_pairs(b.cache)) if b is not None else 0
        return sum(s.nbytes() for _, s in params) + cache

    def _memop(self, op: MemOp, timeout_s: float) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._thread.name}: the engine is closed")
            self._held = True  # a release: nothing new starts while the running batch finishes
            self._memops.append(op)
            self._cond.notify_all()
        if not op.done.wait(timeout_s):
            with self._cond:
                waiting = op in self._memops
                if waiting:  # never started: the engine serves on as before
                    self._memops.remove(op)
                    self._held = bool(self._released or self._memops)
                    self._cond.notify_all()
                running, queued = self._inflight(), len(self._pending)
            if waiting:
                raise TimeoutError(
                    f"{self._thread.name}: {'release' if op.release else 'wake'} of {list(op.tags)} waited "
                    f"{timeout_s:.0f}s (cluster.offload.timeout_s) for {running} running sequence(s) to "
                    f"finish ({queued} queued); an evaluation or a long response holds the engine: raise "
                    "cluster.offload.timeout_s or lower rollout.sampling.max_new_tokens"
                )
            if not op.done.wait(timeout_s):  # it started meanwhile: a copy, done in a moment
                raise TimeoutError(
                    f"{self._thread.name}: the engine thread did not finish a {list(op.tags)} move within "
                    f"{timeout_s:.0f}s (cluster.offload.timeout_s) of starting it"
                )
        if op.error is not None:
            raise op.error

    def _apply_memop(self, op: MemOp) -> None:
        """Engine thread, no sequence running."""
        try:
            if WEIGHTS in op.tags and op.release:
                self._own_weights()
                self._stash.park(unique_storages(self.model.named_parameters(), self.device))
            elif WEIGHTS in op.tags:
                self._stash.restore()
            if op.release:
                self._released.update(op.tags)
                if self.device.type == "cuda":  # a KV cache lives with its sequences: none now
                    torch.cuda.empty_cache()
            else:
                self._released.difference_update(op.tags)
        except Exception as e:
            op.error = e
        finally:
            with self._cond:
                self._held = bool(self._released or self._memops)
                self._cond.notify_all()
            op.done.set()

    def _own_weights(self) -> None:
        """Weights loaded from a safetensors file may map it: copied into memory of their own once, so
        that their storage can be freed in place."""
        for p in self.model.parameters():
            if not p.untyped_storage().resizable():
                p.data = p.data.clone()
