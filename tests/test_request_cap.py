"""The generator's request cap (rollout.max_inflight_requests): the engines count each request until
its own answer, and the generator starts new groups as sequences finish, never past the cap. With a
long length tail this is what keeps an engine full (issue #17's engine utilisation)."""

from __future__ import annotations

import asyncio

import pytest

from stages.rollout.build import build_engine
from stages.rollout.engine import Engine, GenRequest, GenResult, SamplingParams
from stages.rollout.generator import Generator
from stages.rollout.sglang_engine import SGLangEngine
from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args


class TailEngine(Engine):
    """Answers each request after a delay: the first request of every group is the slow tail. Counts
    requests in flight one by one, as the real engines do, and records the most it ever held."""

    def __init__(self, fast_s: float = 0.005, tail_s: float = 0.3):
        self.fast_s, self.tail_s = fast_s, tail_s
        self.open = self.peak = 0

    async def generate(self, requests):
        self.open += len(requests)  # from the call on, before any await, as Engine asks
        self.peak = max(self.peak, self.open)
        return list(await asyncio.gather(*(self._one(i, r) for i, r in enumerate(requests))))

    async def _one(self, i, req):
        try:
            await asyncio.sleep(self.tail_s if i == 0 else self.fast_s)
        finally:
            self.open -= 1
        return GenResult(
            rid=req.rid, response_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="length"
        )

    def requests_in_flight(self) -> int:
        return self.open

    def update_weights(self, named_tensors, version):
        pass

    @property
    def version(self) -> int:
        return 0


def _run(gen: Generator, max_groups: int) -> tuple[dict, int]:
    """Run the generator; its stats and the most groups it had in flight at once (sampled)."""
    seen: list[int] = []

    async def watch():
        while True:
            seen.append(gen._running)
            await asyncio.sleep(0.002)

    async def go():
        w = asyncio.create_task(watch())
        try:
            return await gen.run(max_groups=max_groups)
        finally:
            w.cancel()

    return asyncio.run(go()), max(seen)


def test_the_request_cap_holds_and_groups_refill_as_their_sequences_finish(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=16, max_inflight_requests=8)
    engine = TailEngine()
    stats, peak_groups = _run(
        Generator(*rollout_args(cfg), FakeSink(), engine, "cap", batch_groups=0), max_groups=12
    )
    assert stats["groups_finished"] == 12
    # never more than the cap, not even in the first burst, when no group has sent its requests yet
    assert engine.peak <= 8, engine.peak
    # a group whose last sequence is decoding holds one request place, not four: while the tails run,
    # more than 8 / 4 groups are in flight
    assert peak_groups >= 4, peak_groups


def test_without_a_request_cap_the_group_cap_alone_bounds_them(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=2)
    engine = TailEngine()
    stats, peak_groups = _run(
        Generator(*rollout_args(cfg), FakeSink(), engine, "nocap", batch_groups=0), max_groups=6
    )
    assert stats["groups_finished"] == 6 and peak_groups == 2 and engine.peak <= 8


def test_a_request_cap_below_the_group_size_is_refused_naming_both(tmp_path_factory):
    with pytest.raises(ValueError, match=r"max_inflight_requests=3 is below rollout.group_size=4"):
        make_cfg(tmp_path_factory, max_inflight_requests=3)


def test_the_torch_engine_counts_each_request_until_its_answer(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4, max_inflight_requests=4)
    engine = build_engine(*rollout_args(cfg))
    peaks: list[int] = []

    async def go():
        gen = Generator(*rollout_args(cfg), FakeSink(), engine, "torch", batch_groups=0)

        async def watch():
            while True:
                peaks.append(engine.requests_in_flight())
                await asyncio.sleep(0.001)

        w = asyncio.create_task(watch())
        try:
            return await gen.run(max_groups=5)
        finally:
            w.cancel()

    try:
        stats = asyncio.run(go())
    finally:
        engine.close()
    assert stats["groups_finished"] == 5 and stats["requests_in_flight"] == 0
    assert max(peaks) == 4  # one group's four requests at a time: the cap of 4 admits no second group
    assert engine.requests_in_flight() == 0


def test_sglang_engine_releases_each_request_when_its_answer_is_in(monkeypatch, tmp_path):
    """The HTTP exchange is stubbed; what is tested is SGLangEngine.generate's accounting (and with it
    the busy time the pipeline reports): a group's answered requests stop counting before its tail."""
    pytest.importorskip("aiohttp")
    eng = SGLangEngine(str(tmp_path), start=False)

    async def go():
        release = asyncio.Event()

        async def one(session, req, start_v):
            if req.rid == "tail":
                await release.wait()
            return GenResult(
                rid=req.rid, response_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop"
            )

        monkeypatch.setattr(eng, "_generate_one", one)
        reqs = [GenRequest(prompt_ids=[1], params=SamplingParams(), rid=r) for r in ("tail", "a", "b", "c")]
        task = asyncio.create_task(eng.generate(reqs))
        for _ in range(100):
            await asyncio.sleep(0.001)
            if eng.requests_in_flight() == 1:
                break
        counted_during_tail = eng.requests_in_flight()
        busy_during_tail = eng.stats()["busy_s"]
        release.set()
        out = await task
        return counted_during_tail, busy_during_tail, out

    counted, busy, out = asyncio.run(go())
    assert counted == 1, "the three answered requests must leave the count while the tail decodes"
    assert [r.rid for r in out] == ["tail", "a", "b", "c"]
    assert eng.requests_in_flight() == 0 and busy > 0
    assert eng.stats()["idle_s"] >= 0


def test_an_engine_pool_sums_its_engines_requests():
    from stages.rollout.engine_pool import EnginePool

    class Counted:
        def __init__(self, n):
            self.n = n

        def requests_in_flight(self):
            return self.n

    assert EnginePool([Counted(3), Counted(5)]).requests_in_flight() == 8


def test_sglang_engine_gives_back_the_requests_of_a_batch_cancelled_before_they_ran(monkeypatch, tmp_path):
    """A group aborted right after it sent its requests: their tasks are cancelled before their first
    step, and the engine must still stop counting them (else the cap shrinks for good)."""
    pytest.importorskip("aiohttp")
    eng = SGLangEngine(str(tmp_path), start=False)

    async def one(session, req, start_v):
        await asyncio.sleep(30)

    monkeypatch.setattr(eng, "_generate_one", one)

    async def go():
        reqs = [GenRequest(prompt_ids=[1], params=SamplingParams(), rid=str(i)) for i in range(4)]
        task = asyncio.create_task(eng.generate(reqs))
        await asyncio.sleep(0)  # generate() ran up to its gather: the request tasks have not run yet
        assert eng.requests_in_flight() == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):
            await asyncio.sleep(0)
        return eng.requests_in_flight()

    assert asyncio.run(go()) == 0


def test_an_engine_pool_counts_a_share_until_its_engine_counts_it():
    """Two engines: each share is handed over a loop step later; the pool counts it meanwhile, and gives
    back the count of a share cancelled before it was handed over."""
    from stages.rollout.engine_pool import EnginePool

    class Counting:
        def __init__(self):
            self.open, self.outstanding, self.release = 0, 0, None

        def available(self):
            return True

        def requests_in_flight(self):
            return self.open

        async def generate(self, requests):
            self.open += len(requests)
            try:
                await self.release.wait()
            finally:
                self.open -= len(requests)
            return [
                GenResult(rid=r.rid, response_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
                for r in requests
            ]

    engines = [Counting(), Counting()]
    pool = EnginePool(engines)

    async def go():
        for e in engines:
            e.release = asyncio.Event()
        reqs = [GenRequest(prompt_ids=[1], params=SamplingParams(), rid=str(i)) for i in range(4)]
        task = asyncio.create_task(pool.generate(reqs))
        await asyncio.sleep(0)  # the pool split the batch; neither engine's generate() has run
        before = pool.requests_in_flight()
        await asyncio.sleep(0.01)
        handed = pool.requests_in_flight(), [e.open for e in engines]
        for e in engines:
            e.release.set()
        await task
        cancelled = asyncio.create_task(pool.generate(reqs))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        for _ in range(3):
            await asyncio.sleep(0)
        return before, handed, pool.requests_in_flight()

    before, handed, after = asyncio.run(go())
    assert before == 4 and handed == (4, [2, 2]) and after == 0


def test_the_torch_engine_drops_a_cancelled_request_and_counts_it_until_then(tmp_path_factory):
    """An aborted group's requests: the torch engine drops them at its next step (never prefilled when
    still queued) and counts them as in flight until it has, so the cap never admits past what it
    really decodes."""
    cfg = make_cfg(tmp_path_factory)
    engine = build_engine(*rollout_args(cfg))

    async def go():
        params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        reqs = [GenRequest(prompt_ids=[1, 2, 3], params=params, rid=str(i)) for i in range(4)]
        tokens_before = engine.stats()["tokens"]
        # paused (as for a weight update), the engine cannot drop them before the count is read: on a
        # busy box its thread did so at once and the count read 0, a race of the test, not the engine
        engine.pause()
        task = asyncio.create_task(engine.generate(reqs))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        still = engine.requests_in_flight()
        engine.resume()
        for _ in range(500):
            if engine.requests_in_flight() == 0:
                break
            await asyncio.sleep(0.01)
        return still, engine.requests_in_flight(), engine.stats()["tokens"] - tokens_before

    try:
        still, after, decoded = asyncio.run(go())
    finally:
        engine.close()
    assert still == 4 and after == 0
    assert decoded < 4 * 64, f"{decoded} tokens: the cancelled requests were decoded to their end"
