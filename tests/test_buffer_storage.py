"""Buffer storage, policies, validation and crash recovery (no sockets)."""

import os
import random

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.inproc import InProcBuffer
from buffer.policy import Fifo, StalenessFifo, Uniform, make_policy
from buffer.record import Sample, batch_to_samples, samples_to_batch
from buffer.segments import iter_log
from buffer.storage import Buffer
from buffer.transport import BufferUnavailable
from buffer.validate import check_batch
from buffer.wire import ProtocolError


def cfg(**kw) -> BufferConfig:
    return msgspec.convert(kw, BufferConfig)


def uids(batch) -> list[str]:
    return batch.column("uid").to_pylist()


def test_ingest_dedup_and_group_completion(tmp_path):
    buf = Buffer(cfg(), tmp_path)
    s = synthetic_samples(3, group_size=2)
    assert buf.insert(s[:3]).n_new == 3
    assert buf.ready_groups() == 1  # the second group has 1 of 2
    p = buf.insert(s)  # resend with the rest: the first three are duplicates
    assert (p.n_new, p.duplicates) == (3, 3)
    assert buf.ready_groups() == 3 and buf.live_rows == 6
    out = buf.fetch(2, version=0, max_staleness=0).batch
    assert uids(out) == [x.uid for x in s[:4]]
    assert buf.insert(s[:2]).duplicates == 2  # consumed uids stay duplicates
    assert batch_to_samples(out)[0] == s[0]


def test_group_conflicts_are_rejected_not_stored():
    buf = Buffer(cfg(durable=False))
    a = synthetic_samples(1, group_size=2, prefix="a")
    clash = msgspec.structs.replace(a[1], uid="other", group_index=0)
    resized = msgspec.structs.replace(a[1], uid="x", group_size=3)
    p = buf.insert([a[0], clash, resized])
    assert (p.n_new, p.rejected) == (1, 2)
    assert "already has a sample at group_index 0" in p.errors[0]
    assert "group_size 2" in p.errors[1]


def test_staleness_eviction_counts_and_logs(tmp_path):
    buf = Buffer(cfg(), tmp_path)
    buf.insert(synthetic_samples(2, version=0, prefix="old"))
    buf.insert(synthetic_samples(1, version=3, prefix="new"))
    buf.insert(synthetic_samples(1, group_size=4, version=0, prefix="partial")[:2])  # incomplete, stale
    res = buf.fetch(1, version=4, max_staleness=2)
    assert uids(res.batch)[0].startswith("new") and res.evicted == 8 + 2
    assert buf.stats()["evicted_stale"] == 10 and buf.live_rows == 0
    # per producer (Sample.generator_id), for the generators' admission control: 2 + 1 groups
    assert sum(buf.stats()["evicted_groups_by_producer"].values()) == 3
    ops = [r.op for r in iter_log(tmp_path)]
    assert "evicted" in ops and "served" in ops


def test_the_staleness_bound_is_exact(tmp_path):
    """At trainer version 5 with max_staleness 2, a group of version 3 (staleness 2) is served and one
    of version 2 (staleness 3) is evicted: the bound is `staleness <= max_staleness`, not one more."""
    buf = Buffer(cfg(), tmp_path)
    buf.insert(synthetic_samples(1, version=2, prefix="three"))
    buf.insert(synthetic_samples(1, version=3, prefix="two"))
    res = buf.fetch(2, version=5, max_staleness=2)
    assert res.batch is None and res.evicted == 4  # the staleness-3 group is gone, 1 group left < 2
    res = buf.fetch(1, version=5, max_staleness=2)
    assert res.batch is not None and {u.split("-")[0] for u in uids(res.batch)} == {"two"}


def test_fifo_ignores_staleness_uniform_reuses():
    buf = Buffer(cfg(durable=False, policy="fifo"))
    buf.insert(synthetic_samples(2, version=0))
    assert buf.fetch(2, version=100, max_staleness=0).batch.num_rows == 8
    buf = Buffer(cfg(durable=False, policy="uniform", max_times_sampled=2))
    buf.insert(synthetic_samples(3, group_size=1))
    served = [u for _ in range(3) for u in uids(buf.fetch(2, 0, 0).batch)]
    assert sorted(served) == sorted([f"s-{g}-0" for g in range(3)] * 2)
    assert buf.fetch(1, 0, 0).batch is None  # every group used twice: retired


def test_policies_validate_with_reasons():
    with pytest.raises(ValueError, match="would never be served.*max_times_sampled"):
        Uniform(0)
    with pytest.raises(ValueError, match="has no effect with policy 'fifo'"):
        make_policy(cfg(policy="fifo", max_times_sampled=3))
    with pytest.raises(ValueError, match="no ingest could ever be acked"):
        Buffer(cfg(capacity_samples=0, durable=False))
    assert isinstance(make_policy(cfg()), StalenessFifo) and isinstance(make_policy(cfg(policy="fifo")), Fifo)


def test_columnar_validation_names_the_problem():
    good = samples_to_batch(synthetic_samples(2))
    check_batch(good)
    at = good.schema.get_field_index("min_version")
    bad_min = good.set_column(at, "min_version", pa.array([-5] * 8, pa.int32()))
    with pytest.raises(ProtocolError, match="min_version does not match"):
        check_batch(bad_min)
    s = synthetic_samples(1, group_size=1)[0]
    short = msgspec.structs.replace(s, loss_mask=s.loss_mask[:-1])
    with pytest.raises(ProtocolError, match="loss_mask is not aligned"):
        check_batch(samples_to_batch([short]))
    with pytest.raises(ProtocolError, match="group_index 5 outside"):
        check_batch(samples_to_batch([msgspec.structs.replace(s, group_index=5)]))


def test_recovery_keeps_acked_and_forgets_consumed(tmp_path):
    buf = Buffer(cfg(segment_max_mb=0), tmp_path)  # every batch rolls to a new segment
    buf.insert(synthetic_samples(4, prefix="a"))
    buf.insert(synthetic_samples(4, prefix="b"))
    served = uids(buf.fetch(3, version=1, max_staleness=5).batch)
    buf.close()
    buf2 = Buffer(cfg(), tmp_path)
    assert buf2.version == 1 and buf2.live_rows == 32 - 12
    assert buf2.insert(synthetic_samples(4, prefix="a")).duplicates == 16
    rest = uids(buf2.fetch(5, version=1, max_staleness=5).batch)
    assert not set(rest) & set(served) and len(rest) == 20
    assert buf2.fetch(1, version=1, max_staleness=5).batch is None


def test_recovery_preserves_uniform_sample_counts(tmp_path):
    c = cfg(policy="uniform", max_times_sampled=2)
    buf = Buffer(c, tmp_path)
    buf.insert(synthetic_samples(1, group_size=2))
    buf.fetch(1, 0, 0)
    buf.close()
    buf2 = Buffer(c, tmp_path)
    assert buf2.fetch(1, 0, 0).batch.num_rows == 2
    assert buf2.fetch(1, 0, 0).batch is None


def _write_segment(tmp_path, n_batches=5):
    buf = Buffer(cfg(), tmp_path)
    for i in range(n_batches):
        buf.insert(synthetic_samples(2, response_len=50, prefix=f"b{i}"))
    buf.close()
    (seg,) = tmp_path.glob("seg-*.arrow")
    return seg


def _boundaries(seg) -> list[int]:
    """Byte offset where each batch ends."""
    src = pa.memory_map(str(seg))
    r = pa.ipc.open_stream(src)
    ends = []
    for _ in r:
        ends.append(src.tell())
    return ends


@pytest.mark.parametrize("seed", range(12))
def test_torn_segment_tail_truncated(tmp_path, seed):
    seg = _write_segment(tmp_path)
    ends = _boundaries(seg)
    cut = random.Random(seed).randrange(1, seg.stat().st_size)
    os.truncate(seg, cut)
    intact = sum(1 for e in ends if e <= cut)
    buf = Buffer(cfg(), tmp_path)
    assert buf.live_rows == intact * 8
    rep = buf.recovery["torn_segments"]
    assert (len(rep) == 1) == (cut not in ends)
    if rep:
        assert rep[0]["torn_bytes"] == cut - (ends[intact - 1] if intact else 0) or intact == 0
    buf.insert(synthetic_samples(1, prefix="after"))
    buf.close()
    assert Buffer(cfg(), tmp_path).live_rows == intact * 8 + 4  # the cut is permanent and clean


@pytest.mark.parametrize("seed", range(12))
def test_bit_flip_in_last_batch_detected(tmp_path, seed):
    seg = _write_segment(tmp_path)
    ends = _boundaries(seg)
    original = pa.ipc.open_stream(seg.read_bytes()).read_all()
    rng = random.Random(seed)
    data = bytearray(seg.read_bytes())
    for _ in range(rng.randint(1, 3)):
        pos = rng.randrange(ends[-2], ends[-1])
        data[pos] ^= 1 << rng.randrange(8)
    seg.write_bytes(bytes(data))
    buf = Buffer(cfg(), tmp_path)
    # The first four batches survive; the flipped one is dropped unless the flip hit padding bytes,
    # which carry no data: whatever is recovered must equal what was written.
    assert buf.live_rows in (32, 40)
    assert buf.live_table().equals(original.slice(0, buf.live_rows))
    if buf.live_rows == 32:
        assert buf.recovery["torn_segments"][0]["problem"]


def test_inproc_backpressure_and_fetch_wait(tmp_path):
    import threading

    ib = InProcBuffer(cfg=cfg(capacity_samples=8), directory=tmp_path)
    ib.put(synthetic_samples(2, prefix="a"))
    with pytest.raises(BufferUnavailable, match="stayed full"):
        ib.put(synthetic_samples(1, prefix="b"), timeout_s=0.2)
    t = threading.Timer(0.2, lambda: ib.fetch(1, 0, 0))
    t.start()
    ack = ib.put(synthetic_samples(1, prefix="b"), timeout_s=5)  # unblocked by the fetch
    assert ack.accepted == 4
    t.join()
    assert ib.fetch(5, 0, 0, timeout_s=0.1) is None
    assert ib.stats()["served_groups"] == 1
    ib.close()


def test_empty_response_samples_are_never_stale():
    s = Sample(uid="e", group_id="g", prompt_ids=np.arange(3, dtype="<i4").tobytes())
    buf = Buffer(cfg(durable=False))
    buf.insert([s])
    assert buf.fetch(1, version=50, max_staleness=0).batch.num_rows == 1


def test_a_group_newer_than_the_fetching_trainer_is_never_served():
    """After a trainer went back to its checkpoint (version 3), engines still on version 5 finish
    groups: they arrive after the version was lowered, so the lowering's eviction missed them. Before:
    served at staleness -2."""
    buf = Buffer(BufferConfig(durable=False))
    buf.set_version(5)
    buf.set_version(3)  # the restarted trainer's first fetch
    buf.insert(synthetic_samples(1, version=5, prefix="late"))
    buf.insert(synthetic_samples(1, version=3, prefix="ok"))
    res = buf.fetch(1, version=3, max_staleness=2)
    assert res.batch is not None and set(res.batch.column("min_version").to_pylist()) == {3}
    assert buf.counters["evicted_future"] == len(synthetic_samples(1)) and buf.ready_groups() == 0
