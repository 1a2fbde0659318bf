"""A generator whose engine goes down (an SGLang server killed, then relaunched by the engine watch)
starts no group and retries none until the engine is back, instead of failing group after group in a
hot loop that burns the dataset, floods the log and starves the relaunch of CPU."""

from __future__ import annotations

import asyncio

import pytest

from buffer.net import free_port
from stages.rollout.engine import Engine, GenRequest, GenResult, SamplingParams
from stages.rollout.generator import Generator
from stages.rollout.sglang_engine import EngineError, SGLangEngine
from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args


class DyingEngine(Engine):
    """Answers after `latency_s`; while `down`, every request fails at once and in-flight ones fail
    when they would have answered, as with a server that was killed."""

    def __init__(self, latency_s: float = 0.02):
        self.latency_s, self.down = latency_s, False
        self.calls = self.calls_while_down = 0

    async def generate(self, requests):
        self.calls += 1
        if self.down:
            self.calls_while_down += 1
            raise EngineError("connection refused")
        await asyncio.sleep(self.latency_s)
        if self.down:
            raise EngineError("server disconnected")
        return [
            GenResult(
                rid=r.rid, response_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="length"
            )
            for r in requests
        ]

    def available(self) -> bool:
        return not self.down

    def update_weights(self, named_tensors, version):
        pass

    @property
    def version(self) -> int:
        return 0


def test_no_group_starts_or_retries_while_the_engine_is_down(tmp_path_factory, caplog):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4, engine_retries=1)
    engine = DyingEngine()
    gen = Generator(*rollout_args(cfg), FakeSink(), engine, "down", batch_groups=0)

    async def kill_and_relaunch():
        await asyncio.sleep(0.1)
        engine.down = True
        await asyncio.sleep(0.6)  # the relaunch
        engine.down = False

    async def go():
        outage = asyncio.create_task(kill_and_relaunch())
        stats = await gen.run(max_groups=30)
        await outage
        return stats

    with caplog.at_level("WARNING"):
        stats = asyncio.run(go())
    # the groups in flight when it died are retried once it is back, and succeed: nothing is lost
    assert stats["groups_finished"] == 30 and stats["groups_failed"] == 0, stats
    # no request is sent to a dead engine: at 20 ms a group, a hot loop would make hundreds
    assert engine.calls_while_down == 0, engine.calls_while_down
    assert stats["engine_errors"] <= 4  # at most the groups that were in flight at the kill
    assert "the engine is down" in caplog.text and "the engine is back" in caplog.text


def test_a_retry_waits_for_the_engine_only_as_long_as_a_relaunch_may_take(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=1, engine_retries=1)
    engine = DyingEngine(latency_s=0.05)
    gen = Generator(*rollout_args(cfg), FakeSink(), engine, "never", batch_groups=0)
    gen._engine_down_wait_s = 0.3  # rollout.sglang.startup_timeout_s + 2 x health_check_s, shortened

    async def go():
        async def die():
            await asyncio.sleep(0.02)
            engine.down = True  # and never back

        task = asyncio.create_task(die())
        stop = asyncio.Event()
        run = asyncio.create_task(gen.run(stop_event=stop, max_groups=1))
        await asyncio.sleep(1.0)
        stop.set()
        await task
        return await asyncio.wait_for(run, 5)

    stats = asyncio.run(go())
    # the group in flight gave up after the wait and its retry, and counts as failed; it did not hang
    assert stats["groups_failed"] == 1 and stats["groups_finished"] == 0, stats


def test_a_server_that_cannot_be_reached_is_marked_unavailable(tmp_path):
    pytest.importorskip("aiohttp")
    eng = SGLangEngine(str(tmp_path), start=False, port=free_port())  # nothing listens there
    assert eng.available()
    req = GenRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=2), rid="r")
    with pytest.raises(EngineError, match="/generate failed"):
        asyncio.run(eng.generate([req]))
    assert not eng.available() and eng.requests_in_flight() == 0


def test_a_retry_after_a_relaunch_is_judged_by_its_own_start(tmp_path_factory):
    """The server dies under a group and comes back re-synced to a newer version: the group's retry
    makes fresh tokens, so abort_stale_groups must judge it by the retry's start, not the first try's."""
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=1, engine_retries=1)  # run.max_staleness = 1

    class Versioned(DyingEngine):
        v = 0

        @property
        def version(self) -> int:
            return self.v

    engine = Versioned(latency_s=0.1)
    gen = Generator(*rollout_args(cfg), FakeSink(), engine, "relaunch", batch_groups=2)

    async def go():
        async def die_and_come_back_newer():
            await asyncio.sleep(0.03)
            engine.down = True
            await asyncio.sleep(0.2)
            engine.v = 3  # the catch-up push after the relaunch
            engine.down = False

        outage = asyncio.create_task(die_and_come_back_newer())
        stats = await gen.run(max_groups=2)
        await outage
        return stats

    stats = asyncio.run(go())
    assert stats["groups_aborted_stale"] == 0 and stats["groups_finished"] == 2, stats
