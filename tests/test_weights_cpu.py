"""CPU weight transport: a push from the trainer lands in a real torch engine, whose sampling logprobs
then match the trainer's (fp32, <= 1e-4); failures and timeouts raise in the trainer."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import torch

from pipeline.config import RunConfig
from stages.trainer.testing import ListSource, make_batch, make_tiny_hf
from stages.weights.base import WeightPushError
from stages.weights.buckets import buckets
from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender


class FakeEngine:
    def __init__(self, fail=False):
        self.version, self.fail, self.got = 0, fail, None

    def update_weights(self, named, version):
        if self.fail:
            raise RuntimeError("engine out of memory (simulated)")
        self.got, self.version = dict(named), version


def test_buckets_split_by_size():
    t = [(str(i), torch.zeros(256)) for i in range(5)]  # 1 KiB each
    sizes = [len(b) for b in buckets(t, 2048)]
    assert sizes == [2, 2, 1]


def test_sender_receiver_roundtrip_bf16_and_late_joiner():
    sender = ZmqWeightSender(bucket_mb=1, timeout_s=10, min_engines=1)
    e1 = FakeEngine()
    r1 = WeightReceiver(sender.address, e1, name="e1")
    named = [("a", torch.randn(300, 1000)), ("b", torch.randn(7).bfloat16()), ("c", torch.zeros(0))]
    stats = sender.push(3, named).result()
    assert stats["engines"] == 1 and e1.version == 3
    for n, t in named:
        assert e1.got[n].dtype == t.dtype and torch.equal(e1.got[n], t)
    e2 = FakeEngine()  # joins after the push: gets the latest snapshot on hello
    r2 = WeightReceiver(sender.address, e2, name="e2")
    deadline = time.monotonic() + 10
    while e2.version != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert e2.version == 3
    r1.close(), r2.close(), sender.close()


def test_push_failure_and_timeout_raise():
    sender = ZmqWeightSender(timeout_s=5, min_engines=1)
    r = WeightReceiver(sender.address, FakeEngine(fail=True), name="bad")
    with pytest.raises(WeightPushError, match="out of memory"):
        sender.push(1, [("a", torch.ones(3))]).result()
    r.close(), sender.close()
    lonely = ZmqWeightSender(timeout_s=0.5, min_engines=1)
    with pytest.raises(WeightPushError, match="engines connected"):
        lonely.push(1, [("a", torch.ones(3))]).result()
    lonely.close()


def test_trainer_push_lands_in_torch_engine(tmp_path):
    from trainer_setup import engine_sample, make_trainer

    from stages.rollout.torch_engine import TorchEngine

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.lr = 2, 1e-2
    cfg.weights.push_every = 1
    trainer = make_trainer(
        cfg, ListSource([make_batch(2, 4, seed=i) for i in range(2)]), path, str(tmp_path / "run")
    )
    sender = ZmqWeightSender(timeout_s=30, min_engines=1)
    engine = TorchEngine(path, seed=0)
    receiver = WeightReceiver(sender.address, engine, name="torch")
    trainer.attach_sender(sender)
    try:
        for _ in range(2):
            m = trainer.step()
        assert "push/snapshot_s" in m
        trainer.wait_push()
        assert engine.version == trainer.version == 2
        _, res, tb, mine = engine_sample(engine, trainer)
        assert res.versions == [2] * len(res.response_ids)
        assert (mine - tb.rollout_logprobs).abs().max().item() <= 1e-4
    finally:
        receiver.close(), sender.close(), engine.close()


def test_push_runs_in_background_while_training(tmp_path):
    """A slow engine does not hold up the step; the next push first waits for the previous one. The
    engine blocks on an event (no wall-clock bounds): the step finishes while it is still held."""
    import threading

    from trainer_setup import make_trainer

    gate = threading.Event()

    class SlowEngine(FakeEngine):
        def update_weights(self, named, version):
            gate.wait(60)
            super().update_weights(named, version)

    path = make_tiny_hf(str(tmp_path / "m"), "llama")
    cfg = RunConfig()
    cfg.trainer.batch_groups = 1
    src = ListSource([make_batch(1, 2, seed=i) for i in range(2)])
    trainer = make_trainer(cfg, src, path, str(tmp_path / "run"))
    sender = ZmqWeightSender(timeout_s=60, min_engines=1)
    engine = SlowEngine()
    receiver = WeightReceiver(sender.address, engine, name="slow")
    trainer.attach_sender(sender)
    try:
        trainer.step()  # returns although the engine has not applied version 1
        assert not gate.is_set() and not trainer.publisher.pending.done() and engine.version == 0
        out = {}
        second = threading.Thread(target=lambda: out.update(m=trainer.step()))
        second.start()  # its push must wait for version 1 to be applied
        second.join(0.5)
        assert second.is_alive() and engine.version == 0
        gate.set()
        second.join(60)
        assert not second.is_alive() and out["m"]["push/wait_prev_s"] > 0 and engine.version >= 1
        trainer.wait_push()
        assert engine.version == 2 and "model.embed_tokens.weight" in engine.got
    finally:
        gate.set()
        receiver.close(), sender.close()


def test_closed_receiver_deregisters():
    sender = ZmqWeightSender(timeout_s=5, min_engines=0)
    r = WeightReceiver(sender.address, FakeEngine(), name="gone")
    deadline = time.monotonic() + 5
    while not sender.engines and time.monotonic() < deadline:
        sender.push(0, []).result()  # pushes also let the sender see hellos
    r.close()
    deadline = time.monotonic() + 10
    while sender.engines and time.monotonic() < deadline:  # the I/O thread handles the bye
        time.sleep(0.01)
    stats = sender.push(1, [("a", torch.ones(2))]).result()  # must not wait for the closed engine
    assert stats["engines"] == 0
    sender.close()


def test_close_during_a_push_fails_it_cleanly():
    """Closing the sender while a push waits for engines fails that push with a clear error (the socket
    is closed by its own thread, not under it), and later pushes are refused at once."""
    sender = ZmqWeightSender("tcp://127.0.0.1:0", min_engines=1, timeout_s=60)
    handle = sender.push(1, [("w", torch.zeros(4))])  # no engine ever connects: the push waits
    time.sleep(0.3)
    t0 = time.monotonic()
    sender.close()
    assert time.monotonic() - t0 < 5
    with pytest.raises(WeightPushError, match="closed"):
        handle.result(timeout=5)
    assert not sender._thread.is_alive()
    with pytest.raises(WeightPushError, match="closed"):
        sender.push(2, [("w", torch.zeros(4))])


def test_garbage_from_an_engine_does_not_stop_the_sender():
    """A peer sending valid msgpack that is not a message (here the integer 7) is ignored: the I/O
    thread lives on and a real engine still gets the next push."""
    import msgspec
    import zmq

    sender = ZmqWeightSender("tcp://127.0.0.1:0", min_engines=0, timeout_s=30)
    bad = zmq.Context.instance().socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(sender.address)
    bad.send(msgspec.msgpack.encode(7))
    bad.send(b"\xc1")  # not msgpack at all
    time.sleep(0.5)
    assert sender._thread.is_alive()
    sender.push(1, [("w", torch.zeros(4))]).result(timeout=10)  # no engines registered: done at once
    bad.close(0)
    sender.close()


def test_forgetting_an_engine_frees_a_push_waiting_for_it():
    """An engine that dies after receiving a push never acks it: the push would wait its whole timeout.
    `forget` (what the launcher calls when it heals that generator) ends the wait at once, and the
    next push goes to the replacement alone."""
    import threading

    gate = threading.Event()

    class Stuck(FakeEngine):
        def update_weights(self, named, version):
            gate.wait(30)  # never acks while held: as good as dead for the sender
            super().update_weights(named, version)

    sender = ZmqWeightSender(timeout_s=60, min_engines=1)
    stuck = WeightReceiver(sender.address, Stuck(), name="stuck")
    fresh = None
    try:
        handle = sender.push(1, [("w", torch.zeros(4))])
        with pytest.raises(cf.TimeoutError):
            handle.future.result(timeout=0.5)  # waiting for the stuck engine's ack
        sender.forget("stuck")
        stats = handle.future.result(timeout=10)
        assert stats["version"] == 1 and stats["engines"] == 0
        fresh_engine = FakeEngine()
        fresh = WeightReceiver(sender.address, fresh_engine, name="replacement")
        assert sender.push(2, [("w", torch.ones(4))]).future.result(timeout=10)["engines"] == 1
        assert fresh_engine.version == 2
    finally:
        gate.set()
        stuck.close(), sender.close()
        if fresh is not None:
            fresh.close()


def test_packed_buckets_hold_one_buffer_and_let_each_gathered_tensor_go():
    """weights.snapshot=direct: each tensor comes from a gather made for this push alone. Packed, it is
    copied into its bucket's byte buffer at once and let go, the buffer is reused by the next bucket,
    and the bucket's tensors are views of it, byte for byte the tensors, back to back (what SGLang's
    flattened bucket is). A 7B push that held a bucket of gathered tensors and then their flat copy
    ran out of memory beside the training state."""
    import weakref

    from stages.weights.buckets import buckets_marking_last

    alive = []

    def gathered():
        for i, n in enumerate([256, 256, 256, 1024, 128]):  # 1 KiB each but the 4 KiB 4th one
            t = torch.arange(n, dtype=torch.float32) + 1000 * i
            alive.append(weakref.ref(t))
            yield f"w{i}", t

    seen, buffers = [], []
    for group, last in buckets_marking_last(gathered(), 2048, pack_on=torch.device("cpu")):
        # only the tensor looked ahead at may still live; every one packed was let go
        assert sum(r() is not None for r in alive) <= 1
        flat = group.flat
        buffers.append(flat.untyped_storage().data_ptr())
        assert flat.numel() == sum(t.numel() * t.element_size() for _, t in group)
        offset = 0
        for name, t in group:
            i = int(name[1:])
            assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32) + 1000 * i)
            assert t.data_ptr() == flat.data_ptr() + offset
            offset += t.numel() * 4
        seen.append(([n for n, _ in group], last))
    assert seen == [(["w0", "w1"], False), (["w2"], False), (["w3"], False), (["w4"], True)]
    # one buffer for the 2 KiB buckets, a larger one for the tensor larger than a bucket, kept after it
    assert buffers[0] == buffers[1] and buffers[2] == buffers[3] != buffers[0]


def test_packed_buckets_stay_whole_when_the_size_hint_is_short_and_take_any_strides():
    """A direct push sizes its bucket buffer by the model's bytes when that is under a bucket. Should the
    hint fall short, a bucket ends where the buffer does (its tensors must all lie in the one buffer it
    sends), and a tensor larger than the buffer gets one of its own. Transposed and strided views are
    packed as they are."""
    from stages.weights.buckets import buckets_marking_last

    base = torch.arange(512, dtype=torch.float32)
    named = [
        ("t", base[:256].reshape(16, 16).t()),  # transposed: 1 KiB
        ("s", base[::2]),  # strided: 1 KiB
        ("a", base[:256] + 1),  # 1 KiB
        ("big", base.repeat(2)),  # 4 KiB
    ]
    want, names = dict(named), []
    # checked as each comes: the next bucket refills the buffer
    for group, _ in buckets_marking_last(
        iter(named), 1 << 20, pack_on=torch.device("cpu"), expect_bytes=2048
    ):
        names.append([n for n, _ in group])
        assert all(torch.equal(t, want[n]) for n, t in group)
        expected = torch.cat([want[n].reshape(-1) for n, _ in group])
        assert torch.equal(group.flat.view(torch.float32), expected)
    assert names == [["t", "s"], ["a"], ["big"]]


def test_a_packed_bucket_refuses_a_tensor_its_dtype_cannot_view():
    """A bf16 tensor of odd size followed by an fp32 one: the fp32 bytes would start at an offset that
    is no multiple of 4, which no view (and no SGLang server) can read as fp32: refused, naming it."""
    from stages.weights.buckets import buckets_marking_last

    named = [("odd", torch.zeros(3, dtype=torch.bfloat16)), ("f32", torch.zeros(2))]
    with pytest.raises(WeightPushError, match=r"f32 \(torch.float32\) would start at byte 6"):
        list(buckets_marking_last(iter(named), 1 << 20, pack_on=torch.device("cpu")))


def test_a_direct_push_bucket_is_cut_to_half_the_free_memory_beside_training():
    """weights.snapshot=direct packs its bucket on the trainer's GPU beside the whole training state
    (a 7B TP=2 trainer holds ~69 GiB of 80): the bucket is weights.bucket_mb while the GPU has twice
    that free, else half of what it has, the other half left for the gathered tensor ahead."""
    from stages.weights.buckets import bucket_that_fits

    gib = 1 << 30
    assert bucket_that_fits(4 * gib, 64 * gib) == 4 * gib
    assert bucket_that_fits(4 * gib, 8 * gib) == 4 * gib
    assert bucket_that_fits(4 * gib, 5 * gib) == 5 * gib // 2
    assert bucket_that_fits(4 * gib, 0) == 1  # never a zero bucket: a tensor still gets a buffer its size


def test_the_direct_push_reads_the_gpu_memory_free_beside_training_for_its_bucket(monkeypatch):
    """What the sender counts as free: the device's free memory plus what the caching allocator holds
    unused (it reuses that first); with 6 GiB so the 4 GiB bucket is cut to 3 GiB, warned once. On a
    CPU bucket nothing is read."""
    from types import SimpleNamespace

    from stages.weights.sglang_transport import _SGLangSender

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 69 * gib)
    sender = SimpleNamespace(bucket_bytes=4 * gib, _warned_small_bucket=False)
    assert _SGLangSender._packed_bucket_bytes(sender, torch.device("cuda", 0)) == 3 * gib
    assert sender._warned_small_bucket
    assert _SGLangSender._packed_bucket_bytes(sender, torch.device("cpu")) == 4 * gib
    assert _SGLangSender._packed_bucket_bytes(sender, None) == 4 * gib
