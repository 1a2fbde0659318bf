"""A relaunched SGLang server runs older weights (often the base model's) until the trainer pushes it the
current ones. The generator must not take that dip for a trainer gone back to its checkpoint: that
reopens admission at the old version (groups too stale to train) and, once the server is caught up, the
whole window of the current version on top (on an H100, a sync run would have started 1,040 groups at
once). It tells the two apart by the relaunch counted together with the version
(`Engine.version_and_relaunches`), which holds in a pool too, where the other engines keep serving."""

from __future__ import annotations

import asyncio
import threading

from stages.rollout.engine import Engine, GenResult
from stages.rollout.engine_pool import EnginePool
from stages.rollout.generator import Generator
from stages.rollout.sglang_engine import SGLangEngine
from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args


def test_a_restart_shows_its_older_version_with_its_count_before_the_server_is_up(tmp_path, monkeypatch):
    """SGLangEngine.restart: from the moment the old server is gone, (version, relaunches) read together
    say both the base version and the relaunch (a reader never sees one without the other), and the
    version stays there while the server starts, so a pool's version drops for the whole relaunch."""
    eng = SGLangEngine(str(tmp_path), start=False)
    eng._version = 7  # pushed-to weights: the server keeps no copy of them
    seen_while_starting = []
    monkeypatch.setattr(eng, "_resync_source", lambda: (str(tmp_path), 0))

    def start(path, version):
        seen_while_starting.append(eng.version_and_relaunches())
        eng._version = version

    monkeypatch.setattr(eng, "start", start)
    assert eng.version_and_relaunches() == (7, 0)
    eng.restart()
    assert seen_while_starting == [(0, 1)] and eng.version_and_relaunches() == (0, 1)


class Quick(Engine):
    """Answers at once; `relaunch()` drops its version and counts the relaunch together, as SGLangEngine does."""

    def __init__(self, version: int):
        self._version, self._relaunches, self._lock = version, 0, threading.Lock()
        self.name, self.outstanding = f"quick-{id(self)}", 0  # what the pool names and balances on

    def requests_in_flight(self) -> int:
        return 0

    @property
    def version(self) -> int:
        return self._version

    def version_and_relaunches(self) -> tuple[int, int]:
        with self._lock:
            return self._version, self._relaunches

    def relaunch(self) -> None:
        with self._lock:
            self._relaunches, self._version = self._relaunches + 1, 0

    def update_weights(self, named_tensors, version: int) -> None:  # the trainer's (catch-up) push
        self._version = version

    async def generate(self, requests):
        await asyncio.sleep(0.01)
        return [
            GenResult(
                rid=r.rid, response_ids=[5], logprobs=[-1.0], versions=[self._version], finish_reason="length"
            )
            for r in requests
        ]


def _started(tmp_path_factory, step, after_s: float = 1.0, **rollout) -> tuple[int, int, int]:
    """Groups started by a generator over a pool of two engines at version 5 (nothing consumed, so its
    window fills): before, during a relaunch of one engine, and `after_s` after `step(relaunched)`."""
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=64, **rollout)  # run.max_staleness = 1
    steady, relaunched = Quick(5), Quick(5)
    gen = Generator(*rollout_args(cfg), FakeSink(), EnginePool([steady, relaunched]), "pool", batch_groups=2)

    async def run():
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(1.0)
        first = gen.stats()["groups_started"]
        relaunched.relaunch()  # the other engine still serves: the generator keeps asking admission
        gen._poke()
        await asyncio.sleep(1.0)
        during = gen.stats()["groups_started"]
        step(relaunched)
        gen._poke()
        await asyncio.sleep(after_s)
        gen.stop()
        await asyncio.wait_for(task, 30)
        return first, during, gen.stats()["groups_started"]

    return asyncio.run(run())


def test_a_relaunch_in_a_pool_holds_admission_and_nothing_floods_in_once_caught_up(tmp_path_factory):
    first, during, total = _started(tmp_path_factory, lambda e: e.update_weights([], 5))
    assert first == (5 + 1 + 1) * 2  # the window of version 5 at staleness 1
    assert during == first and total == first


def test_a_trainer_gone_back_during_a_relaunch_reopens_admission_from_its_version(tmp_path_factory):
    """The dip ends with older weights than before it: the trainer restarted from its checkpoint (2)."""
    first, during, total = _started(tmp_path_factory, lambda e: e.update_weights([], 2))
    assert during == first and total - first == (1 + 1) * 2


def test_a_dip_that_outlasts_a_relaunch_and_its_catch_up_is_a_trainer_gone_back(tmp_path_factory):
    """A fresh trainer (no checkpoint) pushes version 0, the very version the relaunched server came back
    at: nothing ends the dip but time. Past twice the relaunch bound (startup_timeout_s + 2 x
    health_check_s) it is taken for a trainer gone back, and its window opens, or the new trainer would
    wait for data that never comes."""
    quick = {"sglang": {"startup_timeout_s": 0.4, "health_check_s": 0.2}}  # bound 0.8 s: 1.6 s for a dip
    first, during, total = _started(tmp_path_factory, lambda e: None, after_s=2.0, **quick)
    assert during == first  # 1 s into the dip: still held
    assert total - first == (0 + 1 + 1) * 2  # the window of version 0
