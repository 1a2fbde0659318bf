"""rollout.abort_stale_groups: a group still generating once it can no longer be trained within
run.max_staleness is cancelled (its requests closed) so the engine decodes something else; the buffer
would have evicted it on arrival. Exactly at the bound it goes on."""

from __future__ import annotations

import asyncio

from stages.rollout.engine import Engine, GenResult
from stages.rollout.generator import Generator
from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args


class OneLongGroup(Engine):
    """The first group's requests take `long_s`, the others 10 ms; counts requests cancelled."""

    def __init__(self, long_s: float):
        self.long_s, self._version = long_s, 0
        self.calls = self.cancelled = 0

    async def generate(self, requests):
        first = self.calls == 0
        self.calls += 1
        try:
            await asyncio.sleep(self.long_s if first else 0.01)
        except asyncio.CancelledError:
            self.cancelled += len(requests)
            raise
        return [
            GenResult(
                rid=r.rid, response_ids=[5], logprobs=[-1.0], versions=[self._version], finish_reason="stop"
            )
            for r in requests
        ]

    def update_weights(self, named_tensors, version):
        self._version = version

    @property
    def version(self) -> int:
        return self._version


def _run(cfg, engine, versions: list[tuple[float, int]]):
    """Run 6 groups (batch_groups 2, so admission allows them all by version 2) while the engine's
    version moves as `versions` says ((delay, version) pairs); returns stats, sink, and whether the
    first group was still in flight after each move."""
    sink = FakeSink()
    gen = Generator(*rollout_args(cfg), sink, engine, "g", batch_groups=2)
    seen = []

    async def move():
        for delay, v in versions:
            await asyncio.sleep(delay)
            engine.update_weights([], v)
            await asyncio.sleep(0.1)
            seen.append("g-0" in gen._flights)

    async def go():
        mover = asyncio.create_task(move())
        stats = await gen.run(max_groups=6)
        await mover
        return stats

    return asyncio.run(go()), sink, seen


def test_a_group_past_the_staleness_bound_is_aborted_and_one_at_it_goes_on(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4)  # run.max_staleness = 1
    engine = OneLongGroup(long_s=30.0)
    stats, sink, seen = _run(cfg, engine, [(0.1, 1), (0.1, 2)])
    # at version 1 the group started at 0 is at the bound (1 - 0 = 1): still generating
    # at version 2 it is past it: cancelled, its four requests closed, its admission place freed
    assert seen == [True, False]
    assert stats["groups_aborted_stale"] == 1 and engine.cancelled == 4
    assert stats["groups_finished"] == 5 and "g-0" not in sink.groups


def test_with_abort_stale_groups_off_the_group_is_left_to_the_buffer(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4, abort_stale_groups=False)
    engine = OneLongGroup(long_s=0.5)
    stats, sink, seen = _run(cfg, engine, [(0.1, 2)])
    assert stats["groups_aborted_stale"] == 0 and engine.cancelled == 0
    assert stats["groups_finished"] == 6 and "g-0" in sink.groups


def test_a_group_aborted_before_it_first_ran_gives_its_places_back(tmp_path_factory):
    """A push that lands between a group's start and its first step makes it stale at once: its task
    is cancelled before it ever ran. Its group and request places must come back all the same."""
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4, max_inflight_requests=8)
    engine = OneLongGroup(long_s=30.0)
    gen = Generator(*rollout_args(cfg), FakeSink(), engine, "g", batch_groups=2)

    async def go():
        gen._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        gen._launch(tasks)
        engine.update_weights([], 2)  # the push thread, before the task's first step
        gen._abort_stale_groups()
        for _ in range(3):
            await asyncio.sleep(0)
        return tasks

    tasks = asyncio.run(go())
    assert not tasks and gen.counters["groups_aborted_stale"] == 1 and engine.calls == 0
    assert gen._running == 0 and gen._unsent == 0 and gen._has_room()
