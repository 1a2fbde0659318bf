"""A fetch outlives its server: the client resends it until answered, a restarted server on the same
address and directory serves it, and a resend that reaches the same server never consumes twice (it is
answered with the same rows; tests/test_buffer_exactly_once.py covers kills between log and reply)."""

from __future__ import annotations

import threading
import time

import zmq

from buffer import wire
from buffer.client import BufferClient, _reply_batches
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.fetch_room import _REPLAY_GAP_S
from buffer.segments import iter_log
from buffer.server import BufferServer


def test_a_resent_fetch_is_served_once(tmp_path):
    """Deterministic: each resend goes out only after the server has answered (the old version sent
    three copies at once, and whether one crossed the reply was up to the scheduler: it caught a planted
    bug once in ten runs). A resend of a served fetch gets the same rows again, never other rows."""
    srv = BufferServer(BufferConfig(capacity_samples=64), tmp_path / "buf").start()
    producer = BufferClient(srv.address, producer="p", timeout_s=10)
    producer.put(synthetic_samples(4, group_size=2))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)

    def uids() -> list[str]:
        assert sock.poll(5000)
        frames = sock.recv_multipart(copy=False)
        reply = wire.decode(frames[0].buffer)
        assert isinstance(reply, wire.FetchReply) and reply.num_groups == 1
        return [u for b in _reply_batches(reply, frames) for u in b.column("uid").to_pylist()]

    try:
        fetch = wire.Fetch(
            req=(1 << 40) + 5, consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=5
        )
        sock.send_multipart([wire.encode(fetch)])
        first = uids()
        for _ in range(2):  # a client resending the same request id after the reply was sent
            time.sleep(_REPLAY_GAP_S + 0.05)
            sock.send_multipart([wire.encode(fetch)])
            assert uids() == first, "a resend of a served fetch got other rows"
        st = producer.stats()
        assert st["served_groups"] == 1 and st["replayed_fetches"] == 2
    finally:
        sock.close(0)
        producer.close()
        srv.stop()


def test_a_fetch_waiting_in_a_server_that_dies_is_served_by_its_successor(tmp_path):
    """Before: the fetch died with the server, and the trainer waited out its whole timeout."""
    directory = tmp_path / "buf"
    first = BufferServer(BufferConfig(capacity_samples=64), directory).start()
    address = first.address
    trainer = BufferClient(address, producer="trainer", timeout_s=10, resend_s=0.2)
    got: dict = {}
    waiting = threading.Thread(
        target=lambda: got.setdefault("batch", trainer.fetch(2, version=0, max_staleness=0, timeout_s=8))
    )
    waiting.start()
    first.stop()  # the parked fetch is gone with it (stop is the in-process stand-in for a kill)
    second = BufferServer(BufferConfig(capacity_samples=64, bind=address), directory).start()
    producer = BufferClient(address, producer="p", timeout_s=10)
    try:
        producer.put(synthetic_samples(2, group_size=2))
        waiting.join(timeout=15)
        assert not waiting.is_alive(), "the fetch was never answered"
        assert got["batch"] is not None and got["batch"].num_rows == 4
    finally:
        trainer.close()
        producer.close()
        second.stop()
    served = [u for r in iter_log(directory) if r.op == "served" for u in r.uids]
    assert sorted(served) == sorted(set(served)) and len(served) == 4


def test_a_newer_fetch_of_the_same_consumer_supersedes_a_parked_one(tmp_path):
    """A trainer that died (or gave up) while its fetch waited: its successor's fetch gets the groups,
    not the dead requester. Before: the old fetch was served first, to nobody, and that batch was lost."""
    srv = BufferServer(BufferConfig(capacity_samples=64), tmp_path / "buf").start()
    dead = zmq.Context.instance().socket(zmq.DEALER)
    dead.setsockopt(zmq.LINGER, 0)
    dead.connect(srv.address)
    old = wire.Fetch(
        req=(1 << 40) + 1, consumer="trainer", num_groups=1, version=0, max_staleness=0, timeout_s=60
    )
    dead.send_multipart([wire.encode(old)])
    producer = BufferClient(srv.address, producer="p", timeout_s=10)
    successor = BufferClient(srv.address, producer="trainer", timeout_s=10)
    try:
        deadline = time.monotonic() + 5
        while producer.stats()["pending_fetches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        dead.close(0)  # the requester is gone; the server cannot tell
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("b", successor.fetch(1, 0, 0, timeout_s=5)))
        t.start()
        while producer.stats()["superseded_fetches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        producer.put(synthetic_samples(1, group_size=2))
        t.join(timeout=10)
        assert got.get("b") is not None and got["b"].num_rows == 2
        st = producer.stats()
        assert st["superseded_fetches"] == 1 and st["served_groups"] == 1 and st["pending_fetches"] == 0
    finally:
        producer.close()
        successor.close()
        srv.stop()
