"""A generator with SGLang engines that dies is healed (issue #39): its servers outlive it (each runs in
a session of its own), so the healer ends the servers listening on its ports, on the generator's node
(a Ray task there), and starts the new incarnation's servers on the same ports, where the trainer's
sender finds them as it finds a server the engine watch relaunched. Found by port, since the engine
watch relaunches a server under a new pid. Here on CPU: tests/sglang_standin.py stands in for the
servers (its command line names sglang), a small Ray actor for the generator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from pipeline.orchestration.calls import Calls, StageFailed
from stages.rollout.sglang_process import _group_running, _listeners, end_orphaned_servers


def _standin(tmp_path) -> tuple[subprocess.Popen, int]:
    """A stand-in server on a free port, in a session of its own (as SGLangEngine starts one), with a
    child in its group (SGLang's schedulers): (process, port) once it listens."""
    from sglang_standin import command  # tests/ is on sys.path

    from buffer.net import free_port

    port = free_port("127.0.0.1")
    cmd = ["bash", "-c", 'sleep 120 & exec "$@"', "standin", *command(port, tmp_path / f"calls-{port}")]
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 20
    while port not in _listeners([port]):
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not listen"
        time.sleep(0.1)
    return proc, port


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


def test_orphaned_servers_are_found_by_port_and_end_whole(tmp_path):
    (a, pa), (b, pb) = _standin(tmp_path), _standin(tmp_path)
    other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"])  # not sglang
    try:
        group_a = os.getpgid(a.pid)
        assert _group_running(group_a)
        t0 = time.monotonic()
        assert end_orphaned_servers([pa, pb], timeout_s=20) == []
        assert time.monotonic() - t0 < 10
        assert not _group_running(group_a)  # its child too: zombies at most
        assert _listeners([pa, pb]) == {}  # the ports are free for the successor's servers
        assert other.poll() is None  # a listener that is not SGLang's is never ended
        assert end_orphaned_servers([pa], timeout_s=1) == []  # nothing there: nothing to do
    finally:
        for p in (a, b, other):
            if p.poll() is None:
                p.kill()
            p.wait(5)


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
    assert sorted(pool.urls) == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    with pytest.raises(ValueError, match="2 SGLang engines but 1 ports"):
        ep.EnginePool.launch("/m", cfg, 2, ports=[31001])


def test_a_healed_generator_ends_its_predecessors_servers_and_takes_their_ports(ray_session, tmp_path):
    import ray

    from pipeline.orchestration.supervisors import GeneratorStage

    @ray.remote(num_cpus=0)
    class Gen:
        def __init__(self, port):
            self.port = port

        def ident(self):
            return "gen-0.x"

        def engine_urls(self):
            return [f"http://127.0.0.1:{self.port}"]

        def run(self):
            return {}

    old, port = _standin(tmp_path)
    launched = []

    def launch(i, joining=False, ports=None):
        launched.append(ports)
        return Gen.remote(31099)  # what the successor reports is what a later heal ends

    stage = GeneratorStage(_site(tmp_path), buffer=None)
    stage._launch = launch
    # no pid is recorded (an engine watch relaunch would make it stale): the port finds the server
    stage.actors = [Gen.remote(port)]
    stage.ids, stage.ports = ["gen-0.a"], [stage._ports_of(0)]
    try:
        stage.restart(0)
        old.wait(10)  # ended by the healer's task
        assert _listeners([port]) == {}
        assert launched == [[port]]  # the new incarnation's servers at the URL the sender pushes to
        assert stage.ports == [[31099]]  # its own servers are what a later heal ends
    finally:
        if old.poll() is None:
            old.kill()
        ray.kill(stage.actors[0])


def test_servers_that_will_not_end_stop_the_run_by_name(ray_session, tmp_path, monkeypatch):
    import stages.rollout.sglang_process as sp
    from pipeline.orchestration.supervisors import GeneratorStage

    stage = GeneratorStage(_site(tmp_path), buffer=None)
    monkeypatch.setattr(sp, "end_orphaned_servers", lambda ports, timeout_s: list(ports))
    with pytest.raises(
        StageFailed, match=r"generator gen-0 died and its SGLang servers on ports \[31077\] still run"
    ):
        stage._end_servers(0, [31077], timeout_s=0.1)


def test_an_sglang_run_with_offload_is_not_healed_and_says_how_to_go_on(tmp_path):
    """With cluster.offload a new server or trainer would come up beside the other side's whole state."""
    from pipeline.orchestration.healing import Healer

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(engine="sglang"), cluster=SimpleNamespace(offload=SimpleNamespace(on=True))
    )
    healer = Healer(cfg, Calls(tmp_path, timeout_s=5), None, None, None)
    with pytest.raises(
        StageFailed, match="cluster.offload is not healed yet.*started again in its run directory"
    ):
        healer.heal_trainer("trainer rank 0: killed")
    assert healer.restarts == 0
