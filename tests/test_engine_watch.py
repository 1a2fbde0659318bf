"""The generator's engine watch: a server that fails its health check is restarted while generation
goes on, and the pool sends no new requests to an engine being restarted (stubs stand in for the
SGLang servers; the restart itself is SGLangEngine.restart, run on GPUs in tests/test_gpu_sglang.py)."""

from __future__ import annotations

import asyncio

import pytest

from stages.rollout.engine import GenRequest, GenResult, SamplingParams
from stages.rollout.engine_pool import EnginePool
from stages.rollout.engine_watch import EngineWatch


class StubEngine:
    def __init__(self, name, healthy=True):
        self.name, self.healthy, self.restarting = name, healthy, False
        self.outstanding, self.restarts, self.served = 0, 0, 0

    def check_health(self):
        return self.healthy

    def available(self):
        return not self.restarting

    def restart(self):
        self.restarts += 1
        self.healthy = True
        return 0.0

    async def generate(self, requests):
        self.served += len(requests)
        return [
            GenResult(rid=r.rid, response_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
            for r in requests
        ]


def test_an_unhealthy_engine_is_restarted_and_counted():
    dead, fine = StubEngine("a", healthy=False), StubEngine("b")
    watch = EngineWatch(EnginePool([dead, fine]), interval_s=0.01)

    async def go():
        task = asyncio.create_task(watch.run())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if watch.restarts:
                break
        task.cancel()

    asyncio.run(go())
    watch.close()
    assert (dead.restarts, fine.restarts, watch.restarts) == (1, 0, 1)
    assert watch.checks >= 1


def test_the_pool_routes_around_a_restarting_engine():
    busy, restarting = StubEngine("a"), StubEngine("b")
    busy.outstanding, restarting.restarting = 5, True  # by load alone every request would go to b
    pool = EnginePool([busy, restarting])
    reqs = [
        GenRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=1), rid=str(i)) for i in range(4)
    ]
    asyncio.run(pool.generate(reqs))
    assert (busy.served, restarting.served) == (4, 0)
    busy.restarting = True  # every engine restarting: requests still go somewhere (and fail or wait there)
    asyncio.run(pool.generate(reqs))
    assert busy.served + restarting.served == 8


def test_a_watch_needs_an_interval():
    with pytest.raises(ValueError, match="health_check_s"):
        EngineWatch(EnginePool([StubEngine("a")]), interval_s=0)
