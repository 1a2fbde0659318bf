"""The NCCL sender's weight group across real processes, on CPU: the sender (rank 0) and a server
process form real torch.distributed groups (gloo instead of NCCL, the same rendezvous SGLang uses) and
every push is a real broadcast of the flat bucket (or of each tensor: weights.nccl_receive=per_tensor),
which the server unpacks (receives) by names, dtypes and shapes as SGLang does. The server is SIGKILLed and relaunched on its port: the next pushes leave it out, the
catch-up forms a new group with the new process and gives it the last weights.

What stands in for SGLang is the server (an HTTP server speaking the routes the sender uses, in
another process); what is tested is the sender's side: rendezvous, group names, bucket layout,
membership across a restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from http_stub import JsonHandler  # tests/ is on sys.path (pytest; this file run as a script)

REPO = Path(__file__).resolve().parent.parent


def gloo_group(init_method: str, world: int, rank: int, name: str, timeout_s: float):
    """A standalone process group (no default group), made the way SGLang's init_custom_process_group
    makes its weight-update group, on gloo."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(init_method, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), PrefixStore(name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def nccl_group(init_method: str, world: int, rank: int, name: str, timeout_s: float):
    """The weight-update group as an SGLang server joins it: SGLang's own helper, NCCL, on this
    process's GPU (tests/test_gpu_weights_abort.py)."""
    from sglang.srt.utils import init_custom_process_group

    torch.cuda.set_device(0)
    return init_custom_process_group(
        backend="nccl",
        init_method=init_method,
        world_size=world,
        rank=rank,
        group_name=name,
        timeout=timedelta(seconds=timeout_s),
    )


def fingerprint(t: torch.Tensor) -> float:
    """A number that changes when values move (a plain sum would miss a transposed layout)."""
    flat = t.double().reshape(-1).cpu()  # double: the same number whatever order the sum runs in
    return (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum().item()


# -- the server process ------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    groups: dict = {}
    weights: dict = {}
    version = "0"
    loads = 0


class _Handler(JsonHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        srv = self.server
        nccl = os.environ.get("STANDIN_BACKEND") == "nccl"  # on its one visible GPU, as SGLang joins
        if self.path == "/init_weights_update_group":
            init = f"tcp://{body['master_address']}:{body['master_port']}"
            args = (init, body["world_size"], body["rank_offset"], body["group_name"], 30)
            srv.groups[body["group_name"]] = nccl_group(*args) if nccl else gloo_group(*args)
        elif self.path == "/update_weights_from_distributed":
            srv.loads += 1
            # killed mid-push, before its receive: at its first load, or a later one (the broadcasts
            # before it have set up the group's communicator, as in a run)
            if srv.loads == int(os.environ.get("STANDIN_DIE_ON_LOAD", "0")):
                os.kill(os.getpid(), signal.SIGKILL)
            group, device = srv.groups[body["group_name"]], "cuda" if nccl else "cpu"
            dtypes = [getattr(torch, d) for d in body["dtypes"]]
            if body.get("load_format") == "flattened_bucket":  # one broadcast of the bucket's bytes
                sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(body["shapes"], dtypes)]
                flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                torch.distributed.broadcast(flat, src=0, group=group)
                offset, received = 0, []
                for dtype, shape, n in zip(dtypes, body["shapes"], sizes):
                    received.append(flat[offset : offset + n].view(dtype).reshape(shape))
                    offset += n
            else:  # no load_format: one broadcast per tensor, as SGLang receives them
                received = [torch.empty(s, dtype=d, device=device) for s, d in zip(body["shapes"], dtypes)]
                for work in [
                    torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in received
                ]:
                    work.wait()
            for name, t in zip(body["names"], received):
                srv.weights[name] = fingerprint(t)
            if "weight_version" in body:
                srv.version = body["weight_version"]
        self._answer({"success": True, "message": ""})

    def do_GET(self):  # noqa: N802
        srv = self.server
        self._answer({"weight_version": srv.version, "weights": srv.weights, "groups": sorted(srv.groups)})


def _serve(port: int) -> None:
    parent = os.getppid()
    if os.environ.get("STANDIN_BACKEND") == "nccl":
        # SGLang's import takes 10-20 s: made inside the join, it outlasted the sender's rendezvous wait
        # (weights.timeout_s) in the first GPU run of the abort test
        import sglang.srt.utils  # noqa: F401

    def exit_with_parent():  # a test run that is killed leaves no server behind
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    _Server(("127.0.0.1", port), _Handler).serve_forever()


# -- the test ---------------------------------------------------------------------------------------


def _launch(port: int, procs: list, *, die_on_load: int = 0, env: dict | None = None) -> subprocess.Popen:
    """A stand-in server on `port`, which kills itself at its `die_on_load`-th load request (0: never);
    `env`: more of its environment (STANDIN_BACKEND=nccl, its GPU)."""
    env = {**os.environ, "STANDIN_DIE_ON_LOAD": str(die_on_load), **(env or {})}
    proc = subprocess.Popen([sys.executable, __file__, str(port)], cwd=REPO, start_new_session=True, env=env)
    procs.append(proc)  # the test kills whatever is left of these at its end
    deadline = time.monotonic() + 60
    while True:
        try:
            _info(f"http://127.0.0.1:{port}")
            return proc
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.2)


def _info(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/model_info", timeout=10) as r:
        return json.loads(r.read())


def _named(scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(scale))
    return [
        ("embed.weight", (torch.randn(64, 16, generator=g) * scale).to(torch.bfloat16)),
        ("norm.weight", torch.randn(16, generator=g) * scale),  # fp32 after bf16: aligned
        ("head.weight", (torch.randn(16, 64, generator=g) * scale).to(torch.bfloat16).t()),  # strided
    ]


def _sums(named) -> dict[str, float]:
    return {n: fingerprint(t) for n, t in named}


@pytest.fixture(params=["flat", "per_tensor"])
def weight_group(monkeypatch, request):
    """The NCCL sender on a gloo group and CPU buckets (its sequence, groups and layout are the real
    ones), to a stand-in server's port, for each weights.nccl_receive: `launch(...)` starts a server
    there; the sender and every server launched are ended whatever the test does."""
    from types import SimpleNamespace

    from buffer.net import free_port

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the sender's CUDA check
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    sender = _gloo_sender([url], group_name=f"test-{port}", receive=request.param)
    sender.bucket_bytes = 4096  # several buckets, several broadcasts per push
    try:
        yield SimpleNamespace(url=url, sender=sender, launch=lambda **kw: _launch(port, procs, **kw))
    finally:
        _end(sender, procs)


def _gloo_sender(urls: list[str], group_name: str, receive: str = "per_tensor"):
    """The NCCL sender with its weight group on gloo and its buckets on CPU."""
    from stages.weights.nccl_sender import NcclSGLangSender

    class GlooSender(NcclSGLangSender):
        def _new_group(self, init_method, world, name):
            return gloo_group(init_method, world, 0, name, self.timeout_s)

        def _bucket_device(self):
            return torch.device("cpu")

    return GlooSender(
        urls, timeout_s=30, restart_grace_s=120, bucket_mb=1, group_name=group_name, receive=receive
    )


def _end(sender, procs: list[subprocess.Popen]) -> None:
    """Close the sender and kill every stand-in server a test launched that still runs."""
    sender.close()
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_killed_server_rejoins_a_real_weight_group_and_gets_the_last_weights(weight_group):
    url, sender = weight_group.url, weight_group.sender
    server = weight_group.launch()
    first = _named(1.0)
    out = sender.push(1, first).result(timeout=60)
    assert out["engines"] == 1
    got = _info(url)
    assert got["weight_version"] == "1" and got["groups"] == sender.group_names[:1]
    assert got["weights"] == pytest.approx(_sums(first), rel=1e-6)

    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)
    second = _named(2.0)
    down = sender.push(2, second).result(timeout=60)
    assert (down["engines"], down["engines_skipped"]) == (0, 1)

    weight_group.launch()  # relaunched on its port: base weights, no groups
    assert _info(url)["weight_version"] == "0"
    caught = sender.catch_up().result(timeout=60)
    assert (caught["version"], caught["engines"]) == (2, 1)
    got = _info(url)
    assert got["weight_version"] == "2" and got["groups"] == sender.group_names[1:2]
    assert got["weights"] == pytest.approx(_sums(second), rel=1e-6)
    third = _named(3.0)
    sender.push(3, third).result(timeout=60)  # the new group carries the next pushes
    assert _info(url)["weights"] == pytest.approx(_sums(third), rel=1e-6)


def test_a_server_killed_during_a_push_is_left_out_and_the_trainer_goes_on(weight_group):
    """The 2-GPU kill test of 2026-11-27 killed the server while rank 0 broadcast a bucket to it: NCCL
    waited for the dead peer until its watchdog ended the trainer's process, and the run failed. Now
    the push sees the server's load call fail, gives up the group and leaves the server out, as if it
    had been down at the pause; its relaunch gets the weights by catch_up in a new group."""
    url, sender = weight_group.url, weight_group.sender
    server = weight_group.launch(die_on_load=1)
    first = _named(1.0)
    t0 = time.monotonic()
    out = sender.push(1, first).result(timeout=60)  # no WeightPushError: the trainer goes on
    assert (out["engines"], out["engines_skipped"]) == (0, 1)
    assert time.monotonic() - t0 < 25, "the push waited for the dead server instead of leaving it out"
    assert server.wait(timeout=30) == -signal.SIGKILL
    assert sender.needs_push() == []  # it is known to be behind: catch_up, not a regular push, serves it

    weight_group.launch()
    caught = sender.catch_up().result(timeout=60)
    assert (caught["version"], caught["engines"]) == (1, 1)
    got = _info(url)
    assert got["weight_version"] == "1" and got["groups"] == sender.group_names[1:2]
    assert got["weights"] == pytest.approx(_sums(first), rel=1e-6)


@pytest.mark.parametrize("direct", [False, True], ids=["snapshot", "direct"])
def test_a_server_that_outlives_another_killed_mid_push_gets_whole_weights_again(monkeypatch, direct):
    """Two servers in one weight group; one is killed at its second load of a push, after the other
    loaded the first bucket. Before, the push failed ("left paused with partly loaded weights") and took
    the trainer with it: a 7B run of 2026-11-27, where one server hung in a load and its engine watch
    relaunched it. Now the push ends without the dead one and the survivor stays paused (generating
    from partly loaded weights would make samples of no version) until it has whole weights: at the
    catch-up of a kept push, or (a direct push keeps nothing) by the push needs_push() asks for at once.
    The dead one's relaunch is caught up as before."""
    from buffer.net import free_port

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    dying, survivor = (f"http://127.0.0.1:{p}" for p in ports)
    procs: list[subprocess.Popen] = []
    sender = _gloo_sender([dying, survivor], group_name=f"test-{ports[0]}")
    sender.bucket_bytes = 2048  # three buckets: [embed] [norm] [head]

    def push(version, named):
        if direct:
            return sender.push_now(version, iter(named), expect_bytes=4096)
        return sender.push(version, named).result(timeout=60)

    try:
        killed = _launch(ports[0], procs, die_on_load=2)
        _launch(ports[1], procs)
        first = _named(1.0)
        t0 = time.monotonic()
        out = push(1, first)  # no WeightPushError: the trainer goes on
        assert out["engines"] == 0 and time.monotonic() - t0 < 25
        assert killed.wait(timeout=30) == -signal.SIGKILL
        partly = _info(survivor)
        assert partly["weights"]["embed.weight"] == pytest.approx(_sums(first)["embed.weight"], rel=1e-6)
        assert "head.weight" not in partly["weights"]  # nor the last bucket, which would label it
        assert partly["weight_version"] == "0"
        if direct:
            assert sender.catch_up() is None and sender.needs_push() == [survivor]
            healed = push(1, first)  # the trainer's push of its current weights
        else:
            assert sender.needs_push() == [survivor]
            healed = sender.catch_up().result(timeout=60)  # before the trainer would ask needs_push()
        assert (healed["engines"], healed["engines_skipped"]) == (1, 1)
        got = _info(survivor)
        assert got["weight_version"] == "1" and got["weights"] == pytest.approx(_sums(first), rel=1e-6)
        assert sender.needs_push() == []  # whole again; the dead one is not back

        _launch(ports[0], procs)
        if direct:
            sender._probed_at = float("-inf")  # the version probe's own interval
            assert sender.needs_push() == [dying]
            back = push(1, first)
        else:
            back = sender.catch_up().result(timeout=60)  # to both: the group re-forms once with all
        assert back["engines"] == 2
        assert _info(dying)["weights"] == pytest.approx(_sums(first), rel=1e-6)
    finally:
        _end(sender, procs)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
