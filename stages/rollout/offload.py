"""What an engine that hands its memory back offers (colocated offload, cluster.offload.rollout): while
the trainer steps on the same GPUs the engine releases its weights and KV cache, and takes them back
before it generates again (pipeline/orchestration/handover.py says when).

The tags are SGLang's (`/release_memory_occupation`, `/resume_memory_occupation`). Weights are woken
first and pushed into, then the KV cache: so at the push the GPU holds the trainer's weights and the
engine's, never the engine's KV cache as well. While anything is released the engine generates
nothing: new requests wait for the wake, and a release first lets the requests in flight finish (a
KV cache cannot be released under running sequences), within its timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
MEMORY_SAVER = "--enable-memory-saver"  # SGLang frees and re-maps released memory only with it


def checked_tags(tags: Sequence[str]) -> tuple[str, ...]:
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown engine memory tag(s) {bad}; the tags are {', '.join(TAGS)}")
    return tuple(t for t in TAGS if t in tags)


class MemoryRelease(ABC):
    """Release and wake of an engine's device memory. Blocking calls, safe from any thread but the
    engine's own; each returns the seconds it took. Releasing what is released, or waking what is
    awake, does nothing (a healed generator's new engine starts awake mid-hand-over)."""

    @abstractmethod
    def release_memory(self, tags: Sequence[str], timeout_s: float) -> float:
        """Hold new requests, let those in flight finish (at most `timeout_s`, else TimeoutError naming
        what is still running, and the engine serves again), then free `tags`."""

    @abstractmethod
    def resume_memory(self, tags: Sequence[str], timeout_s: float) -> float:
        """Take `tags` back (host_copy.MemoryHeld, or the engine's own error, naming what holds the
        device when it cannot); requests flow again once nothing is released."""

    @property
    @abstractmethod
    def released(self) -> frozenset[str]:
        """The tags released now."""

    def memory_bytes(self) -> int | None:
        """Device bytes the engine holds now; None where it cannot tell."""
        return None


def releasable(engine: object) -> list[MemoryRelease]:
    """The parts of `engine` that release memory: the engine itself, or each engine of a pool (an
    EnginePool's `engines`). Raises naming the engine when it cannot."""
    if isinstance(engine, MemoryRelease):
        return [engine]
    parts = list(getattr(engine, "engines", None) or [])
    if parts and all(isinstance(e, MemoryRelease) for e in parts):
        return parts
    raise TypeError(
        f"{type(engine).__name__} cannot release its memory (cluster.offload.rollout): use the torch or "
        "SGLang engine, or set cluster.offload.rollout=false"
    )
