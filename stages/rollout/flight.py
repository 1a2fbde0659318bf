"""A group in flight in the generator: its bookkeeping (`Flight`) and the engine as its generate_fn reaches
it (`SendingEngine`), which gives back the group's reserved request places as its requests are sent."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

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
    # rollout.partial_rollout: set to end its requests with their tokens so far (partial.py), not cancel
    interrupt: threading.Event = field(default_factory=threading.Event)
    recycles: int = 0  # times it was interrupted and continued (partial.py)

    def recycle(self, version: int) -> None:
        """Start its next attempt, continuing from its tokens so far, at engine `version`: the staleness
        check counts from there, with a fresh interrupt for its requests."""
        self.start_version, self.aborting, self.generating = version, False, True
        self.interrupt = threading.Event()
        self.recycles += 1


class SendingEngine:
    """The engine as one group's generate_fn reaches it: each call first tells `sent` how many requests
    it sends. Engines count a request from the moment generate() is called, so the group's reserved
    places (its Flight.unsent) and the engine's count change in the same step, and admission never
    sees the engine emptier than it is between a group's start and its first send. With `flight`
    (rollout.partial_rollout), each request carries the flight's current interrupt."""

    def __init__(self, engine: Engine, sent: Callable[[int], None], flight: Flight | None = None):
        self._engine, self._sent, self._flight = engine, sent, flight

    @property
    def version(self) -> int:
        return self._engine.version

    async def generate(self, requests):
        self._sent(len(requests))
        if self._flight is not None:
            for r in requests:
                r.interrupt = self._flight.interrupt
        return await self._engine.generate(requests)

    def __getattr__(self, name: str):
        if name == "_engine":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._engine, name)
