"""A group in flight in the generator: its bookkeeping (`Flight`) and the engine as its generate_fn reaches
it (`SendingEngine`), which gives back the group's reserved request places as its requests are sent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from stages.rollout.engine import Engine


@dataclass(eq=False)
class Flight:
    """A group run() started: its task, the engine version its current attempt started at (for
    abort_stale_groups), and its request places not yet sent to the engine (the request cap)."""

    start_version: int
    unsent: int
    task: asyncio.Task | None = None
    generating: bool = True  # False once its samples are made: past aborting
    aborting: bool = False


class SendingEngine:
    """The engine as one group's generate_fn reaches it: each call first tells `sent` how many requests
    it sends. Engines count a request from the moment generate() is called, so the group's reserved
    places (its Flight.unsent) and the engine's count change in the same step, and admission never
    sees the engine emptier than it is between a group's start and its first send."""

    def __init__(self, engine: Engine, sent: Callable[[int], None]):
        self._engine, self._sent = engine, sent

    @property
    def version(self) -> int:
        return self._engine.version

    async def generate(self, requests):
        self._sent(len(requests))
        return await self._engine.generate(requests)

    def __getattr__(self, name: str):
        if name == "_engine":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._engine, name)
