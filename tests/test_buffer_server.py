"""The ZeroMQ buffer server and client on a free loopback port."""

import threading
import time

import msgspec
import pytest
import zmq

from buffer import wire
from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.record import batch_to_samples, samples_to_batch
from buffer.server import BufferServer
from buffer.transport import BufferUnavailable


@pytest.fixture
def server(tmp_path):
    srv = BufferServer(BufferConfig(capacity_samples=64), tmp_path / "buf").start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = BufferClient(server.address, timeout_s=10, resend_s=0.3)
    yield c
    c.close()


def raw(address: str, kind=zmq.DEALER) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def test_bind_port_zero_exposes_address(server):
    assert server.address.startswith("tcp://127.0.0.1:") and not server.address.endswith(":0")


def test_put_fetch_roundtrip(client):
    s = synthetic_samples(4, group_size=2, response_len=33)
    ack = client.put(s)
    assert (ack.accepted, ack.duplicates) == (8, 0)
    assert client.put(s[:3]).duplicates == 3
    batch = client.fetch(3, version=0, max_staleness=0, timeout_s=2)
    assert batch_to_samples(batch) == s[:6]
    assert client.fetch(2, version=0, max_staleness=0, timeout_s=0.2) is None
    assert "timeout" in client.last_fetch.reason
    client.set_version(7)
    assert client.put(synthetic_samples(1, prefix="z")).trainer_version == 7
    st = client.stats()
    assert st["served_groups"] == 3 and st["version"] == 7 and st["rows"] == 6


def test_pending_fetch_does_not_block_others(server, client):
    trainer = BufferClient(server.address, timeout_s=10)
    got = {}
    t = threading.Thread(target=lambda: got.update(b=trainer.fetch(2, 0, 0, timeout_s=5)))
    t.start()
    deadline = time.monotonic() + 5
    while client.stats()["pending_fetches"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # stats are answered while the fetch waits
    assert client.stats()["pending_fetches"] == 1
    client.put(synthetic_samples(2))
    t.join(10)
    assert not t.is_alive() and got["b"] is not None and got["b"].num_rows == 8  # answered, not timed out
    trainer.close()


def test_backpressure_holds_ack_until_fetch_frees_room(server, client):
    client.put(synthetic_samples(16, prefix="a"))  # 64 = capacity
    seq = client.submit(synthetic_samples(2, prefix="b"))
    with pytest.raises(BufferUnavailable, match="did not send the ack"):
        client.wait(seq, timeout_s=0.8)  # resent meanwhile, still parked once
    st = client.stats()
    assert st["parked_ingests"] == 1 and st["rows"] == 64 and st["backpressure_parked"] == 1
    assert client.fetch(2, 0, 0, timeout_s=1).num_rows == 8
    assert client.wait(seq, timeout_s=3).accepted == 8
    assert client.stats()["rows"] == 64


def test_too_large_for_capacity_is_an_error(client):
    with pytest.raises(wire.ProtocolError, match="can never fit capacity_samples=64"):
        client.put(synthetic_samples(20))


def test_unavailable_names_the_address():
    c = BufferClient("tcp://127.0.0.1:1", timeout_s=0.3)
    with pytest.raises(BufferUnavailable, match=r"tcp://127\.0\.0\.1:1.*python -m buffer serve"):
        c.stats()
    with pytest.raises(BufferUnavailable, match="ingest seq 1"):
        c.put(synthetic_samples(1))
    c.close()


def test_resend_after_server_restart(tmp_path):
    cfg = BufferConfig(bind="tcp://127.0.0.1:0")
    srv = BufferServer(cfg, tmp_path).start()
    addr = srv.address
    c = BufferClient(addr, timeout_s=10, resend_s=0.2)
    c.put(synthetic_samples(2, prefix="a"))
    srv.stop()
    seq = c.submit(synthetic_samples(2, prefix="b"))  # sent into the void
    srv = BufferServer(cfg, tmp_path, bind=addr).start()
    assert c.wait(seq).accepted == 8
    assert c.stats()["rows"] == 16
    srv.stop()
    c.close()


@pytest.mark.parametrize(
    "frames, category, text",
    [
        ([b"\xc1\x00garbage"], "undecodable", "undecodable"),
        ([msgspec.msgpack.encode({"kind": "stats", "schema": 1})], "schema_version", "schema version 1"),
        (
            [msgspec.msgpack.encode({"kind": "launch", "schema": wire.SCHEMA_VERSION})],
            "unknown_kind",
            "unknown message kind",
        ),
        (
            [msgspec.msgpack.encode({"kind": "fetch", "schema": wire.SCHEMA_VERSION, "num_groups": "x"})],
            "invalid_fields",
            "fetch",
        ),
        ([wire.encode(wire.StatsRequest()), b"extra"], "frame_count", "takes 1 frame"),
        ([wire.encode(wire.IngestBatch(producer="p", seq=1, num_samples=1))], "frame_count", "takes 2"),
        (
            [wire.encode(wire.IngestBatch(producer="p", seq=1, num_samples=1)), b"xx"],
            "invalid_arrow",
            "Arrow",
        ),
        ([wire.encode(wire.Ok())], "unexpected_kind", "reply kind"),
        (
            [wire.encode(wire.Fetch(consumer="t", num_groups=0, version=0, max_staleness=0, timeout_s=1))],
            "invalid_control",
            "num_groups=0 outside [1,",
        ),
    ],
)
def test_bad_messages_get_error_and_are_counted(server, client, frames, category, text):
    s = raw(server.address)
    s.send_multipart(frames)
    reply = wire.decode(s.recv_multipart()[0])
    assert isinstance(reply, wire.Error) and text in reply.reason
    assert client.stats()["rejects"] == {category: 1}
    s.close()


def test_oversized_and_invalid_sample(tmp_path):
    srv = BufferServer(BufferConfig(max_message_mb=1), tmp_path).start()
    s = raw(srv.address)
    s.send_multipart([wire.encode(wire.StatsRequest()), b"x" * (2 << 20)])
    assert "exceeds max_message_mb=1" in wire.decode(s.recv_multipart()[0]).reason
    bad = synthetic_samples(1, group_size=1)[0]
    bad = msgspec.structs.replace(bad, versions=bad.versions[:-4])
    s.send_multipart([wire.encode(wire.Ingest(producer="p", seq=1, samples=[bad]))])
    assert "versions has" in wire.decode(s.recv_multipart()[0]).reason
    c = BufferClient(srv.address)
    assert c.stats()["rejects"] == {"oversized": 1, "invalid_sample": 1}
    c.close()
    s.close()
    srv.stop()


def test_req_socket_and_msgpack_ingest_work(server):
    s = raw(server.address, zmq.REQ)
    samples = synthetic_samples(1)
    s.send(wire.encode(wire.Ingest(producer="req", seq=1, samples=samples)))
    ack = wire.decode(s.recv())
    assert isinstance(ack, wire.IngestAck) and ack.accepted == 4
    s.send(wire.encode(wire.Fetch(consumer="t", num_groups=1, version=0, max_staleness=0, timeout_s=1)))
    head, payload = s.recv_multipart()
    assert wire.decode(head).num_samples == 4 and len(payload) > 0
    s.close()


def test_peek_does_not_consume(client):
    client.put(synthetic_samples(2))
    assert client.peek(3).num_rows == 3
    assert client.fetch(2, 0, 0, timeout_s=1).num_rows == 8


def test_put_accepts_arrow_batches_and_splits(server):
    c = BufferClient(server.address, max_batch_samples=3, window=2)
    ack = c.put(samples_to_batch(synthetic_samples(4, group_size=2)))
    assert ack.accepted == 8
    assert c.stats()["messages"] >= 3
    c.close()


def test_acks_wait_for_the_segment_fsync_and_a_failed_write_is_an_error(tmp_path, monkeypatch):
    srv = BufferServer(BufferConfig(), tmp_path / "buf").start()
    writer = srv.buffer._writer
    c = BufferClient(srv.address, timeout_s=10, resend_s=0.3)
    try:
        fsyncs = writer.fsyncs
        assert c.put(synthetic_samples(2, prefix="ok")).accepted == 8
        assert writer.fsyncs > fsyncs and writer.durable == writer.appended  # acked after its fsync

        def broken(batch, meta):
            raise OSError("disk on fire")

        monkeypatch.setattr(writer, "_write", broken)
        with pytest.raises(wire.ProtocolError, match="could not make this ingest durable.*disk on fire"):
            c.put(synthetic_samples(2, prefix="bad"))
        with pytest.raises(wire.ProtocolError, match="segment writer .* failed"):
            c.put(synthetic_samples(2, prefix="later"))  # nothing is acked after a failed write
        assert c.stats()["rows"] >= 8  # the server itself keeps answering
    finally:
        c.close()
        srv.stop()


def test_evicted_groups_are_reported_per_generator():
    with BufferServer(BufferConfig(durable=False)) as srv:
        c = BufferClient(srv.address, timeout_s=10)
        old = [
            msgspec.structs.replace(s, generator_id="gen-a")
            for s in synthetic_samples(2, version=0, prefix="a")
        ]
        new = [
            msgspec.structs.replace(s, generator_id="gen-b")
            for s in synthetic_samples(1, version=5, prefix="b")
        ]
        c.put(old + new)
        assert c.fetch(1, version=5, max_staleness=1, timeout_s=5) is not None  # evicts gen-a's 2 groups
        assert c.evicted_groups("gen-a") == 2 and c.evicted_groups("gen-b") == 0
