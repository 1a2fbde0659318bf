"""The generators' side of colocated offload's hand-over (handover.py is the driver's): what a release or
a wake did (`Turn`), the engines' release and wake run from the generator actor (`engine_turn`), and the
config its engines are launched with (`rollout_cfg`). Apart from handover.py so that the actors import
nothing of the driver's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from stages.rollout.offload import MEMORY_SAVER, releasable

if TYPE_CHECKING:
    from pipeline.config import RunConfig


@dataclass(frozen=True)
class Turn:
    """What one generator's release or wake did: the seconds it took, the device bytes its engines held
    before and after (None where an engine cannot tell: SGLang without NVML)."""

    seconds: float
    bytes_before: int | None
    bytes_after: int | None


def rollout_cfg(cfg: RunConfig) -> RunConfig:
    """The config a generator builds its engines from: with cluster.offload.rollout, SGLang servers are
    launched with --enable-memory-saver (their release and resume need it)."""
    r = cfg.rollout
    if not (cfg.cluster.offload.rollout and r.engine == "sglang") or MEMORY_SAVER in r.sglang.extra_args:
        return cfg
    sg = msgspec.structs.replace(r.sglang, extra_args=[*r.sglang.extra_args, MEMORY_SAVER])
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(r, sglang=sg))


async def engine_turn(engine: object, release: bool, tags: list[str], timeout_s: float) -> Turn:
    """GeneratorActor's side: release (or wake) `tags` of each engine of `engine`, in a worker thread (a
    release waits for requests the actor's own event loop is still answering). No tags: only the
    bytes, for the metrics of a run whose engines keep their memory."""
    try:
        engines = releasable(engine)
    except TypeError:
        if tags:
            raise
        engines = []  # an engine that cannot release: no figures either

    def run() -> Turn:
        before = total([e.memory_bytes() for e in engines])
        t0 = time.perf_counter()
        for e in engines if tags else []:
            (e.release_memory if release else e.resume_memory)(tags, timeout_s)
        after = total([e.memory_bytes() for e in engines])
        return Turn(time.perf_counter() - t0, before, after)

    return await asyncio.to_thread(run)


def total(values: list[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else sum(values)
