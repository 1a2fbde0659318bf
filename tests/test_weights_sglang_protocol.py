"""The SGLang weight senders' HTTP sequence, on CPU: a local HTTP server records what a push sends
(no SGLang, no GPU: the transport-specific bucket delivery is replaced by a POST of its own). What is
checked is the sender's protocol: pause, loads with the version on the last one only, continue; a
failed pause resumes generation; a failed load leaves the servers paused and says so."""

from __future__ import annotations

import json
import threading
import weakref
from http.server import ThreadingHTTPServer

import pytest
import torch
from http_stub import JsonHandler  # tests/ is on sys.path under pytest

from stages.weights.base import WeightPushError
from stages.weights.buckets import check_flat_layout
from stages.weights.nccl_sender import NcclSGLangSender
from stages.weights.sglang_transport import _SGLangSender


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fail: set[str], port: int = 0):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail
        self.weight_version = "0"  # what /model_info reports: a new server runs the base model
        self.health = 200  # what /health answers
        super().__init__(("127.0.0.1", port), Handler)


class Handler(JsonHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.calls.append((self.path, body))
        if self.path in getattr(self.server, "die", ()):  # the server dies here: no answer, connection gone
            self.close_connection = True
            return
        ok = self.path not in self.server.fail
        if ok and "weight_version" in body:
            self.server.weight_version = body["weight_version"]
        self._answer({"success": ok, "message": "" if ok else "boom"})

    def do_GET(self):  # noqa: N802
        if self.path == "/health":  # not recorded: the push sequence is what the tests compare
            self.send_response(self.server.health)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.calls.append((self.path, {}))
        self._answer({"weight_version": self.server.weight_version})


class PostSender(_SGLangSender):
    """The shared push sequence with a bucket delivery that only POSTs what it was asked to load."""

    def _send_bucket(self, group, version, urls):
        body = {"names": [n for n, _ in group]}
        if version is not None:
            body["weight_version"] = str(version)
        for url in urls:
            self._post(url, "/load", body, self.timeout_s)
        return 0.0


@pytest.fixture
def server_factory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made = []

    def make(fail=()):
        srv = Recorder(set(fail))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield make
    for srv in made:
        srv.shutdown()


def _named():  # three 4 KB tensors: with 8 KB buckets, two buckets
    return [(f"w{i}", torch.zeros(1024)) for i in range(3)]


def test_push_sequence_sets_the_version_with_the_last_load_only(server_factory):
    srv, url = server_factory()
    sender = PostSender([url], bucket_mb=0, timeout_s=10)
    sender.bucket_bytes = 8192
    out = sender.push(5, _named()).result(timeout=10)
    routes = [r for r, _ in srv.calls]
    assert routes == ["/pause_generation", "/load", "/load", "/continue_generation"]
    loads = [b for r, b in srv.calls if r == "/load"]
    assert "weight_version" not in loads[0] and loads[1]["weight_version"] == "5"
    assert [n for b in loads for n in b["names"]] == ["w0", "w1", "w2"]
    assert out["version"] == 5 and out["bytes"] == 3 * 4096
    sender.close()


def test_failed_load_leaves_servers_paused_and_says_so(server_factory):
    srv, url = server_factory(fail={"/load"})
    sender = PostSender([url], timeout_s=10)
    with pytest.raises(WeightPushError, match="left paused"):
        sender.push(2, _named()).result(timeout=10)
    assert [r for r, _ in srv.calls] == ["/pause_generation", "/load"]  # no continue on mixed weights
    sender.close()


def test_failed_pause_resumes_every_server(server_factory):
    ok, ok_url = server_factory()
    bad, bad_url = server_factory(fail={"/pause_generation"})
    sender = PostSender([ok_url, bad_url], timeout_s=10)
    with pytest.raises(WeightPushError, match="pause_generation failed"):
        sender.push(1, _named()).result(timeout=10)
    assert [r for r, _ in ok.calls] == ["/pause_generation", "/continue_generation"]
    assert ("/load" not in [r for r, _ in bad.calls]) and bad.calls[-1][0] == "/continue_generation"
    sender.close()


def _dead_url() -> str:
    """A loopback port nothing listens on (a server that died): connections are refused."""
    from buffer.net import free_port

    return f"http://127.0.0.1:{free_port('127.0.0.1')}"


def test_an_unreachable_server_is_left_out_while_it_may_be_restarting(server_factory):
    """With restart_grace_s, a push reaches the live servers and skips a dead one (its engine watch is
    relaunching it); once it answers again it gets the next push; past the grace the push fails."""
    import time

    ok, ok_url = server_factory()
    dead = _dead_url()
    sender = PostSender([ok_url, dead], timeout_s=10, restart_grace_s=0.5)
    out = sender.push(1, _named()).result(timeout=10)
    assert out["engines"] == 1 and out["engines_skipped"] == 1
    assert [r for r, _ in ok.calls] == ["/pause_generation", "/load", "/continue_generation"]
    assert ok.calls[1][1]["weight_version"] == "1"  # the live server got the whole version
    time.sleep(0.6)
    with pytest.raises(WeightPushError, match="unreachable for .*s, longer than the 0s"):
        sender.push(2, _named()).result(timeout=10)
    assert ok.calls[-1][0] == "/continue_generation"  # nothing was loaded: the live one generates on
    sender.close()
    # without a grace (no engine watch, or NCCL) a dead server fails the push at once
    strict = PostSender([ok_url, dead], timeout_s=10)
    with pytest.raises(WeightPushError, match="unreachable"):
        strict.push(3, _named()).result(timeout=10)
    strict.close()


def test_a_server_that_does_not_answer_the_pause_is_left_out_as_a_restarting_one(server_factory):
    """A server hung in a dead trainer's NCCL broadcast answers nothing: a new trainer's push leaves it
    out within restart_grace_s (its engine watch relaunches it) instead of failing on the timeout."""
    import socket

    ok, ok_url = server_factory()
    hung = socket.socket()  # accepts connections (the backlog) and never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    try:
        sender = PostSender([ok_url, hung_url], timeout_s=0.5, restart_grace_s=30)
        out = sender.push(1, _named()).result(timeout=20)
        assert out["engines"] == 1 and out["engines_skipped"] == 1
        assert [r for r, _ in ok.calls] == ["/pause_generation", "/load", "/continue_generation"]
        sender.close()
        strict = PostSender([ok_url, hung_url], timeout_s=0.5)  # no engine watch: the timeout fails it
        with pytest.raises(WeightPushError, match="pause_generation unreachable: .*timed out"):
            strict.push(2, _named()).result(timeout=20)
        strict.close()
    finally:
        hung.close()


def test_a_restarted_server_is_pushed_to_again(server_factory):
    """A server skipped while down is back in the next push once it answers (its outage clock resets)."""
    import time

    ok, ok_url = server_factory()
    from buffer.net import free_port

    port = free_port("127.0.0.1")
    sender = PostSender([ok_url, f"http://127.0.0.1:{port}"], timeout_s=10, restart_grace_s=5)
    assert sender.push(1, _named()).result(timeout=10)["engines_skipped"] == 1
    back = Recorder(set(), port)  # the relaunched server, on its old port
    threading.Thread(target=back.serve_forever, daemon=True).start()
    time.sleep(0.1)
    out = sender.push(2, _named()).result(timeout=10)
    assert out["engines"] == 2 and out["engines_skipped"] == 0
    assert [r for r, _ in back.calls][0] == "/pause_generation" and back.calls[1][1]["weight_version"] == "2"
    assert sender._down_since == {}
    back.shutdown()
    sender.close()


def test_a_relaunched_server_gets_the_last_weights_by_catch_up(server_factory):
    """While a server is behind, the sender keeps the last push's tensors; catch_up() sends them to it
    alone (skipped again while it is still down), then lets them go."""
    from buffer.net import free_port

    ok, ok_url = server_factory()
    port = free_port("127.0.0.1")
    sender = PostSender([ok_url, f"http://127.0.0.1:{port}"], timeout_s=10, restart_grace_s=30)
    assert sender.catch_up() is None  # nothing pushed yet
    assert sender.push(4, _named()).result(timeout=10)["engines_skipped"] == 1
    still_down = sender.catch_up().result(timeout=10)
    assert still_down["engines"] == 0 and still_down["version"] == 4
    calls_before = len(ok.calls)
    back = Recorder(set(), port)
    threading.Thread(target=back.serve_forever, daemon=True).start()
    caught = sender.catch_up().result(timeout=10)
    assert caught["engines"] == 1 and caught["engines_skipped"] == 0
    assert [r for r, _ in back.calls] == ["/pause_generation", "/load", "/continue_generation"]
    assert back.calls[1][1]["weight_version"] == "4"
    assert len(ok.calls) == calls_before  # the server that was up is not paused again
    assert sender.catch_up() is None and sender._last is None  # nobody behind: the tensors are let go
    back.shutdown()
    sender.close()


def test_a_server_relaunched_between_pushes_is_found_by_its_version(server_factory, monkeypatch):
    """No push missed it (it died and came back while the trainer waited for data), but it runs the base
    model again: its /model_info weight_version is older than the last push, so needs_push() lists it
    (asking at most every VERSION_PROBE_S, and only once /health answers) for the trainer to push its
    current weights; that push clears it. Without this the trainer waits for fresh data that cannot
    come (on an H100: 2,558 base-model groups evicted as stale, then a fetch timeout)."""
    from stages.weights import sglang_transport

    ok, ok_url = server_factory()
    relaunched, relaunched_url = server_factory()
    sender = PostSender([ok_url, relaunched_url], timeout_s=10, restart_grace_s=30)
    assert sender.needs_push() == []  # nothing pushed: nothing to compare with
    assert sender.push(3, _named()).result(timeout=10)["engines"] == 2
    assert sender.needs_push() == []  # both run version 3
    relaunched.weight_version = "0"  # the engine watch relaunched it from the base model
    assert sender.needs_push() == []  # asked less than VERSION_PROBE_S ago
    monkeypatch.setattr(sglang_transport, "VERSION_PROBE_S", 0.0)
    relaunched.health = 503  # still starting: not counted yet (a pause could fail with 5xx)
    assert sender.needs_push() == []
    relaunched.health = 200
    ok.calls[:] = []
    assert sender.needs_push() == [relaunched_url]
    assert [r for r, _ in ok.calls] == ["/model_info"]  # the one that is current is only asked
    assert sender.push(3, _named()).result(timeout=10)["engines"] == 2  # the trainer's push again
    assert relaunched.weight_version == "3" and sender.needs_push() == []
    relaunched.weight_version = "0"
    relaunched.shutdown()  # relaunched again, and not back yet: not counted, nothing to push to
    assert sender.needs_push() == []
    sender.close()


class _Source:
    """Answers None `empty` times (each after waiting its timeout, as the buffer does), then a batch;
    `finished`: None at once, as a replay with nothing left does."""

    def __init__(self, empty: int, finished: bool = False):
        self.waits, self.empty, self.finished = [], empty, finished

    def fetch(self, num_groups, version, max_staleness, timeout_s):
        import time

        self.waits.append(timeout_s)
        if self.finished:
            return None
        if len(self.waits) > self.empty:
            return "batch"
        time.sleep(timeout_s)
        return None


class _Sender:
    """catch_up() starts a push the first `behind` times; needs_push() lists a server the first
    `stale` times it is asked."""

    def __init__(self, behind: int = 0, stale: int = 0):
        from types import SimpleNamespace

        self.calls, self.behind, self.stale, self.asked = 0, behind, stale, 0
        self._done = SimpleNamespace(done=lambda: True, result=lambda: {})

    def catch_up(self):
        self.calls += 1
        return self._done if self.calls <= self.behind else None

    def needs_push(self):
        self.asked += 1
        return ["http://relaunched"] if self.asked <= self.stale else []


def _trainer(source, sender, fetch_timeout_s=1.0):
    """The trainer's batch feed at version 3 with its weight publisher (rank 0's); pushes are counted."""
    from types import SimpleNamespace

    from stages.trainer.feed import BatchFeed
    from stages.weights.publisher import WeightPublisher

    cpu = torch.device("cpu")
    publisher = WeightPublisher(SimpleNamespace(snapshot="auto"), None, rank=0, device=cpu, sender=sender)
    tc = SimpleNamespace(batch_groups=2, fetch_timeout_s=fetch_timeout_s)
    t = BatchFeed(source, tc, SimpleNamespace(max_staleness=2), publisher, rank=0, device=cpu)
    t.sender, t.pushes = sender, 0

    def push(version):
        t.pushes += 1
        return {}

    publisher.push = push
    return t


def test_the_trainer_catches_up_while_it_waits_for_data(monkeypatch):
    """BatchFeed._fetch_catching_up: with a sender, the wait for a batch is cut into CATCH_UP_EVERY_S
    slices, each after asking for a catch-up push (started when an engine is behind); without, one wait;
    and a source that answers None at once (a finished replay) ends the wait, without a busy loop."""
    import time

    from stages.trainer import feed as feed_module
    from stages.trainer.feed import Delivery, Got

    monkeypatch.setattr(feed_module, "CATCH_UP_EVERY_S", 0.05)
    t = _trainer(_Source(empty=2), _Sender(behind=2))
    assert t._fetch_catching_up(time.monotonic() + 1.0, 3) == Delivery(Got.BATCH, "batch")
    assert t.source.waits == pytest.approx([0.05] * 3, abs=0.01)
    assert t.sender.calls == 3 and t.publisher.pending is not None
    # nobody behind: still slices, since a server relaunched between pushes is only found by asking
    calm = _trainer(_Source(empty=1), _Sender())
    assert calm._fetch_catching_up(time.monotonic() + 1.0, 3) == Delivery(Got.BATCH, "batch")
    assert calm.sender.calls == 2 and calm.publisher.pending is None
    alone = _trainer(_Source(empty=0), None)  # no sender (a trainer alone): one wait
    assert alone._fetch_catching_up(time.monotonic() + 1.0, 3) == Delivery(Got.BATCH, "batch")
    assert alone.source.waits == pytest.approx([1.0], abs=0.05)
    done = _trainer(_Source(empty=0, finished=True), _Sender())
    assert done._fetch_catching_up(time.monotonic() + 5.0, 3) == Delivery(Got.TIMEOUT)
    assert len(done.source.waits) == 1


def test_the_trainer_pushes_again_to_a_server_relaunched_since_its_last_push(monkeypatch):
    """BatchFeed.fetch: after a wait that came back empty, the sender is asked for a server running
    older weights with nothing kept for it (needs_push); then every rank snapshots and rank 0 pushes
    the current weights, and the wait goes on within the same fetch_timeout_s. With data there at once,
    nobody is asked anything."""
    from stages.trainer import feed as feed_module

    monkeypatch.setattr(feed_module, "CATCH_UP_EVERY_S", 0.05)
    monkeypatch.setattr(feed_module.dist, "get_world_size", lambda: 1)
    t = _trainer(_Source(empty=1), _Sender(stale=1))
    assert t.fetch(3) == "batch"
    assert t.pushes == 1 and len(t.source.waits) == 2 and t.sender.asked == 1
    quiet = _trainer(_Source(empty=0), _Sender(stale=1))
    assert quiet.fetch(3) == "batch" and quiet.pushes == 0 and quiet.sender.asked == 0


def _two_ranks(monkeypatch, answers: list) -> list:
    """BatchFeed.fetch as one of two ranks: the broadcast hands out `answers` in turn (what rank 0
    decided), and records what this rank put in."""
    from stages.trainer import feed as feed_module
    from stages.trainer.feed import Got

    sent, answers = [], iter(answers)

    def broadcast(payload, src, device=None):
        sent.append(payload[0])
        if payload[0] is None or payload[0].got is not Got.ERROR:
            payload[0] = next(answers)

    monkeypatch.setattr(feed_module.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(feed_module.dist, "broadcast_object_list", broadcast)
    return sent


def test_every_rank_takes_part_in_the_push_again_and_hears_of_rank_0s_failure(monkeypatch):
    """The snapshot of a push is collective: a rank other than 0 learns of it from the fetch broadcast
    and pushes too, then gets its batch. A fetch that fails on rank 0 is broadcast as such: without, the
    other ranks would wait in the broadcast until the process group's timeout."""
    import pyarrow as pa

    from stages.trainer.feed import Delivery, Got, _to_ipc

    _two_ranks(
        monkeypatch, [Delivery(Got.PUSH_AGAIN), Delivery(Got.BATCH, _to_ipc(pa.record_batch({"x": [7]})))]
    )
    other = _trainer(None, None)
    other.rank, other.device = 1, torch.device("cpu")
    assert other.fetch(3).column("x").to_pylist() == [7] and other.pushes == 1

    class Gone:
        def fetch(self, *a):
            raise ConnectionError("buffer at tcp://x is gone")

    sent = _two_ranks(monkeypatch, [])
    first = _trainer(Gone(), None)
    first.device = torch.device("cpu")
    with pytest.raises(ConnectionError, match="is gone"):
        first.fetch(3)
    assert sent == [Delivery(Got.ERROR, "ConnectionError: buffer at tcp://x is gone")]
    _two_ranks(monkeypatch, [Delivery(Got.ERROR, "ConnectionError: buffer at tcp://x is gone")])
    with pytest.raises(RuntimeError, match="rank 0 failed while fetching a batch: ConnectionError"):
        other.fetch(3)


class GroupSender(NcclSGLangSender):
    """The NCCL sender with rank 0's side of a group and the broadcast itself replaced (no NCCL on CPU):
    its push sequence, group membership and bucket layout are the real ones."""

    def _new_group(self, init_method, world, name):
        return (name, world)

    def _bucket_device(self):
        return torch.device("cpu")

    def _broadcast(self, parts, calls):
        # the bucket's bytes as they went out, back to back: one flat broadcast or one per tensor
        flat = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
        self.broadcasts = getattr(self, "broadcasts", []) + [(self._group, flat)]
        return 0.0


LOAD = "/update_weights_from_distributed"


def _serve(port: int) -> Recorder:
    srv = Recorder(set(), port)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _joins(srv):
    return [body for route, body in srv.calls if route == "/init_weights_update_group"]


def _loads(srv):
    return [body for route, body in srv.calls if route == LOAD]


def test_the_nccl_group_is_formed_again_without_a_restarting_server_and_with_it_once_back(server_factory):
    """Disaggregated runs: a dead server leaves the weight group. The next push forms a group of the
    servers it reaches (so the broadcast cannot wait on the dead one) and the relaunched server joins a
    new group with everyone at the catch-up, which gives it the last weights."""
    from buffer.net import free_port

    a, a_url = server_factory()
    port = free_port("127.0.0.1")
    b = _serve(port)
    sender = GroupSender(
        [a_url, f"http://127.0.0.1:{port}"], timeout_s=10, restart_grace_s=30, engine_tp_sizes=[1, 2]
    )
    assert _joins(a) + _joins(b) == []  # the first push forms the group, with the servers it reaches
    assert sender.push(1, _named()).result(timeout=10)["engines"] == 2
    assert [(j["rank_offset"], j["world_size"]) for j in _joins(a) + _joins(b)] == [(1, 4), (2, 4)]
    sender.push(2, _named()).result(timeout=10)
    assert len(_joins(a)) == 1  # same servers: the same group
    names = sender.group_names
    b.shutdown()
    b.server_close()  # the server died: connections are refused

    before = len(a.calls)
    out = sender.push(3, _named()).result(timeout=10)
    assert (out["engines"], out["engines_skipped"]) == (1, 1)
    assert [r for r, _ in a.calls[before:]] == [
        "/pause_generation",
        "/continue_generation",  # generating while the new group forms
        "/init_weights_update_group",
        "/pause_generation",
        LOAD,
        "/continue_generation",
    ]
    alone = _joins(a)[-1]
    assert (alone["group_name"], alone["rank_offset"], alone["world_size"]) == (names[1], 1, 2)
    assert _loads(a)[-1]["group_name"] == names[1] and names[1] != names[0]
    assert sender.broadcasts[-1][0] == (names[1], 2)  # broadcast over the new group
    sender.push(4, _named()).result(timeout=10)
    assert len(_joins(a)) == 2  # still down: no new group
    calls_before = len(a.calls)
    assert sender.catch_up().result(timeout=10)["engines"] == 0
    assert LOAD not in [r for r, _ in a.calls[calls_before:]]  # nobody back: nothing loaded again

    back = _serve(port)  # relaunched on its port, with the base model's weights
    caught = sender.catch_up().result(timeout=10)
    assert (caught["version"], caught["engines"], caught["engines_skipped"]) == (4, 2, 0)
    rejoined = _joins(back)[0]
    assert (rejoined["group_name"], rejoined["rank_offset"], rejoined["world_size"]) == (names[2], 2, 4)
    assert _joins(a)[-1]["group_name"] == names[2] and len(set(names)) == 3
    assert _loads(back)[-1]["weight_version"] == "4" and _loads(back)[-1]["group_name"] == names[2]
    assert sender.catch_up() is None
    sender.push(5, _named()).result(timeout=10)
    assert len(_joins(a)) == 3 and len(_joins(back)) == 1  # everyone back: the group stays
    back.shutdown()
    sender.close()


def test_a_lone_nccl_server_that_died_gets_a_new_group_when_it_is_back(server_factory):
    """The 2-GPU config has one server: while it is down a push reaches nobody (and drops the group),
    and the catch-up forms a new group with the relaunched server instead of broadcasting over the
    dead one's."""
    from buffer.net import free_port

    port = free_port("127.0.0.1")
    first = _serve(port)
    sender = GroupSender([f"http://127.0.0.1:{port}"], timeout_s=10, restart_grace_s=30)
    sender.push(1, _named()).result(timeout=10)
    first.shutdown()
    first.server_close()
    down = sender.push(2, _named()).result(timeout=10)
    assert (down["engines"], down["engines_skipped"]) == (0, 1) and len(sender.broadcasts) == 1
    back = _serve(port)
    caught = sender.catch_up().result(timeout=10)
    assert (caught["version"], caught["engines"]) == (2, 1)
    new = sender.group_names[1]
    assert [j["group_name"] for j in _joins(back)] == [new]
    assert _loads(back)[-1] == {**_loads(back)[-1], "group_name": new, "weight_version": "2"}
    assert sender.broadcasts[-1][0] == (new, 2)
    back.shutdown()
    sender.close()


def test_a_server_relaunched_between_two_pushes_is_noticed_and_joins_a_new_group(server_factory):
    """A server can die and come back between two pushes, so no push ever missed it: it answers with
    the base model's version instead of the last one pushed, which tells the sender it holds none of
    the groups, and the push forms a new one before loading."""
    from buffer.net import free_port

    port = free_port("127.0.0.1")
    first = _serve(port)
    sender = GroupSender([f"http://127.0.0.1:{port}"], timeout_s=10, restart_grace_s=30)
    sender.push(1, _named()).result(timeout=10)
    sender.push(2, _named()).result(timeout=10)
    assert len(_joins(first)) == 1  # it reports the version pushed last: the same group
    first.shutdown()
    first.server_close()
    back = _serve(port)  # relaunched before the next push
    out = sender.push(3, _named()).result(timeout=10)
    assert out["engines"] == 1
    assert [r for r, _ in back.calls][:4] == [
        "/pause_generation",
        "/model_info",
        "/continue_generation",
        "/init_weights_update_group",
    ]
    assert _loads(back)[-1]["group_name"] == sender.group_names[1] and back.weight_version == "3"
    back.shutdown()
    sender.close()


def test_the_nccl_bucket_is_the_tensors_bytes_back_to_back():
    """SGLang rebuilds each tensor from the flat bucket by its name, dtype and shape, in order: the
    layout is each tensor's bytes back to back (bf16 and fp32 mixed, a non-contiguous one included)."""
    from stages.weights.nccl_sender import flat_bucket

    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.arange(4, dtype=torch.float32) / 3
    c = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2).t()  # not contiguous
    flat = flat_bucket([("a", a), ("b", b), ("c", c)], "cpu")
    assert flat.dtype == torch.uint8 and flat.numel() == 12 + 16 + 12
    assert torch.equal(flat[:12].view(torch.bfloat16).reshape(2, 3), a)
    assert torch.equal(flat[12:28].view(torch.float32), b)
    assert torch.equal(flat[28:].view(torch.bfloat16).reshape(2, 3), c)


def test_a_server_that_refuses_to_join_fails_the_group_at_once_naming_it(server_factory):
    """Rank 0's rendezvous waits for every rank: a server that answers the join with an error must end
    the wait then, not after the rendezvous timeout (SGLang's default: 30 minutes)."""
    import time

    rendezvous_over = threading.Event()

    class Waiting(GroupSender):
        def _new_group(self, init_method, world, name):
            rendezvous_over.wait(30)  # rank 0 waits for a rank that never comes

    ok, ok_url = server_factory()
    bad, bad_url = server_factory(fail={"/init_weights_update_group"})
    t0 = time.monotonic()
    sender = Waiting([ok_url, bad_url], timeout_s=20)
    with pytest.raises(WeightPushError, match=f"{bad_url} did not join NCCL group slipstream-weights-"):
        sender.push(1, _named()).result(timeout=20)
    assert time.monotonic() - t0 < 5
    # nothing loaded, and it generates on: resumed after its last pause (its own join, sent on another
    # thread, may reach it after that)
    calls = [r for r, _ in ok.calls]
    last_pause = max(i for i, r in enumerate(calls) if r == "/pause_generation")
    assert "/continue_generation" in calls[last_pause:] and "/update_weights_from_distributed" not in calls
    rendezvous_over.set()


def test_flat_layout_rejects_misaligned_dtypes():
    check_flat_layout(
        [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2, dtype=torch.bfloat16))]
    )
    check_flat_layout(
        [("a", torch.zeros(2, dtype=torch.bfloat16)), ("b", torch.zeros(2, dtype=torch.float32))]
    )
    with pytest.raises(WeightPushError, match="b .*byte 6"):
        check_flat_layout(
            [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2, dtype=torch.float32))]
        )


# -- the engine-side protocol (SGLangEngine.updating), against the same recording server ------------


def _engine(url: str):
    from stages.rollout.config import SGLangConfig
    from stages.rollout.sglang_engine import SGLangEngine

    port = int(url.rsplit(":", 1)[1])
    return SGLangEngine("/nonexistent-model", SGLangConfig(control_timeout_s=10), port=port, start=False)


def _nccl_load(eng, version):
    return eng.update_weights_from_distributed(["w"], ["bfloat16"], [[4]], version=version)


def test_engine_update_sets_version_then_continues(server_factory):
    srv, url = server_factory()
    eng = _engine(url)
    t = _nccl_load(eng, 4)
    routes = [r for r, _ in srv.calls]
    assert routes == [
        "/pause_generation",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/continue_generation",
    ]
    assert srv.calls[2][1] == {"new_version": "4", "abort_all_requests": False}
    assert eng.version == 4 and {"pause_s", "load_s", "version_s", "continue_s"} <= set(t)


def test_engine_failed_tensor_load_stays_paused_and_says_so(server_factory):
    from stages.rollout.sglang_engine import EngineError

    srv, url = server_factory(fail={"/update_weights_from_distributed"})
    eng = _engine(url)
    with pytest.raises(EngineError, match="left paused with partly loaded weights"):
        _nccl_load(eng, 4)
    # no version label and no generation on weights of no version
    assert [r for r, _ in srv.calls] == ["/pause_generation", "/update_weights_from_distributed"]
    assert eng.version == 0


def test_engine_failed_disk_load_resumes_on_the_old_version(server_factory):
    srv, url = server_factory(fail={"/update_weights_from_disk"})
    eng = _engine(url)
    with pytest.raises(Exception, match="refused"):
        eng.update_weights_from_disk("/some/checkpoint", 3)  # SGLang rolls a failed disk load back
    assert [r for r, _ in srv.calls] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert eng.version == 0


def test_weight_buckets_default_by_transport_and_an_explicit_size_wins():
    """SGLang buckets are large by default (each costs an HTTP round trip into the server on top of its
    bytes: 30 buckets of 512 MB made a 7B NCCL push 4x its raw broadcast); the ZeroMQ transport keeps
    small ones; `weights.bucket_mb` set by the user applies to every transport."""
    from pipeline.config import ConfigError, load_config
    from stages.weights import make_sender

    w = load_config(None, []).weights
    assert [w.bucket_mb_for(t) for t in ("cpu", "cuda_ipc", "nccl")] == [64, 1024, 4096]
    set_by_user = load_config(None, ["weights.bucket_mb=256"]).weights
    assert {set_by_user.bucket_mb_for(t) for t in ("cpu", "cuda_ipc", "nccl")} == {256}
    sender = make_sender(w, min_engines=0)  # the CPU transport a default run builds
    assert sender.bucket_bytes == 64 << 20
    sender.close()
    with pytest.raises(ConfigError, match="bucket_mb >= 0"):
        load_config(None, ["weights.bucket_mb=-1"])


def test_the_nccl_receive_chosen_in_the_config_is_the_one_the_pushes_ask_the_servers_for(
    monkeypatch, server_factory
):
    """weights.nccl_receive=per_tensor: each load asks for SGLang's per-tensor receive (no load_format)
    and the bucket goes out as one broadcast per tensor, in the load's order, from the tensors themselves
    where they can be; flat: one flattened_bucket broadcast; auto (the default): per_tensor for a bucket
    of large tensors (a 7B model's), flat for one of small tensors (a 135M model's), where the NCCL
    calls cost more than the flat receive's copies. A misspelt value is refused naming the choices."""
    from pipeline.config import ConfigError, load_config
    from stages.weights import make_sender
    from stages.weights.config import PER_TENSOR_MIN_MEAN_MB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the sender's CUDA check
    sent, sent_from = [], []

    class Recorded(NcclSGLangSender):  # the real sender, its group and broadcast recorded on CPU
        def _new_group(self, init_method, world, name):
            return (name, world)

        def _bucket_device(self):
            return torch.device("cpu")

        def _start_broadcast(self, parts, stream):
            sent.append([p.clone() for p in parts])
            sent_from.append([p.data_ptr() for p in parts])
            return _AllDone()

    small = [
        ("a", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)),
        ("b", torch.ones(4, 2).t()),
    ]  # b strided
    big_rows = (PER_TENSOR_MIN_MEAN_MB << 20) // (2 * 1024)  # bf16 rows of 1024: the crossover's size
    big = [(n, torch.full((big_rows, 1024), float(i), dtype=torch.bfloat16)) for i, n in enumerate("cd")]
    cases = [("flat", small, True), ("per_tensor", small, False), ("auto", small, True), ("auto", big, False)]
    for receive, named, flat in cases:
        srv, url = server_factory()
        overrides = ["weights.transport=nccl", "weights.bucket_mb=64"]
        w = load_config(
            None, overrides + ([f"weights.nccl_receive={receive}"] if receive != "auto" else [])
        ).weights
        assert w.nccl_receive == receive
        sender = make_sender(w, engine_urls=[url])
        assert type(sender) is NcclSGLangSender
        sender.__class__ = Recorded
        sent.clear()
        sent_from.clear()
        try:
            sender.push(1, named).result(timeout=30)
        finally:
            sender.close()
        (load,) = _loads(srv)
        if flat:
            assert load["load_format"] == "flattened_bucket" and [p.dtype for p in sent[0]] == [torch.uint8]
        else:
            assert "load_format" not in load
            assert [(p.dtype, p.shape) for p in sent[0]] == [(t.dtype, t.shape) for _, t in named]
            assert all(torch.equal(p, t) for p, (_, t) in zip(sent[0], named))
            # a contiguous tensor already on the push's device goes out as it is, with no copy
            assert [p == t.data_ptr() for p, (_, t) in zip(sent_from[0], named)] == [
                t.is_contiguous() for _, t in named
            ]
    with pytest.raises(ConfigError, match="nccl_receive: .*choose one of auto, flat, per_tensor"):
        load_config(None, ["weights.nccl_receive=per-tensor"])


class _AllDone:
    def is_completed(self):
        return True

    def wait(self):
        pass


def test_a_broadcast_that_a_dead_server_will_never_finish_is_given_up_at_once_or_at_the_timeout():
    """NCCL's broadcast to a server that died never completes (the GPU kernel waits for the peer), so
    the push watches it beside the servers' load calls: a call that finds its server gone ends the
    wait at once with that server's name, and without such news the wait ends at weights.timeout_s
    naming the servers still receiving, never in NCCL's watchdog ending the trainer."""
    import concurrent.futures as cf
    import threading
    import time

    from stages.weights.base import WeightPushError
    from stages.weights.nccl_sender import await_broadcast

    class Stuck:  # a broadcast whose peer is gone
        def is_completed(self):
            return False

    def started(work):  # the broadcast call returned this work
        f = cf.Future()
        f.set_result(work)
        return f

    gone = WeightPushError("SGLang server http://b/update_weights_from_distributed unreachable: reset")
    gone.unreachable = True
    release = threading.Event()  # ends the calls still "receiving" when the test is done
    with cf.ThreadPoolExecutor(3) as pool:
        alive = pool.submit(release.wait, 30)  # still in its receive
        dead = pool.submit(lambda: (time.sleep(0.2), (_ for _ in ()).throw(gone)))
        t0 = time.monotonic()
        assert await_broadcast(started(Stuck()), {"http://a": alive, "http://b": dead}, t0 + 20) == [
            "http://b"
        ]
        assert time.monotonic() - t0 < 2
        slow = pool.submit(release.wait, 30)
        t0 = time.monotonic()
        with pytest.raises(
            WeightPushError, match=r"within weights.timeout_s .*still receiving: \['http://a'\]"
        ):
            await_broadcast(started(Stuck()), {"http://a": slow}, t0 + 0.5)
        assert time.monotonic() - t0 < 2
        refused = WeightPushError(
            "SGLang server http://a/update_weights_from_distributed failed: no such group"
        )
        failing = pool.submit(lambda: (_ for _ in ()).throw(refused))
        with pytest.raises(WeightPushError, match="no such group"):  # out of its receive: no wait
            await_broadcast(started(Stuck()), {"http://a": failing}, time.monotonic() + 20)
        release.set()

    class Done:
        def is_completed(self):
            return True

    assert await_broadcast(started(Done()), {}, 0.0) == []  # a finished broadcast is never a failure
    # a broadcast call that never returns (NCCL setting up a new group's communicator with a dead
    # server) is waited for the same way: the dead server's call ends the wait
    never = cf.Future()
    assert await_broadcast(never, {"http://b": dead}, time.monotonic() + 20) == ["http://b"]


def test_a_broadcast_to_a_server_that_died_aborts_the_weight_group_and_names_the_server(monkeypatch):
    """Rank 0's side: the broadcast (which would never finish) is left, the group's communicator
    aborted so that nothing waits in it, the group forgotten so the next push forms a new one, and the
    error carries the dead server for the push to leave out."""
    import concurrent.futures as cf

    import torch

    from stages.weights.base import WeightPushError
    from stages.weights.nccl_sender import NcclSGLangSender

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the sender's CUDA check

    class Stuck:
        def is_completed(self):
            return False

    class Group:
        aborted = False

        def abort(self):
            self.aborted = True

    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: Stuck())
    sender = NcclSGLangSender(["http://a"], timeout_s=30, restart_grace_s=60)
    group = sender._group = Group()
    sender._members = ["http://a"]
    gone = WeightPushError("SGLang server http://a/update_weights_from_distributed unreachable: reset")
    gone.unreachable = True
    call = cf.Future()
    call.set_exception(gone)
    try:
        with pytest.raises(WeightPushError, match=r"went away during the push") as err:
            sender._broadcast([torch.zeros(8, dtype=torch.uint8)], {"http://a": call})
        assert err.value.lost == ["http://a"]
        assert group.aborted and sender._group is None and sender._members == []
    finally:
        sender.close()


def test_a_direct_push_loads_each_bucket_as_it_is_gathered_and_drains_the_gathers_when_it_fails(
    server_factory,
):
    """weights.snapshot=direct: the tensors come from a lazy source whose every step is a gather all
    trainer ranks make in step. The push takes them bucket by bucket, looking one tensor ahead (the
    last bucket carries the version), with the servers paused for only that; it keeps nothing; and
    when a load fails, the rest of the source is still consumed, or the other ranks would wait in
    their gathers for good."""
    srv, url = server_factory()
    sender = GroupSender([url], timeout_s=10, restart_grace_s=30)
    sender.bucket_bytes = 8192  # two 4 KB tensors a bucket
    pulled: list[str] = []
    sent_after: list[int] = []  # how many tensors had been gathered at each broadcast
    gathers = []  # weak references to what the source gathered
    alive_at_send = []  # how many gathered tensors still lived at each broadcast

    def gathered(n):
        for i in range(n):
            pulled.append(f"w{i}")
            t = torch.full((1024,), float(i))
            gathers.append(weakref.ref(t))
            yield f"w{i}", t
            del t

    record = GroupSender._broadcast

    buffers = []  # the storage each broadcast sent from

    def broadcast(self, parts, calls):
        sent_after.append(len(pulled))
        alive_at_send.append(sum(r() is not None for r in gathers))
        buffers.append(parts[0].untyped_storage().data_ptr())
        return record(self, parts, calls)

    sender._broadcast = broadcast.__get__(sender)
    out = sender.push_now(7, gathered(5))
    assert (out["engines"], out["bytes"]) == (1, 5 * 4096)
    assert sent_after == [3, 5, 5]  # buckets [w0 w1] [w2 w3] [w4], each sent one tensor ahead
    # each tensor was packed into one reused buffer as it came and let go (only the one looked ahead at
    # lives at a send), and that buffer is what went out (no flat copy)
    assert alive_at_send == [1, 1, 0] and len(set(buffers)) == 1
    sent = [flat.view(torch.float32) for _, flat in sender.broadcasts]
    assert [t.tolist() for t in sent] == [
        [0.0] * 1024 + [1.0] * 1024,
        [2.0] * 1024 + [3.0] * 1024,
        [4.0] * 1024,
    ]
    loads = _loads(srv)
    assert [len(b["names"]) for b in loads] == [2, 2, 1]
    assert ["weight_version" in b for b in loads] == [False, False, True] and loads[-1][
        "weight_version"
    ] == "7"
    assert sender._last is None  # nothing kept

    srv.fail.add(LOAD)  # the server refuses a load: the push fails, the gathers go on
    pulled.clear()
    with pytest.raises(WeightPushError):
        sender.push_now(8, gathered(5))
    assert pulled == [f"w{i}" for i in range(5)]
    sender.close()


def test_after_a_direct_push_that_left_a_server_out_the_trainer_is_asked_to_push_again(server_factory):
    """A direct push keeps nothing for catch_up(): the server it left out (restarting) is named by
    needs_push() once it answers with older weights, and the trainer pushes its current weights again."""
    from buffer.net import free_port

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    sender = GroupSender([url], timeout_s=10, restart_grace_s=30)
    taken = []

    def gathered():  # the other ranks gather in step: taken to the end even with nobody to load into
        for item in _named():
            taken.append(item[0])
            yield item

    down = sender.push_now(3, gathered())  # nothing listens on the port yet
    assert (down["engines"], down["engines_skipped"]) == (0, 1)
    assert taken == ["w0", "w1", "w2"]
    assert sender.catch_up() is None  # no tensors kept to catch it up with
    back = _serve(port)  # relaunched: the base model, version 0
    sender._probed_at = float("-inf")
    assert sender.needs_push() == [url]
    again = sender.push_now(3, iter(_named()))
    assert again["engines"] == 1 and _loads(back)[-1]["weight_version"] == "3"
    back.shutdown()
    sender.close()


def test_a_lone_server_that_dies_in_its_load_is_left_out_and_caught_up_later(server_factory):
    """The shared push sequence, as the CUDA IPC sender runs it (one POST per bucket): the push's only
    server goes away while it loads. Nothing holds partly loaded weights, so the push ends without it,
    as if it had been down at its pause, and keeps the tensors for catch_up(); without an engine watch
    (no restart grace) that is an error naming the paused servers."""
    srv, url = server_factory()
    srv.die = {"/load"}
    sender = PostSender([url], timeout_s=10, restart_grace_s=30)
    out = sender.push(4, _named()).result(timeout=10)
    assert (out["engines"], out["engines_skipped"]) == (0, 1)
    assert sender._last is not None and sender._last[0] == 4  # for the relaunch's catch_up
    sender.close()
    strict = PostSender([url], timeout_s=10)  # no engine watch: nobody relaunches it
    with pytest.raises(WeightPushError, match="left paused with partly loaded weights"):
        strict.push(5, _named()).result(timeout=10)
    strict.close()


def test_a_server_partly_loaded_when_another_died_stays_paused_until_pushed_and_is_forgotten_once_down(
    server_factory,
):
    """Two servers; the first dies in its load (no answer, connection gone). The second, reached next,
    is left paused (no continue: its weights are of no version) and named by needs_push() at once.
    Should it then go down itself, its relaunch holds whole (base) weights: it waits for catch_up like
    any server found down, and needs_push() stops asking for a push of it."""
    dying, url_a = server_factory()
    survivor, url_b = server_factory()
    dying.die = {"/load"}
    sender = PostSender([url_a, url_b], timeout_s=10, restart_grace_s=30)
    out = sender.push(4, _named()).result(timeout=10)
    assert out["engines"] == 0
    assert [r for r, _ in survivor.calls] == ["/pause_generation"]
    assert sender.needs_push() == [url_b]

    for srv in (dying, survivor):  # both down now: their engine watches relaunch them
        srv.shutdown()
        srv.server_close()
    down = sender.push(5, _named()).result(timeout=10)
    assert (down["engines"], down["engines_skipped"]) == (0, 2)
    assert sender.needs_push() == []  # left to catch_up, which keeps version 5 for them
    assert sender._last is not None and sender._last[0] == 5
    sender.close()
