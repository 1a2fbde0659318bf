"""Exactly-once consumption across buffer kills (issue #36), control-message validation, fetch leases,
and the one-line errors of `python -m buffer serve`.

The heart: a real `python -m buffer serve` process SIGKILLs itself (the test hook
SLIPSTREAM_BUFFER_TEST_HOOK_KILL_AFTER_SERVED, buffer/fetch_room.py) right after the consumption log's
"served" record for a fetch is fsynced and before the reply is sent: the window in which the rows used
to be lost. The client's resend (same request id) to the restarted server must get exactly those rows,
and no later fetch may get them again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from buffer import wire
from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.fetch_room import _REPLAY_GAP_S, TEST_HOOK_KILL_AFTER_SERVED
from buffer.record import samples_to_batch
from buffer.segments import iter_log
from buffer.server import BufferServer
from buffer.storage import Buffer
from buffer.transport import BufferUnavailable

REPO = Path(__file__).resolve().parent.parent


def start_server(directory: Path, bind: str, kill_after_served: int = 0) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(TEST_HOOK_KILL_AFTER_SERVED, None)
    if kill_after_served:
        env[TEST_HOOK_KILL_AFTER_SERVED] = str(kill_after_served)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "buffer",
            "serve",
            "--dir",
            str(directory),
            "--bind",
            bind,
            "--policy",
            "fifo",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if not line.startswith("buffer listening on "):
        proc.kill()
        raise AssertionError(f"server did not start: {line}{proc.stdout.read()}")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    proc.stdout.close()


def served_records(directory: Path) -> list:
    return [r for r in iter_log(directory) if r.op == "served"]


def _dealer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _reply(sock: zmq.Socket, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "no reply"
    frames = sock.recv_multipart(copy=False)
    return wire.decode(frames[0].buffer), frames


def _uids(reply: wire.FetchReply, frames) -> list[str]:
    from buffer.client import _reply_batches

    if not reply.num_samples:
        return []
    return [u for b in _reply_batches(reply, frames) for u in b.column("uid").to_pylist()]


@pytest.mark.timeout(60)
def test_sigkill_between_served_fsync_and_send_resend_gets_the_same_rows(tmp_path):
    """Before: the resend after the restart was a new fetch; the logged rows were never delivered."""
    directory = tmp_path / "buf"
    proc, addr = start_server(directory, "tcp://127.0.0.1:0", kill_after_served=1)
    producer = BufferClient(addr, producer="gen", timeout_s=20, resend_s=0.2)
    trainer = BufferClient(addr, producer="trainer", timeout_s=20, resend_s=0.2)
    try:
        producer.put(synthetic_samples(3, group_size=2))  # acked: durable
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("b", trainer.fetch(1, 0, 0, timeout_s=10)))
        t.start()
        assert proc.wait(20) == -signal.SIGKILL, "the test hook did not kill the server"
        proc.stdout.close()
        (logged,) = served_records(directory)  # fsynced before the kill; the reply never left
        assert logged.consumer == "trainer" and len(logged.uids) == 2
        assert t.is_alive(), "the trainer got a reply from a server that died before sending it"
        proc, addr2 = start_server(directory, addr)  # same address and directory, no hook
        assert addr2 == addr
        t.join(20)
        assert not t.is_alive() and got["b"] is not None
        assert got["b"].column("uid").to_pylist() == logged.uids  # the resend got exactly those rows
        # the next fetches get the other groups, never those rows again
        rest = []
        while (b := trainer.fetch(1, 0, 0, timeout_s=0.3)) is not None:
            rest += b.column("uid").to_pylist()
        assert not set(rest) & set(logged.uids)
        assert sorted(rest + logged.uids) == sorted(s.uid for s in synthetic_samples(3, group_size=2))
        st = trainer.stats()
        assert st["replayed_fetches"] >= 1 and st["recovery"]["replayable_fetches"] == 1
        assert st["served_samples"] == 4  # counted in this process: only the 2 new fetches' rows
    finally:
        producer.close()
        trainer.close()
        stop(proc)


@pytest.mark.timeout(60)
def test_a_fetch_that_gave_up_keeps_its_request_id(tmp_path):
    """The client advances its fetch request id only once it has the reply: a trainer whose fetch raised
    BufferUnavailable (the server died after logging the rows as served) gets those rows from its next
    fetch. Before: the next fetch had a new id and the rows were lost."""
    directory = tmp_path / "buf"
    proc, addr = start_server(directory, "tcp://127.0.0.1:0", kill_after_served=1)
    producer = BufferClient(addr, producer="gen", timeout_s=20, resend_s=0.2)
    trainer = BufferClient(addr, producer="trainer", timeout_s=20, resend_s=0.2)
    try:
        producer.put(synthetic_samples(2, group_size=2))
        with pytest.raises(BufferUnavailable):
            trainer.fetch(1, 0, 0, timeout_s=1.0, grace_s=0.5)
        assert proc.wait(20) == -signal.SIGKILL
        proc.stdout.close()
        (logged,) = served_records(directory)
        proc, _ = start_server(directory, addr)
        first = trainer.fetch(1, 0, 0, timeout_s=5)
        assert first is not None and first.column("uid").to_pylist() == logged.uids
        second = trainer.fetch(1, 0, 0, timeout_s=5)
        assert second is not None and not set(second.column("uid").to_pylist()) & set(logged.uids)
        assert trainer.fetch(1, 0, 0, timeout_s=0.2) is None
    finally:
        producer.close()
        trainer.close()
        stop(proc)


@pytest.fixture
def server(tmp_path):
    srv = BufferServer(BufferConfig(capacity_samples=64, policy="fifo"), tmp_path / "buf").start()
    yield srv
    srv.stop()


def _wait_for(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_resends_in_each_order_consume_one_group(server):
    """Deterministic (the old refetch test sent three copies at once and caught a planted bug 1 run in
    10): a resend while the fetch waits, a resend after its reply, and a late resend of a fetch the
    consumer has since acknowledged (by fetching with a new id), each in a fixed order."""
    producer = BufferClient(server.address, producer="p", timeout_s=10)
    sock = _dealer(server.address)
    try:

        def fetch(req: int, **kw) -> wire.Fetch:
            return wire.Fetch(
                req=(1 << 40) + req, consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=5, **kw
            )

        sock.send_multipart([wire.encode(fetch(1))])
        _wait_for(lambda: producer.stats()["pending_fetches"] == 1)
        sock.send_multipart([wire.encode(fetch(1))])  # resend while waiting: same fetch
        _wait_for(lambda: producer.stats()["messages"] >= 3)
        assert producer.stats()["pending_fetches"] == 1
        producer.put(synthetic_samples(3, group_size=2))
        first = _uids(*_reply(sock))
        assert len(first) == 2 and not sock.poll(200)
        time.sleep(_REPLAY_GAP_S + 0.05)  # (a burst of resends within the gap gets one copy)
        sock.send_multipart([wire.encode(fetch(1))])  # resend after the reply: the same rows again
        assert _uids(*_reply(sock)) == first
        st = producer.stats()
        assert st["served_groups"] == 1 and st["replayed_fetches"] == 1
        sock.send_multipart([wire.encode(fetch(2))])  # a new id: acknowledges fetch 1
        second = _uids(*_reply(sock))
        assert len(second) == 2 and not set(second) & set(first)
        sock.send_multipart([wire.encode(fetch(1))])  # a late resend of an acknowledged fetch: dropped
        assert not sock.poll(300), "a resend of an acknowledged fetch was answered"
        st = producer.stats()
        assert st["served_groups"] == 2 and st["pending_fetches"] == 0
    finally:
        sock.close(0)
        producer.close()


def test_a_dead_consumers_parked_fetch_consumes_nothing(server):
    """Before: the fetch of a trainer killed while it waited took the next groups, for nobody."""
    producer = BufferClient(server.address, producer="p", timeout_s=10)
    dead = _dealer(server.address)
    live = BufferClient(server.address, producer="live", timeout_s=10, resend_s=0.1)  # lease 2 s
    try:
        msg = wire.Fetch(
            req=(1 << 40) + 1,
            consumer="dead",
            num_groups=1,
            version=0,
            max_staleness=0,
            timeout_s=60,
            lease_s=0.5,
        )
        dead.send_multipart([wire.encode(msg)])
        _wait_for(lambda: producer.stats()["pending_fetches"] == 1)
        dead.close(0)  # the requester is gone and never resends
        _wait_for(lambda: producer.stats()["expired_fetch_leases"] == 1)
        assert producer.stats()["pending_fetches"] == 0
        # a live client's resends renew its lease: it waits past the lease and still gets its rows
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("b", live.fetch(1, 0, 0, timeout_s=10)))
        t.start()
        time.sleep(2.6)
        producer.put(synthetic_samples(2, group_size=2))
        t.join(10)
        assert got["b"] is not None and got["b"].num_rows == 2
        st = producer.stats()
        assert st["expired_fetch_leases"] == 1 and st["served_groups"] == 1 and st["complete_groups"] == 1
    finally:
        producer.close()
        live.close()


@pytest.mark.parametrize(
    "msg, text",
    [
        (wire.SetVersion(version=-7), "version=-7 outside [0, 4611686018427387904]"),
        (wire.SetVersion(version=2**63 - 1), "version=9223372036854775807 outside"),
        (wire.Fetch(consumer="t", num_groups=1, version=-5, max_staleness=0, timeout_s=0), "version=-5"),
        (wire.Fetch(consumer="", num_groups=1, version=0, max_staleness=0, timeout_s=0), "consumer is empty"),
        (wire.Fetch(consumer="t\x00", num_groups=1, version=0, max_staleness=0, timeout_s=0), "control char"),
        (wire.Fetch(consumer="t", num_groups=2**40, version=0, max_staleness=0, timeout_s=0), "num_groups="),
        (
            wire.Fetch(consumer="t", num_groups=1, version=0, max_staleness=-1, timeout_s=0),
            "max_staleness=-1",
        ),
        (
            wire.Fetch(consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=float("nan")),
            "timeout_s=nan",
        ),
        (
            wire.Fetch(consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=float("inf")),
            "timeout_s=inf",
        ),
        (
            wire.Fetch(consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=1, lease_s=-1.0),
            "lease_s=-1.0",
        ),
        (wire.Peek(limit=-1), "limit=-1"),
        (wire.IngestBatch(producer="", seq=1, num_samples=0), "producer is empty"),
        (wire.IngestBatch(producer="p", seq=-1, num_samples=0), "seq=-1"),
    ],
)
def test_control_messages_out_of_range_are_refused_and_counted(server, msg, text):
    producer = BufferClient(server.address, producer="p", timeout_s=10)
    sock = _dealer(server.address)
    try:
        producer.put(synthetic_samples(2, group_size=2, version=3))
        producer.set_version(3)
        before = producer.stats()
        frames = [wire.encode(msg)] + ([b"x"] if isinstance(msg, wire.IngestBatch) else [])
        sock.send_multipart(frames)
        reply, _ = _reply(sock)
        assert isinstance(reply, wire.Error) and text in reply.reason, reply
        st = producer.stats()
        assert st["rejects"].get("invalid_control") == 1
        assert st["rows"] == before["rows"] == 4 and st["version"] == 3  # nothing evicted or changed
        assert st["evicted_stale"] == st.get("evicted_future", 0) == 0
    finally:
        sock.close(0)
        producer.close()


def test_client_set_version_negative_raises(server):
    c = BufferClient(server.address, producer="t", timeout_s=10)
    try:
        with pytest.raises(wire.ProtocolError, match="version=-7 outside"):
            c.set_version(-7)
        c.set_version(2**62)  # the bound itself is accepted
        assert c.stats()["version"] == 2**62
    finally:
        c.close()


@pytest.mark.parametrize(
    "field, value, text",
    [
        ("reward", 2e6, "MAX_ABS_REWARD"),
        ("reward", -1e7, "MAX_ABS_REWARD"),
        ("created_at", 1.7e12, "created_at 1700000000000.0 outside [0, 4294967296] (MAX_TIMESTAMP)"),
        ("created_at", float("nan"), "MAX_TIMESTAMP"),
        ("finished_at", -1.0, "finished_at -1.0 outside"),
        ("finished_at", float("inf"), "MAX_TIMESTAMP"),
    ],
)
def test_samples_with_insane_rewards_or_timestamps_are_refused(server, field, value, text):
    c = BufferClient(server.address, producer="p", timeout_s=10)
    try:
        samples = synthetic_samples(1, group_size=2)
        samples[1] = msgspec.structs.replace(samples[1], **{field: value})
        with pytest.raises(wire.ProtocolError, match=re.escape(text)):
            c.put(samples)
        with pytest.raises(ValueError, match="MAX_"):
            samples[1].validate()
        st = c.stats()
        assert st["rejects"] == {"invalid_sample": 1} and st["rows"] == 0
    finally:
        c.close()


def test_fetch_waits_for_its_rows_segment_write(tmp_path, monkeypatch):
    """Rows committed but not yet fsynced into a segment are not handed out before they are durable:
    after a crash, a resend of the fetch is answered from the segments."""
    buf = Buffer(BufferConfig(capacity_samples=64, policy="fifo"), tmp_path / "buf")
    gate = threading.Event()
    real = os.fsync

    def held(fd):
        if any(os.path.samestat(os.fstat(fd), p.stat()) for p in (tmp_path / "buf").glob("seg-*.arrow")):
            gate.wait(10)
        return real(fd)

    monkeypatch.setattr(os, "fsync", held)
    try:
        buf.commit(buf.plan(samples_to_batch(synthetic_samples(1, group_size=2))))
        done = threading.Event()
        t = threading.Thread(target=lambda: (buf.fetch(1, 0, 0, consumer="t", req=1), done.set()))
        t.start()
        assert not done.wait(0.3), "rows were served before their segment write was durable"
        gate.set()
        assert done.wait(5)
        t.join()
    finally:
        gate.set()
        buf.close()
    buf2 = Buffer(BufferConfig(capacity_samples=64, policy="fifo"), tmp_path / "buf")
    try:
        req, pieces, groups = buf2.recovered_replies["t"]
        assert req == 1 and groups == 1 and pieces[0].num_rows == 2
    finally:
        buf2.close()


@pytest.mark.parametrize(
    "args",
    [
        ["--capacity", "0"],
        ["--policy", "uniform", "--max-times-sampled", "0"],
        ["--bind", "tcp://999.1.1.1:5"],
    ],
)
def test_serve_bad_argument_is_one_line_without_traceback(tmp_path, args):
    proc = subprocess.run(
        [sys.executable, "-m", "buffer", "serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and out.strip().count("\n") == 0, out
    assert out.startswith("python -m buffer serve: error: "), out
