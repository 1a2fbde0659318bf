"""A generator with SGLang engines that dies is healed (issue #39): its servers outlive it (each runs in
a session of its own), so the healer ends their process groups on the generator's node (a Ray task
there) and starts the new incarnation's servers on the same ports, where the trainer's sender finds
them as it finds a server the engine watch relaunched. Here on CPU: real process groups stand in for
the servers, a small Ray actor for the generator."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest

from pipeline.orchestration.calls import Calls, StageFailed
from stages.rollout.sglang_process import end_orphaned_groups


def _server_group() -> subprocess.Popen:
    """A stand-in server: a session leader with a child of its own (SGLang's schedulers), as orphaned
    servers are after their generator died."""
    return subprocess.Popen(["bash", "-c", "sleep 120 & sleep 120"], start_new_session=True)


def _site(tmp_path):
    """What GeneratorStage takes from the run's Site: one generator, no placement group."""
    return SimpleNamespace(
        cfg=SimpleNamespace(
            trainer=SimpleNamespace(batch_groups=2), rollout=SimpleNamespace(num_generators=1)
        ),
        calls=Calls(tmp_path, timeout_s=60),
        on=lambda bundle: {},
        plan=SimpleNamespace(generator_bundles=[0]),
        run_dir=tmp_path,
    )


def _running(pgid: int) -> bool:
    from stages.rollout.sglang_process import _group_running

    return _group_running(pgid)


def test_orphaned_server_groups_end_whole_and_at_once():
    servers = [_server_group(), _server_group()]
    time.sleep(0.3)  # the children exist
    assert all(_running(p.pid) for p in servers)
    t0 = time.monotonic()
    assert end_orphaned_groups([p.pid for p in servers], timeout_s=10) == []
    assert time.monotonic() - t0 < 5
    assert not any(_running(p.pid) for p in servers)  # the children too: zombies at most
    for p in servers:
        p.wait(5)
    assert end_orphaned_groups([servers[0].pid], timeout_s=1) == []  # gone already: nothing to do


def test_engines_start_on_the_ports_given_and_refuse_a_count_that_does_not_match(monkeypatch):
    import stages.rollout.engine_pool as ep

    made = []

    class Fake:
        def __init__(self, path, cfg, **kw):
            made.append(kw["port"])
            self.url, self.port, self.pid = f"http://127.0.0.1:{kw['port']}", kw["port"], 1

    monkeypatch.setattr(ep, "SGLangEngine", Fake)
    cfg = SimpleNamespace(port=0, base_gpu_id=0, tp_size=1)
    pool = ep.EnginePool.launch("/m", cfg, 2, ports=[31001, 31002])
    assert sorted(made) == [31001, 31002]
    assert [s["port"] for s in pool.servers()] == [31001, 31002]
    with pytest.raises(ValueError, match="2 SGLang engines but 1 ports"):
        ep.EnginePool.launch("/m", cfg, 2, ports=[31001])


def test_a_healed_generator_ends_its_predecessors_servers_and_takes_their_ports(ray_session, tmp_path):
    import ray

    from pipeline.orchestration.supervisors import GeneratorStage

    @ray.remote(num_cpus=0)
    class Gen:
        def __init__(self, servers):
            self.s = servers

        def ident(self):
            return "gen-0.x"

        def engine_servers(self):
            return self.s

        def run(self):
            return {}

    old = _server_group()
    launched = []

    def launch(i, joining=False, ports=None):
        launched.append(ports)
        return Gen.remote([{"url": "http://127.0.0.1:31005", "port": 31005, "pid": 4242}])

    site = _site(tmp_path)
    stage = GeneratorStage(site, buffer=None)
    stage._launch = launch
    stage.actors = [Gen.remote([{"url": "http://127.0.0.1:31005", "port": 31005, "pid": old.pid}])]
    stage.ids, stage.servers = ["gen-0.a"], [stage._servers_of(0)]
    time.sleep(0.3)
    assert _running(old.pid)
    stage.restart(0)
    old.wait(10)  # ended by the healer's task
    assert not _running(old.pid)
    assert launched == [[31005]]  # the new incarnation's servers at the URL the sender pushes to
    assert stage.servers[0][0]["pid"] == 4242  # its own servers are what a later heal ends
    ray.kill(stage.actors[0])


def test_servers_that_will_not_end_stop_the_run_by_name(ray_session, tmp_path, monkeypatch):
    from pipeline.orchestration import supervisors

    site = _site(tmp_path)
    stage = supervisors.GeneratorStage(site, buffer=None)
    import stages.rollout.sglang_process as sp

    monkeypatch.setattr(sp, "end_orphaned_groups", lambda groups, timeout_s: list(groups))
    with pytest.raises(
        StageFailed, match=r"generator gen-0 died and its SGLang servers \(process groups \[77\]\)"
    ):
        stage._end_servers(0, [77], timeout_s=0.1)
