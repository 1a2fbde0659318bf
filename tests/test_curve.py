"""ZeroMQ CURVE on the buffer and the CPU weight transport (issue #13): clients holding the run's keys
work as without CURVE; a client without them (or with another client keypair) is refused, counted in
the server's stats, and gets nothing; nothing it sent is stored."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time

import pytest
import torch

from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.curve import CurveKeys, _ZapHandler
from buffer.demo import synthetic_samples
from buffer.record import batch_to_samples
from buffer.server import BufferServer
from buffer.storage import Buffer
from buffer.transport import BufferUnavailable
from stages.weights.base import WeightPushError
from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender


class FakeEngine:
    def __init__(self):
        self.version = 0

    def update_weights(self, named, version):
        self.version = version


def wait_for(cond, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def other_client(keys: CurveKeys) -> CurveKeys:
    """The run's server public key, but a client keypair of its own."""
    stranger = CurveKeys.generate()
    return dataclasses.replace(
        keys, client_public=stranger.client_public, client_secret=stranger.client_secret
    )


@pytest.fixture
def keys():
    return CurveKeys.generate()


@pytest.fixture
def server(tmp_path, keys):
    srv = BufferServer(BufferConfig(capacity_samples=64), tmp_path / "buf", curve=keys).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server, keys):
    c = BufferClient(server.address, timeout_s=5, resend_s=0.3, curve=keys)
    yield c
    c.close()


def test_keys_pickle_and_keep_secrets_out_of_repr(keys):
    assert pickle.loads(pickle.dumps(keys)) == keys
    assert (
        len(keys.server_secret) == len(keys.client_public) == 40 and keys.server_public != keys.client_public
    )
    text = repr(keys)
    assert keys.server_public.decode() in text
    assert keys.server_secret.decode() not in text and keys.client_secret.decode() not in text


def test_client_with_keys_ingests_and_fetches(client):
    s = synthetic_samples(4, group_size=2, response_len=17)
    assert client.put(s).accepted == 8
    assert batch_to_samples(client.fetch(4, version=0, max_staleness=0, timeout_s=2)) == s
    st = client.stats()
    assert st["curve"] is True and st["auth_refused"] == 0 and st["served_groups"] == 4


@pytest.mark.parametrize("stranger", ["no_curve", "other_client_key", "other_server_key"])
def test_client_without_the_run_key_is_refused_and_counted(tmp_path, server, client, keys, stranger):
    curve = {
        "no_curve": None,
        "other_client_key": other_client(keys),  # knows the server's key: refused by the ZAP handler
        "other_server_key": dataclasses.replace(keys, server_public=CurveKeys.generate().server_public),
    }[stranger]
    bad = BufferClient(server.address, timeout_s=1, resend_s=0.3, curve=curve)
    with pytest.raises(BufferUnavailable, match="CURVE keys"):
        bad.put(synthetic_samples(2, prefix="intruder"))
    with pytest.raises(BufferUnavailable, match="CURVE keys"):
        bad.fetch(1, version=0, max_staleness=0, timeout_s=0.3, grace_s=0.3)
    bad.close()
    # the server saw none of its messages (the one counted is this stats request) and stored nothing
    st = client.stats()
    assert st["auth_refused"] >= 1
    assert (st["messages"], st["rows"], st["seen_uids"], st.get("served_groups", 0)) == (1, 0, 0, 0)
    server.stop()
    assert Buffer(BufferConfig(), tmp_path / "buf").stats()["rows"] == 0  # nor in the durable log


def test_buffer_without_curve_is_unchanged(tmp_path):
    with BufferServer(BufferConfig(capacity_samples=16), tmp_path / "plain") as srv:
        c = BufferClient(srv.address, timeout_s=5)
        assert c.put(synthetic_samples(1)).accepted == 4
        st = c.stats()
        assert st["curve"] is False and st["auth_refused"] == 0
        c.close()


def test_weight_push_reaches_only_receivers_with_the_run_key(keys):
    sender = ZmqWeightSender(timeout_s=3, min_engines=1, curve=keys)
    good, stranger, impostor = FakeEngine(), FakeEngine(), FakeEngine()
    receivers = [
        WeightReceiver(sender.address, good, name="good", curve=keys),
        WeightReceiver(sender.address, stranger, name="stranger"),
        WeightReceiver(sender.address, impostor, name="impostor", curve=other_client(keys)),
    ]
    try:
        stats = sender.push(1, [("w", torch.ones(4))]).result(timeout=5)
        assert stats["engines"] == 1 and good.version == 1
        # both strangers were refused (counted) and are no engine of the sender
        assert wait_for(lambda: sender.stats()["auth_refused"] >= 2), sender.stats()
        assert sender.stats()["engines"] == 1
        assert sender.push(2, [("w", torch.zeros(4))]).result(timeout=5)["engines"] == 1
        time.sleep(0.2)  # room for a (wrongly) delivered snapshot to be applied
        assert (good.version, stranger.version, impostor.version) == (2, 0, 0)
    finally:
        for r in receivers:
            r.close()
        sender.close()
    assert not any(r._thread.is_alive() or r.error for r in receivers)  # the refused ones end cleanly too


def test_weight_push_waits_for_no_refused_receiver(keys):
    sender = ZmqWeightSender(timeout_s=1, min_engines=1, curve=keys)
    engine = FakeEngine()
    r = WeightReceiver(sender.address, engine, name="stranger")
    try:
        with pytest.raises(WeightPushError, match="0 of 1 engines connected"):
            sender.push(1, [("w", torch.ones(4))]).result(timeout=5)
        assert sender.stats()["auth_refused"] >= 1 and engine.version == 0
    finally:
        r.close()
        sender.close()


def test_servers_of_one_process_share_a_zap_handler_and_stop_it(tmp_path):
    """Two secured servers on one context, each with its own keys: each admits only its own client
    key (one ZAP handler, a domain per socket); the handler and monitor threads end with the last."""
    buffer_keys, weight_keys = CurveKeys.generate(), CurveKeys.generate()
    srv = BufferServer(BufferConfig(capacity_samples=16), tmp_path / "b", curve=buffer_keys).start()
    sender = ZmqWeightSender(timeout_s=1, min_engines=1, curve=weight_keys)
    # the sender's server key with the client keypair the other server accepts: per-socket ZAP domains
    # refuse it (one set of keys allowed process-wide would not)
    crossed = dataclasses.replace(
        weight_keys, client_public=buffer_keys.client_public, client_secret=buffer_keys.client_secret
    )
    engine = FakeEngine()
    r = WeightReceiver(sender.address, engine, name="e", curve=crossed)
    c = BufferClient(srv.address, timeout_s=5, curve=buffer_keys)
    try:
        assert c.put(synthetic_samples(1)).accepted == 4
        with pytest.raises(WeightPushError):
            sender.push(1, [("w", torch.ones(1))]).result(timeout=5)
        assert sender.stats()["auth_refused"] >= 1 and c.stats()["auth_refused"] == 0
        assert engine.version == 0
    finally:
        c.close(), r.close(), sender.close(), srv.stop()
    assert _ZapHandler._running == {}
    assert wait_for(
        lambda: not [t for t in threading.enumerate() if t.name in ("curve-zap", "curve-guard")], 2
    )
    # a server started after the handler stopped gets a fresh one
    with BufferServer(BufferConfig(capacity_samples=16), tmp_path / "c", curve=buffer_keys) as again:
        c = BufferClient(again.address, timeout_s=5, curve=buffer_keys)
        assert c.put(synthetic_samples(1)).accepted == 4
        c.close()
