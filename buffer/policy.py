"""Sampling policies: which complete groups a fetch gets, and what staleness does to the rest.

Small named classes that validate their arguments in the constructor (reverb-style); pick one with
`BufferConfig.policy` through `make_policy`. A policy only chooses; the storage does the bookkeeping
(retiring served samples, evicting stale ones, logging both).

Staleness of a group at trainer version v = v - (oldest response-token version in the group).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Protocol

from buffer.config import BufferConfig


class GroupView(Protocol):
    gid: str
    min_version: int  # oldest token version in the group (staleness = version - min_version)
    times_sampled: int


class Policy:
    """Base class. `select` gets the complete groups in completion order (oldest first)."""

    name = "policy"
    max_times_sampled = 1  # a sample is retired after being served this many times
    enforces_staleness = True  # evict groups whose staleness exceeds the fetch's bound
    evicts_incomplete = True  # ... including groups still waiting for members

    def select(self, groups: Iterable[GroupView], n: int) -> list[GroupView]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fifo(Policy):
    """A plain queue: complete groups in completion order, each served once, staleness ignored.

    For synchronous training and replays of recorded buffers, where every sample is wanted whatever
    its age. The fetch's max_staleness is NOT enforced; use StalenessFifo for asynchronous runs.
    """

    name = "fifo"
    enforces_staleness = False
    evicts_incomplete = False

    def select(self, groups: Iterable[GroupView], n: int) -> list[GroupView]:
        out = []
        for g in groups:
            if len(out) == n:
                break
            out.append(g)
        return out


class StalenessFifo(Fifo):
    """A queue that enforces the staleness bound: before serving, every group (complete or still
    filling) whose staleness exceeds the fetch's max_staleness is evicted and counted, so stale
    partial groups cannot hold capacity forever. The default for asynchronous training."""

    name = "staleness_fifo"
    enforces_staleness = True
    evicts_incomplete = True


class Uniform(Policy):
    """Uniformly random complete groups; each is served up to `max_times_sampled` times, then retired.

    Staleness is enforced as in StalenessFifo. `seed` makes the draw reproducible.
    """

    name = "uniform"

    def __init__(self, max_times_sampled: int = 1, seed: int = 0):
        if not isinstance(max_times_sampled, int) or max_times_sampled < 1:
            raise ValueError(
                f"Uniform(max_times_sampled={max_times_sampled!r}): a sample would never be served; "
                "set buffer.max_times_sampled to an integer >= 1 (1 = each sample trained on once)"
            )
        self.max_times_sampled = max_times_sampled
        self._rng = random.Random(seed)

    def select(self, groups: Iterable[GroupView], n: int) -> list[GroupView]:
        pool = list(groups)
        if len(pool) <= n:
            return pool
        return self._rng.sample(pool, n)

    def __repr__(self) -> str:
        return f"Uniform(max_times_sampled={self.max_times_sampled})"


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fifo, StalenessFifo, Uniform)}


def make_policy(cfg: BufferConfig, seed: int = 0) -> Policy:
    if cfg.policy not in POLICIES:
        raise ValueError(
            f"buffer.policy {cfg.policy!r} is unknown, so the buffer cannot serve; "
            f"choose one of {sorted(POLICIES)}"
        )
    if cfg.policy == "uniform":
        return Uniform(cfg.max_times_sampled, seed=seed)
    if cfg.max_times_sampled != 1:
        raise ValueError(
            f"buffer.max_times_sampled={cfg.max_times_sampled} has no effect with policy "
            f"{cfg.policy!r} (each sample is served once); set buffer.policy=uniform to reuse samples, "
            "or leave max_times_sampled at 1"
        )
    return POLICIES[cfg.policy]()
