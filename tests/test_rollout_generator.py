"""The generator loop: streaming groups, staleness admission under a slow trainer, failures, filters,
and a real BufferServer over ZeroMQ."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from buffer import wire
from buffer.record import Sample, Status
from pipeline.config import from_dict
from stages.reward.registry import register_reward
from stages.rollout.build import build_engine
from stages.rollout.generator import Generator
from stages.rollout.run import RolloutRun

torch.set_num_threads(1)


def make_cfg(tmp_path_factory, **rollout):
    cache = str(tmp_path_factory.getbasetemp() / "models")
    tree = {
        "model": {"cache_dir": cache},
        "run": {"max_staleness": 1},
        "rollout": {
            "group_size": 4,
            "max_inflight_groups": 4,
            "chunk_tokens": 4,
            "sampling": {"max_new_tokens": 6},
            **rollout,
        },
    }
    return from_dict(tree)


def rollout_args(cfg) -> tuple:
    """A run config's rollout section, model section and RolloutRun: what Generator and build_engine take
    (the launcher makes them the same way)."""
    run = RolloutRun(
        seed=cfg.run.seed, max_staleness=cfg.run.max_staleness, routing_replay=cfg.trainer.routing_replay
    )
    return cfg.rollout, cfg.model, run


class FakeSink:
    """Collects groups; acks report `trainer_version`, which a FakeTrainer advances."""

    def __init__(self):
        self.groups: dict[str, list[Sample]] = {}
        self.order: list[str] = []
        self.trainer_version = 0
        self.lock = threading.Lock()

    def put(self, samples: list[Sample], timeout_s: float = 60.0) -> wire.IngestAck:
        with self.lock:
            for s in samples:
                s.validate()
                self.groups.setdefault(s.group_id, []).append(s)
            self.order.append(samples[0].group_id)
            v = self.trainer_version
        return wire.IngestAck(seq=0, accepted=len(samples), duplicates=0, rejected=0, trainer_version=v)

    def close(self):
        pass


class FakeTrainer(threading.Thread):
    """Consumes `batch_groups` groups per step in the order they were started, slowly, records the
    staleness of every sample it trains on, then pushes (empty) weights to the engine as version+1."""

    def __init__(self, sink: FakeSink, engine, batch_groups: int, gen_id: str, step_s: float):
        super().__init__(daemon=True)
        self.sink, self.engine, self.b, self.gen_id, self.step_s = sink, engine, batch_groups, gen_id, step_s
        self.next_group, self.staleness, self.stop = 0, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            time.sleep(self.step_s)
            wanted = [f"{self.gen_id}-{k}" for k in range(self.next_group, self.next_group + self.b)]
            with self.sink.lock:
                if not all(g in self.sink.groups and len(self.sink.groups[g]) == 4 for g in wanted):
                    continue
                t = self.sink.trainer_version
                self.staleness += [t - s.min_version() for g in wanted for s in self.sink.groups[g]]
            self.next_group += self.b
            self.engine.update_weights([], version=t + 1)
            with self.sink.lock:
                self.sink.trainer_version = t + 1


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return make_cfg(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(cfg):
    eng = build_engine(*rollout_args(cfg))
    yield eng
    eng.close()


def test_streams_scored_groups(cfg, engine):
    sink = FakeSink()
    gen = Generator(*rollout_args(cfg), sink, engine, "g0", batch_groups=0)
    stats = asyncio.run(gen.run(max_groups=6))
    assert stats["groups_started"] == stats["groups_finished"] == 6 and stats["samples"] == 24
    assert len(sink.order) == 6  # one put per group, as each finished
    for gid, samples in sink.groups.items():
        assert sorted(s.group_index for s in samples) == [0, 1, 2, 3]
        assert {s.uid for s in samples} == {f"{gid}-{i}" for i in range(4)}
        for s in samples:
            assert s.prompt.startswith("<|im_start|>") and s.label.isdigit()
            assert 0.0 <= s.reward <= 1.0 and s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert (
                s.response_len == len(s.array("rollout_logprobs"))
                and (s.array("rollout_logprobs") <= 0).all()
            )
    assert gen.state_dict()["group_counter"] == 6


def test_staleness_admission_under_slow_trainer(cfg, engine):
    sink = FakeSink()
    engine.update_weights([], version=0)
    gen = Generator(*rollout_args(cfg), sink, engine, "slow", batch_groups=2)
    trainer = FakeTrainer(sink, engine, batch_groups=2, gen_id="slow", step_s=0.05)
    trainer.start()
    try:
        stats = asyncio.run(gen.run(max_groups=16))
        deadline = time.time() + 30
        while trainer.next_group < 16 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        trainer.stop.set()
        trainer.join()
    assert trainer.next_group == 16, "the fake trainer could not consume every group"
    assert max(trainer.staleness) <= cfg.run.max_staleness, trainer.staleness
    assert stats["admission_waits"] > 0, "a slow trainer must hold the generator back"


def test_raising_reward_fails_sample_and_continues(tmp_path_factory, engine):
    calls = []

    def flaky(sample, response):
        calls.append(sample.uid)
        if sample.group_index == 1:
            raise RuntimeError("verifier crashed")
        return {"reward": 0.5, "fmt": 1.0}

    register_reward("test_flaky", flaky)
    cfg = make_cfg(tmp_path_factory, reward={"fn": "test_flaky"})
    sink = FakeSink()
    stats = asyncio.run(
        Generator(*rollout_args(cfg), sink, engine, "flaky", batch_groups=0).run(max_groups=3)
    )
    assert stats["groups_finished"] == 3 and stats["samples_failed"] == 3 and len(calls) == 12
    for samples in sink.groups.values():
        for s in samples:
            if s.group_index == 1:
                assert s.status == Status.FAILED and "verifier crashed" in s.error and s.reward == 0.0
            else:
                assert s.reward == 0.5 and s.reward_parts == {"reward": 0.5, "fmt": 1.0}


def test_custom_async_reward_by_module_path(tmp_path_factory, engine, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "async def length_reward(sample, response):\n    return float(sample.response_len)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(tmp_path_factory, reward={"fn": "my_rewards:length_reward"})
    sink = FakeSink()
    asyncio.run(Generator(*rollout_args(cfg), sink, engine, "mod", batch_groups=0).run(max_groups=2))
    for samples in sink.groups.values():
        assert all(s.reward == s.response_len for s in samples)


def test_engine_error_fails_group_and_retries(cfg, engine):
    class Flaky:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0
            self.version, self.stats = inner.version, inner.stats
            self.requests_in_flight, self.available = inner.requests_in_flight, inner.available
            self.version_and_relaunches = inner.version_and_relaunches

        async def generate(self, reqs):
            self.calls += 1
            if self.calls in (1, 2, 4):  # group 1 fails twice (retry exhausted); group 2 recovers
                raise RuntimeError("engine down")
            return await self.inner.generate(reqs)

    cfg1 = msgspec_replace(cfg, engine_retries=1, max_inflight_groups=1)
    sink = FakeSink()
    flaky = Flaky(engine)
    stats = asyncio.run(Generator(*rollout_args(cfg1), sink, flaky, "err", batch_groups=0).run(max_groups=3))
    assert stats["groups_failed"] == 1 and stats["engine_errors"] == 3 and stats["groups_finished"] == 2


def test_filter_drops_uniform_groups(cfg, engine):
    cfg1 = msgspec_replace(cfg, filter="nonzero_std")
    sink = FakeSink()
    gen = Generator(
        *rollout_args(cfg1),
        sink,
        engine,
        "flt",
        batch_groups=0,
        group_filter=lambda s: s[0].group_id != "flt-0",
    )
    stats = asyncio.run(gen.run(max_groups=3))
    assert stats["groups_filtered"] == 1 and "flt-0" not in sink.groups and len(sink.groups) == 2


def test_streams_to_real_buffer_server(cfg, engine, tmp_path):
    buffer_server = pytest.importorskip("buffer.server")
    from buffer.client import BufferClient
    from buffer.config import BufferConfig

    server = buffer_server.BufferServer(BufferConfig(durable=False), tmp_path / "buf").start()
    client = BufferClient(server.address, producer="gen-real", timeout_s=30)
    try:
        client.set_version(3)
        engine.update_weights([], version=3)  # the engine runs the announced trainer's weights
        gen = Generator(*rollout_args(cfg), client, engine, "real", batch_groups=0)
        stats = asyncio.run(gen.run(max_groups=4))
        assert stats["groups_finished"] == 4 and stats["trainer_version"] >= 3
        batch = client.fetch(
            num_groups=4, version=3, max_staleness=100, timeout_s=10
        )  # the announced version
        assert batch is not None and batch.num_rows == 16
        assert set(batch.column("generator_id").to_pylist()) == {"real"}
    finally:
        client.close()
        server.stop()


def msgspec_replace(cfg, **rollout):
    import msgspec

    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, **rollout))


class EvictingSink(FakeSink):
    """A buffer that evicted `evicted` of this generator's groups and whose trainer never advances."""

    def __init__(self, evicted: int):
        super().__init__()
        self.evicted = evicted

    def evicted_groups(self, producer: str) -> int:
        return self.evicted if producer == "gen-evict" else 0


async def started_when_settled(gen, expect: int | None = None, quiet_s: float = 0.5, timeout_s: float = 15.0):
    """The generator's groups started, once `expect` of them are (when given) and then no more for
    `quiet_s`. Admission answers a poke at once, so a group it wrongly lets through starts well within
    that; waiting for the count instead of a fixed time keeps these tests short on a quiet box and right
    on a loaded one."""
    deadline = time.monotonic() + timeout_s
    while expect is not None and gen.counters["groups_started"] < expect and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(quiet_s)
    return gen.counters["groups_started"]


def test_evicted_groups_free_their_admission_places(cfg, engine):
    # engine version 0, batch 2: admission allows (0 + max_staleness + 1) * 2 pending groups. When the
    # buffer evicted 3 of them as too stale (they will never be trained on), 3 more may start.
    engine.update_weights([], version=0)
    window = (cfg.run.max_staleness + 1) * 2

    async def run(sink, expect):
        gen = Generator(*rollout_args(cfg), sink, engine, "gen-evict", batch_groups=2)
        task = asyncio.create_task(gen.run())
        await started_when_settled(gen, expect)  # the buffer is asked every EVICTED_POLL_S meanwhile
        gen.stop()
        await asyncio.wait_for(task, 30)
        return gen.stats()

    assert asyncio.run(run(FakeSink(), window))["groups_started"] == window
    stats = asyncio.run(run(EvictingSink(evicted=3), window + 3))
    assert stats["groups_evicted"] == 3 and stats["groups_started"] == window + 3


def test_a_generator_held_back_for_long_says_why(cfg, engine, monkeypatch, caplog):
    import logging

    import stages.rollout.generator as generator_module

    monkeypatch.setattr(generator_module, "HELD_BACK_WARN_S", 0.3)
    engine.update_weights([], version=0)

    async def run():
        gen = Generator(
            *rollout_args(cfg), FakeSink(), engine, "lonely", batch_groups=1
        )  # no trainer ever consumes
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(2.0)
        gen.stop()
        await asyncio.wait_for(task, 30)

    with caplog.at_level(logging.WARNING, logger=generator_module.log.name):
        asyncio.run(run())
    assert any(
        "no new group for" in r.message and "check that a trainer is running" in r.message
        for r in caplog.records
    )


def test_a_generator_that_keeps_admitting_does_not_warn(cfg, engine, monkeypatch, caplog):
    """Held back between versions but admitting groups every time weights move on: a normal run,
    no "no new group" warning (it used to fire when the stretches were less than 1 s apart)."""
    import logging

    import stages.rollout.generator as generator_module

    monkeypatch.setattr(generator_module, "HELD_BACK_WARN_S", 0.3)
    engine.update_weights([], version=0)

    async def run():
        gen = Generator(*rollout_args(cfg), FakeSink(), engine, "busy", batch_groups=1)
        task = asyncio.create_task(gen.run())
        for v in range(1, 16):  # a trainer pushing every 0.1 s: each push admits one more group
            await asyncio.sleep(0.1)
            engine.update_weights([], version=v)
        gen.stop()
        await asyncio.wait_for(task, 30)
        return gen.counters["groups_started"]

    with caplog.at_level(logging.WARNING, logger=generator_module.log.name):
        started = asyncio.run(run())
    assert started >= 10  # it did keep admitting
    assert not any("no new group for" in r.message for r in caplog.records)


def test_weights_that_go_back_reopen_admission(cfg, engine):
    """A trainer restarted from its checkpoint pushes older weights. The groups its lost steps consumed
    still count as kept; without a fresh count admission stays shut until the engine passes the old
    version again, which it never does (the new trainer starves). Before: 0 groups after the rollback."""
    window = (cfg.run.max_staleness + 1) * 2

    async def run():
        engine.update_weights([], version=5)  # 5 versions trained: room for (5 + s + 1) * 2 groups
        gen = Generator(*rollout_args(cfg), FakeSink(), engine, "gen-back", batch_groups=2)
        task = asyncio.create_task(gen.run())
        first = await started_when_settled(gen, (5 + cfg.run.max_staleness + 1) * 2)
        engine.update_weights([], version=2)  # the restarted trainer's checkpoint
        gen._poke()
        await started_when_settled(gen, first + window)
        gen.stop()
        await asyncio.wait_for(task, 30)
        return first, gen.stats()["groups_started"]

    first, total = asyncio.run(run())
    assert first == (5 + cfg.run.max_staleness + 1) * 2
    assert total - first == window  # the window of the new trainer, from version 2 on


def _relaunch_run(cfg, engine, monkeypatch, gen_id: str, pushed_after: int) -> tuple[int, int, int]:
    """Groups started: at version 5 (window full, nothing consumed), during a relaunch that left the
    engine at version 0, and after the trainer then pushed `pushed_after`."""
    relaunched = [0]
    monkeypatch.setattr(engine, "version_and_relaunches", lambda: (engine.version, relaunched[0]))

    window = (cfg.run.max_staleness + 1) * 2

    async def run():
        engine.update_weights([], version=5)
        gen = Generator(*rollout_args(cfg), FakeSink(), engine, gen_id, batch_groups=2)
        task = asyncio.create_task(gen.run())
        first = await started_when_settled(gen, (5 + cfg.run.max_staleness + 1) * 2)
        relaunched[0] += 1  # the engine watch relaunched the server from the base model
        engine.update_weights([], version=0)
        gen._poke()
        during = await started_when_settled(gen)  # nothing is expected to start: a quiet period
        engine.update_weights([], version=pushed_after)
        gen._poke()
        # a trainer gone back (an older version than before the relaunch) opens a window from there
        await started_when_settled(gen, first + window if pushed_after < 5 else None)
        gen.stop()
        await asyncio.wait_for(task, 30)
        return first, during, gen.stats()["groups_started"]

    return asyncio.run(run())


def test_a_relaunched_engine_starts_nothing_until_caught_up_and_then_nothing_floods_in(
    cfg, engine, monkeypatch
):
    """A relaunched server runs the base model (version 0) until the trainer, still at 5, pushes it the
    current weights again. Groups started on it would be too stale, and the dip is no trainer going
    back. Before: it was taken for one, a window opened at 0, and once caught up the whole window of
    version 5 opened on top (a flood of groups the buffer evicts: 1,040 on an H100 in sync mode)."""
    first, during, total = _relaunch_run(cfg, engine, monkeypatch, "gen-relaunch", pushed_after=5)
    assert first == (5 + cfg.run.max_staleness + 1) * 2
    assert during == first and total == first


def test_a_trainer_that_went_back_during_a_relaunch_still_reopens_admission(cfg, engine, monkeypatch):
    """The relaunch dip ends with a push of older weights than before it (the trainer restarted from
    its checkpoint meanwhile): that is a trainer going back, and its window opens from there."""
    first, during, total = _relaunch_run(cfg, engine, monkeypatch, "gen-relaunch-back", pushed_after=2)
    assert during == first
    assert total - first == (cfg.run.max_staleness + 1) * 2
