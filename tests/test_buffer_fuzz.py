"""Throw thousands of random, mutated and ill-typed messages at a live buffer server; it must answer
every one, count the rejects, and still ingest and serve correctly afterwards."""

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer import wire
from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.record import samples_to_batch
from buffer.server import BufferServer

SAMPLES = synthetic_samples(1, group_size=2, response_len=8, prefix="fz")


def _ipc(batch) -> bytes:
    from buffer.frames import ipc_bytes

    return ipc_bytes(batch).to_pybytes()


# Valid messages that consume nothing (mutations of a fetch could steal the final check's data).
BASES = [
    [wire.encode(wire.StatsRequest())],
    [wire.encode(wire.SetVersion(version=0))],
    [wire.encode(wire.Peek(limit=2))],
    [wire.encode(wire.Ingest(producer="fz", seq=1, samples=SAMPLES))],
    [wire.encode(wire.IngestBatch(producer="fz", seq=2, num_samples=2)), _ipc(samples_to_batch(SAMPLES))],
]
KINDS = ["ingest", "ingest_batch", "fetch", "set_version", "stats", "peek", "ok", "error", "nope", ""]

any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(-(2**63), 2**63), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63), max_size=3),
)


@st.composite
def mutated(draw):
    frames = [bytearray(f) for f in draw(st.sampled_from(BASES))]
    i = draw(st.integers(0, len(frames) - 1))
    f = frames[i]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert"]))
        pos = draw(st.integers(0, max(0, len(f) - 1)))
        if op == "flip" and f:
            f[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del f[pos:]
        else:
            f[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return [bytes(x) for x in frames]


@st.composite
def ill_typed(draw):
    d = draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "producer",
                    "seq",
                    "samples",
                    "version",
                    "num_groups",
                    "max_staleness",
                    "timeout_s",
                    "limit",
                    "consumer",
                    "num_samples",
                    "req",
                ]
            ),
            any_value,
            max_size=6,
        )
    )
    d["kind"] = draw(st.sampled_from(KINDS) | st.text(max_size=8) | any_value)
    v = wire.SCHEMA_VERSION  # mostly this peer's version, so that the kind and the fields get checked
    d["schema"] = draw(st.sampled_from([v, v, v - 1, 0, v + 1, -1, str(v), None]))
    if d["kind"] == "fetch":  # a well-typed random fetch would wait and consume: make it ill-typed
        d["num_groups"] = "x"
    frames = [msgspec.msgpack.encode(d)]
    return frames + draw(st.lists(st.binary(max_size=16), max_size=2))


message = st.one_of(
    st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    mutated(),
    ill_typed(),
    st.builds(
        lambda b, extra: b + extra,
        st.sampled_from(BASES),
        st.lists(st.binary(max_size=8), min_size=1, max_size=2),
    ),
)


def _reply(sock) -> list:
    assert sock.poll(5000), "the server stopped answering"
    frames = sock.recv_multipart()
    if frames[0] == b"" and len(frames) > 1:  # answered as if we were a REQ socket
        frames = frames[1:]
    return frames


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _storm(sock) -> dict:
    """Throw hypothesis' messages at the server behind `sock`, one at a time; each must get one
    well-formed answer (a failure shrinks to a minimal message list). Returns what was sent."""
    tally = {"errors": 0, "messages": 0}

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(msgs=st.lists(message, min_size=1, max_size=8))
    def throw(msgs):
        for frames in msgs:
            sock.send_multipart(frames)
            reply = wire.decode(_reply(sock)[0])  # every message gets a well-formed answer
            tally["messages"] += 1
            tally["errors"] += isinstance(reply, wire.Error)

    throw()
    return tally


@pytest.fixture(scope="module")
def stormed(tmp_path_factory):
    """A live server that has weathered the storm, with what was sent and what came back right after:
    the storm runs here, once, so each test below works whether it runs alone or with the others."""
    cfg = BufferConfig(policy="fifo", max_message_mb=1, capacity_samples=1_000_000)
    srv = BufferServer(cfg, tmp_path_factory.mktemp("fuzz")).start()
    sock = _dealer(srv.address)
    try:
        tally = _storm(sock)
        # One stats round trip on the storm's own socket. ZeroMQ keeps a connection's order, so any
        # reply that arrives before its answer is a second (or late) answer to a storm message.
        sock.send_multipart([wire.encode(wire.StatsRequest(req=424242))])
        stray = []
        while not isinstance(reply := wire.decode(_reply(sock)[0]), wire.StatsReply) or reply.req != 424242:
            stray.append(reply)
        yield srv, tally, stray, reply.stats
    finally:
        sock.close()
        srv.stop()


@pytest.fixture
def fresh_server(tmp_path):
    srv = BufferServer(BufferConfig(max_message_mb=1), tmp_path / "buf").start()
    yield srv
    srv.stop()


def test_server_survives_hostile_input(stormed):
    """A buffer shared by many producers must survive any bytes a buggy or hostile peer sends:
    every message gets exactly one answer, and the server handled each one it was sent."""
    srv, tally, stray, stats = stormed
    assert tally["messages"] >= 1000, "hypothesis sent fewer messages than intended"
    assert stray == [], f"{len(stray)} replies beyond one per message, e.g. {stray[0]}"
    assert stats["messages"] == tally["messages"] + 1  # the storm plus that stats request


def test_oversized_frames_are_rejected(fresh_server):
    """A frame over max_message_mb is refused with a reason naming the limit, and counted."""
    sock = _dealer(fresh_server.address)
    try:
        sock.send_multipart([wire.encode(wire.StatsRequest()), b"\0" * (1 << 20)])
        assert "exceeds max_message_mb=1" in wire.decode(_reply(sock)[0]).reason
        sock.send_multipart([wire.encode(wire.StatsRequest(req=5))])
        assert wire.decode(_reply(sock)[0]).stats["rejects"] == {"oversized": 1}
    finally:
        sock.close()


def test_still_correct_after_the_storm(stormed):
    """After the storm every reject is counted under a named category (none is an internal error),
    and the server still accepts and serves new data, in order and completely."""
    srv, tally, _, st_ = stormed
    assert st_["rejected_messages"] == tally["errors"] > 100
    assert set(st_["rejects"]) >= {
        "undecodable",
        "invalid_fields",
        "frame_count",
        "unknown_kind",
        "schema_version",
    }
    assert "internal" not in st_["rejects"], st_["rejects"]
    c = BufferClient(srv.address, timeout_s=10)
    try:
        fresh = synthetic_samples(3, group_size=2, prefix="after")
        assert c.put(fresh).accepted == 6
        served = []
        while (b := c.fetch(1, 0, 0, timeout_s=0)) is not None:  # timeout 0: answered at once
            served += b.column("uid").to_pylist()
        assert [u for u in served if u.startswith("after")] == [s.uid for s in fresh]
        assert c.stats()["complete_groups"] == 0
    finally:
        c.close()
