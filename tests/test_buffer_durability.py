"""The buffer's durability promises, checked at the syscall they rest on (docs/DESIGN.md):
an ingest is acked only after its segment write is fsynced, and a fetch is fsynced into the
consumption log before its reply goes out.

Each test holds the fsync of the relevant file (os.fsync/os.fdatasync on that file block on a
condition until the test releases them) and checks that nothing promising durability leaves the
server meanwhile, then that it does leave once the fsync returns. A counter of fsyncs could not see
an ack sent before (or without) the fsync; this can.
"""

import os
import threading

import pytest
import zmq

from buffer import wire
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.frames import frames_to_batches
from buffer.segments import LOG_NAME, SEGMENT_GLOB, iter_log, read_segment
from buffer.server import BufferServer

WAIT_S = 5.0  # how long a reply or fsync that must come may take (only reached when a test fails)
QUIET_MS = 300  # how long to listen for a reply that must NOT come while an fsync is held


class FsyncGate:
    """Stands in for os.fsync and os.fdatasync. While `held`, a call on a file of `directory` matching
    `pattern` waits until the test lets that call through (`release`), one call at a time; every other
    call goes straight to the real function."""

    def __init__(self, monkeypatch, directory, pattern: str):
        self.directory, self.pattern = directory, pattern
        self.held = False
        self.entered = 0  # matching calls that reached the gate while held
        self.released = 0  # how many of those may go on
        self._cond = threading.Condition()
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._gated(getattr(os, name)))

    def _matches(self, fd: int) -> bool:
        st = os.fstat(fd)
        return any(os.path.samestat(st, p.stat()) for p in self.directory.glob(self.pattern))

    def _gated(self, real):
        def call(fd):
            if self.held and self._matches(fd):
                with self._cond:
                    self.entered += 1
                    n = self.entered
                    self._cond.notify_all()
                    # bounded so that a failing test cannot hang the server's threads for good
                    self._cond.wait_for(lambda: self.released >= n or not self.held, 4 * WAIT_S)
            return real(fd)

        return call

    def hold(self) -> None:
        self.held = True

    def wait_entered(self, n: int) -> bool:
        """True once the n-th held call has reached the gate."""
        with self._cond:
            return self._cond.wait_for(lambda: self.entered >= n, WAIT_S)

    def release(self, n: int = 1) -> None:
        with self._cond:
            self.released += n
            self._cond.notify_all()

    def open(self) -> None:
        """Let everything through from now on."""
        with self._cond:
            self.held = False
            self._cond.notify_all()


@pytest.fixture
def buf_dir(tmp_path):
    return tmp_path / "buf"


@pytest.fixture
def server(buf_dir):
    srv = BufferServer(BufferConfig(policy="fifo", capacity_samples=64), buf_dir).start()
    yield srv
    srv.stop()


@pytest.fixture
def seg_gate(monkeypatch, server, buf_dir):
    gate = FsyncGate(monkeypatch, buf_dir, SEGMENT_GLOB)
    yield gate
    gate.open()  # before the server stops: its close() fsyncs too


@pytest.fixture
def log_gate(monkeypatch, server, buf_dir):
    gate = FsyncGate(monkeypatch, buf_dir, LOG_NAME)
    yield gate
    gate.open()


@pytest.fixture
def sock(server):
    """A raw DEALER socket: the protocol exactly as a producer speaks it, with no client-side resends."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.address)
    yield s
    s.close()


def send_ingest(sock, seq: int, prefix: str) -> list[str]:
    samples = synthetic_samples(1, group_size=2, response_len=8, prefix=prefix)
    sock.send(wire.encode(wire.Ingest(req=seq, producer="dur", seq=seq, samples=samples)))
    return [s.uid for s in samples]


def next_reply(sock) -> tuple[wire.Msg, list]:
    assert sock.poll(WAIT_S * 1000), "the server sent no reply"
    frames = sock.recv_multipart()
    return wire.decode(frames[0]), frames


def replies_before_barrier(sock, rounds: int = 2) -> tuple[list, dict]:
    """Everything the server sends before answering `rounds` stats requests one after another, and
    the last stats. The loop sends due acks in every iteration, and ZeroMQ keeps a connection's
    order, so an ack the server would send at this point arrives before the last stats reply."""
    early = []
    for r in range(rounds):
        req = 1_000_000 + r
        sock.send(wire.encode(wire.StatsRequest(req=req)))
        while True:
            msg, _ = next_reply(sock)
            if isinstance(msg, wire.StatsReply) and msg.req == req:
                break
            early.append(msg)
    return early, msg.stats


def test_no_ack_before_the_segment_fsync_returns(seg_gate, sock, buf_dir):
    """A producer drops its copy of an ingest once acked, so the ack must not leave before the
    batch's segment fsync has returned; once it returns, the ack follows and the rows are on disk."""
    seg_gate.hold()
    uids = send_ingest(sock, 1, "a")
    assert seg_gate.wait_entered(1), "the segment writer never fsynced the ingested batch"
    early, stats = replies_before_barrier(sock)
    assert early == [], f"sent while the segment fsync was held: {early}"
    assert stats["unacked_ingests"] == 1
    assert not sock.poll(QUIET_MS), f"sent while the segment fsync was held: {next_reply(sock)[0]}"

    seg_gate.release()
    ack, _ = next_reply(sock)
    assert isinstance(ack, wire.IngestAck) and (ack.seq, ack.accepted) == (1, 2)
    stored = [
        u
        for p in sorted(buf_dir.glob(SEGMENT_GLOB))
        for b in read_segment(p)[0]
        for u in b["uid"].to_pylist()
    ]
    assert stored == uids


def test_an_fsync_acks_only_the_batches_it_covered(seg_gate, sock):
    """Group commit: an ingest that arrives while an fsync is under way is not covered by it, so
    that fsync's return must ack only the earlier ingest; the later one waits for the next fsync."""
    seg_gate.hold()
    send_ingest(sock, 1, "a")
    assert seg_gate.wait_entered(1), "the segment writer never fsynced the first ingest"
    send_ingest(sock, 2, "b")  # committed while the first fsync is held
    early, stats = replies_before_barrier(sock)
    assert early == [] and stats["unacked_ingests"] == 2

    seg_gate.release()  # the first fsync returns; the second (for seq 2) is held in turn
    ack, _ = next_reply(sock)
    assert isinstance(ack, wire.IngestAck) and ack.seq == 1
    assert seg_gate.wait_entered(2), "the second ingest was never fsynced"
    early, stats = replies_before_barrier(sock)
    assert early == [], f"acked by an fsync that did not cover it: {early}"
    assert stats["unacked_ingests"] == 1

    seg_gate.release()
    ack, _ = next_reply(sock)
    assert isinstance(ack, wire.IngestAck) and ack.seq == 2


def test_no_fetch_reply_before_the_consumption_log_fsync_returns(server, log_gate, sock, buf_dir):
    """Consumption is at most once: what a fetch hands out must be durably logged as served before
    the reply leaves, or a crash right after would serve the same rows again after restart."""
    uids = send_ingest(sock, 1, "a")
    assert isinstance(next_reply(sock)[0], wire.IngestAck)

    log_gate.hold()
    sock.send(
        wire.encode(wire.Fetch(req=7, consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=5))
    )
    if not log_gate.wait_entered(1):
        early = type(next_reply(sock)[0]).__name__ if sock.poll(0) else "nothing"
        pytest.fail(f"the fetch never fsynced {LOG_NAME}; the server sent {early}")
    # The loop thread itself is in that fsync, so no stats barrier can pass: listen for a while.
    assert not sock.poll(QUIET_MS), f"sent while the log fsync was held: {next_reply(sock)[0]}"

    log_gate.release()
    reply, frames = next_reply(sock)
    assert isinstance(reply, wire.FetchReply) and reply.req == 7 and reply.num_samples == 2
    served = [u for b in frames_to_batches(reply.layout, frames[1:]) for u in b["uid"].to_pylist()]
    assert served == uids
    assert [r.uids for r in iter_log(buf_dir) if r.op == "served"] == [uids]
