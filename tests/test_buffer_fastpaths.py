"""The ingest fast paths agree with the straightforward code they replace.

- `samples_to_batch` (one pass over the fields, one pooled block for the token columns) against the
  per-sample `b"".join` conversion it replaced, on random samples (empty responses, odd lengths, ...)
- the scratch pool never hands out memory that a batch still uses
- `Buffer.plan`'s group-by-group path against its row-by-row path, on random batches (duplicates,
  groups split over batches, conflicting sizes and indices)
- the fast crc32 against zlib's
- `check_batch` on sliced batches
"""

import random
import threading
import zlib

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from buffer import record as sample_mod
from buffer import segments
from buffer.config import BufferConfig
from buffer.record import (
    ARROW_SCHEMA,
    PACKED_FIELDS,
    Sample,
    ScratchPool,
    Status,
    batch_to_samples,
    min_versions,
    samples_to_batch,
)
from buffer.storage import Buffer
from buffer.validate import check_batch
from buffer.wire import ProtocolError

# -- the conversion ----------------------------------------------------------------------------------


def reference_samples_to_batch(samples: list[Sample]) -> pa.RecordBatch:
    """The conversion as it was before the fast path: per-sample lists and b"".join per column."""
    enc = msgspec.json.Encoder()
    types = {f.name: f.type for f in ARROW_SCHEMA}

    def list_column(blobs, name):
        dt = PACKED_FIELDS[name]
        lengths = np.fromiter((len(b) // dt.itemsize for b in blobs), dtype=np.int32, count=len(blobs))
        offsets = np.zeros(len(blobs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = pa.Array.from_buffers(
            types[name].value_type, int(offsets[-1]), [None, pa.py_buffer(b"".join(blobs))]
        )
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat)

    cols = {
        "uid": pa.array([s.uid for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "group_index": pa.array([s.group_index for s in samples], pa.int32()),
        "group_size": pa.array([s.group_size for s in samples], pa.int32()),
    }
    for name in PACKED_FIELDS:
        cols[name] = list_column([getattr(s, name) for s in samples], name)
    cols["reward"] = pa.array([s.reward for s in samples], pa.float64())
    cols["reward_parts"] = pa.array(
        [enc.encode(s.reward_parts).decode() if s.reward_parts else "{}" for s in samples], pa.string()
    )
    cols["status"] = pa.array([str(s.status) for s in samples], pa.string())
    for name in ("error", "prompt", "label"):
        cols[name] = pa.array([getattr(s, name) for s in samples], pa.string())
    cols["metadata"] = pa.array(
        [enc.encode(s.metadata).decode() if s.metadata else "{}" for s in samples], pa.string()
    )
    cols["generator_id"] = pa.array([s.generator_id for s in samples], pa.string())
    cols["created_at"] = pa.array([s.created_at for s in samples], pa.float64())
    cols["finished_at"] = pa.array([s.finished_at for s in samples], pa.float64())
    cols["min_version"] = pa.array(min_versions(cols["versions"], cols["loss_mask"]))
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=ARROW_SCHEMA)


def random_samples(rng: random.Random, n: int) -> list[Sample]:
    out = []
    for i in range(n):
        resp = rng.choice([0, 0, 1, 2, 3, 7, 31, 64, 1000, rng.randrange(5000)])  # empty and odd lengths
        prompt = rng.choice([0, 1, 5, 17, 256])
        g, size = divmod(i, 3)
        out.append(
            Sample.build(
                uid=f"ü-{rng.random()}-{i}",
                group_id=f"g{g}",
                group_index=size,
                group_size=3,
                prompt_ids=np.array([rng.randrange(2**31) for _ in range(prompt)], dtype=np.int32),
                response_ids=np.array([rng.randrange(2**31) for _ in range(resp)], dtype=np.int64),
                rollout_logprobs=np.array([-rng.random() for _ in range(resp)]),
                versions=[
                    rng.randrange(50) for _ in range(resp)
                ],  # values within the bounds of value_problem
                loss_mask=[rng.randrange(2) for _ in range(resp)] if rng.random() < 0.5 else None,
                reward=rng.choice([0.0, 1, rng.random()]),
                reward_parts=rng.choice([{}, {"correct": 1.0}, {"a": 0.5, "b": -1.0}]),
                status=rng.choice(list(Status)),
                error=rng.choice(["", "boom ✗"]),
                prompt=rng.choice(["", "prompt ∑", "x" * rng.randrange(300)]),
                label=rng.choice(["", "42"]),
                metadata=rng.choice([{}, {"k": [1, 2]}, {"nested": {"x": "y"}}]),
                generator_id=rng.choice(["", "gen-0"]),
                created_at=rng.random() * 1e9,
                finished_at=rng.random() * 1e9,
            )
        )
    return out


@pytest.mark.parametrize("seed", range(20))
def test_conversion_equals_the_per_sample_reference(seed):
    rng = random.Random(seed)
    samples = random_samples(rng, rng.choice([0, 1, 2, 5, 40, 150]))
    got, want = samples_to_batch(samples), reference_samples_to_batch(samples)
    got.validate(full=True)
    assert got.schema.equals(ARROW_SCHEMA)
    assert got.equals(want)
    for a, b in zip(batch_to_samples(got), samples):
        assert msgspec.structs.asdict(a) == msgspec.structs.asdict(b)
    check_batch(got)


def test_conversion_names_a_sample_whose_buffer_is_not_whole_values():
    s = random_samples(random.Random(0), 3)
    s[1] = msgspec.structs.replace(s[1], rollout_logprobs=s[1].rollout_logprobs + b"\0")
    with pytest.raises(ValueError, match=f"Sample {s[1].uid}: rollout_logprobs has .* not a multiple of 4"):
        samples_to_batch(s)


def test_conversion_accepts_status_given_as_plain_strings():
    s = random_samples(random.Random(1), 4)
    plain = [msgspec.structs.replace(x, status=str(x.status)) for x in s]
    assert samples_to_batch(plain).equals(samples_to_batch(s))


def test_scratch_blocks_are_reused_only_once_released(monkeypatch):
    pool = ScratchPool(max_bytes=64 << 20, min_bytes=0)
    monkeypatch.setattr(sample_mod, "SCRATCH", pool)
    rng = random.Random(2)
    kept_samples = random_samples(rng, 30)
    kept = samples_to_batch(kept_samples)
    want = reference_samples_to_batch(kept_samples)
    for _ in range(20):  # released at once: their blocks go round
        samples_to_batch(random_samples(rng, 30))
    assert pool.reused >= 15
    assert kept.equals(want)  # never overwritten while the caller holds it
    col = kept.column("response_ids")
    del kept
    for _ in range(5):  # a slice of one column still holds the whole block
        samples_to_batch(random_samples(rng, 30))
    assert col.equals(want.column("response_ids"))


def test_conversions_from_several_threads_never_share_memory():
    rng = random.Random(6)
    inputs = [random_samples(rng, 20) for _ in range(8)]
    wants = [reference_samples_to_batch(x) for x in inputs]
    errors = []

    def work(k):
        for j in range(15):
            i = (k + j) % len(inputs)
            got = samples_to_batch(inputs[i])
            held = [samples_to_batch(inputs[(i + 1) % len(inputs)]) for _ in range(2)]
            if not got.equals(wants[i]) or not held[0].equals(wants[(i + 1) % len(inputs)]):
                errors.append((k, j))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_scratch_pool_keeps_at_most_max_bytes():
    pool = ScratchPool(max_bytes=1 << 20, min_bytes=0)
    held = [pool.buffer(300_000) for _ in range(8)]
    del held
    assert sum(b.size for b in pool._free) == pool._free_bytes <= 1 << 20
    view, buf = pool.buffer(300_000)
    view[:4] = b"abcd"
    assert buf.size == 300_000 and buf.address % 64 == 0 and buf.to_pybytes()[:4] == b"abcd"


def test_small_conversions_take_exact_memory_outside_the_pool():
    """A small batch (one sample ingested by msgpack and kept by the server) pins only its own bytes."""
    pool = ScratchPool(max_bytes=1 << 20)  # default min_bytes: 1 MiB
    view, buf = pool.buffer(5000)
    assert buf.size == 5000 and len(view) == 5000
    del view, buf
    assert pool._free == [] and pool.allocated == 0


# -- dedup and indexing: group by group vs row by row -------------------------------------------------


def make_batch(rng: random.Random, n_groups: int, gen: int) -> list[Sample]:
    """Samples of random groups, some reusing older group ids / uids, some split or conflicting."""
    out = []
    for _ in range(n_groups):
        gid = f"g{rng.randrange(gen * 3 + 3)}"
        size = rng.choice([1, 2, 4])
        if rng.random() < 0.1:
            size += 1  # conflicting group_size for an existing group
        idxs = list(range(size))
        if rng.random() < 0.3:
            idxs = rng.sample(idxs, rng.randrange(1, size + 1))  # part of a group
        if rng.random() < 0.1:
            idxs.append(idxs[0])  # an index twice
        out.extend(_sample(gid, i, size, rng) for i in idxs)
    if rng.random() < 0.3:
        rng.shuffle(out)  # groups not in runs
    return out


def _sample(gid, i, size, rng):
    n = rng.randrange(4)
    return Sample.build(
        uid=f"{gid}-{i}-{rng.randrange(3)}",
        group_id=gid,
        group_index=i,
        group_size=size,
        prompt_ids=[1, 2],
        response_ids=list(range(n)),
        rollout_logprobs=[-0.5] * n,
        versions=[rng.randrange(5)] * n,
    )


def state(buf: Buffer) -> dict:
    return {
        "groups": {
            gid: (g.size, g.min_version, sorted(g.rows), sorted(g.uids)) for gid, g in buf._groups.items()
        },
        "complete": list(buf._complete),
        "live_rows": buf.live_rows,
        "seen": sorted(buf._seen),
        "counters": dict(buf.counters),
    }


@pytest.mark.parametrize("seed", range(30))
def test_group_by_group_plan_equals_row_by_row(seed, monkeypatch):
    rng = random.Random(seed)
    batches = [samples_to_batch(make_batch(rng, rng.randrange(1, 6), gen)) for gen in range(8)]
    fresh = [_sample(f"new{g}", i, 2, rng) for g in range(3) for i in (1, 0)]  # whole new groups
    batches.insert(
        rng.randrange(len(batches)),
        samples_to_batch([msgspec.structs.replace(x, uid=f"{x.uid}-{k}") for k, x in enumerate(fresh)]),
    )
    fast_plans = 0
    fast = Buffer(BufferConfig(durable=False, capacity_samples=10**6))
    slow = Buffer(BufferConfig(durable=False, capacity_samples=10**6))
    monkeypatch.setattr(slow, "_fresh_runs", lambda batch, uids: None)
    for b in batches:
        try:
            check_batch(b)
        except ProtocolError:
            continue
        pf, ps = fast.plan(b, checked=True), slow.plan(b, checked=True)
        fast_plans += pf.runs is not None
        assert (pf.n_new, pf.duplicates, pf.rejected, pf.errors) == (
            ps.n_new,
            ps.duplicates,
            ps.rejected,
            ps.errors,
        )
        fast.commit(pf)
        slow.commit(ps)
        assert state(fast) == state(slow)
        if rng.random() < 0.5 and fast.ready_groups():
            got_f, got_s = fast.fetch(1, 5, 10), slow.fetch(1, 5, 10)
            assert got_f.batch.equals(got_s.batch)
    assert fast_plans >= 1


def test_whole_new_groups_take_the_fast_path():
    buf = Buffer(BufferConfig(durable=False, capacity_samples=10**6))
    rng = random.Random(0)
    samples = [_sample(f"g{g}", i, 3, rng) for g in range(4) for i in (2, 0, 1)]
    samples = [msgspec.structs.replace(s, uid=f"u{k}") for k, s in enumerate(samples)]
    plan = buf.plan(samples_to_batch(samples))
    assert plan.runs is not None and plan.n_new == 12
    buf.commit(plan)
    assert buf.ready_groups() == 4
    out = buf.fetch(4, 5, 100).batch  # version 5: every sample's tokens (versions 0-4) are older
    assert out.column("group_index").to_pylist() == [0, 1, 2] * 4  # by group_index within each group
    again = buf.plan(samples_to_batch(samples[:3]))  # all duplicates: the row-by-row path
    assert again.runs is None and again.duplicates == 3 and again.n_new == 0


# -- checksums and validation ------------------------------------------------------------------------


@pytest.mark.skipif(segments._fast_crc32 is None, reason="no libdeflate on this machine: zlib is used")
def test_fast_crc32_equals_zlib():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for n in (0, 1, 3, 15, 16, 17, 255, 4096, 65537, 1 << 20):
        for start in (0, 1, 7):
            chunk = data[start : start + n]
            assert segments.crc32(chunk) == zlib.crc32(chunk.tobytes())
            assert segments.crc32(chunk, 12345) == zlib.crc32(chunk.tobytes(), 12345)
            assert segments.crc32(pa.py_buffer(chunk.tobytes())) == zlib.crc32(chunk.tobytes())
            assert segments.crc32(chunk.tobytes(), 7) == zlib.crc32(chunk.tobytes(), 7)


def test_batch_crc_ignores_slicing_and_layout():
    batch = samples_to_batch(random_samples(random.Random(3), 20))
    part = batch.slice(5, 9)
    copy = samples_to_batch(batch_to_samples(part))
    assert segments.batch_crc(part) == segments.batch_crc(copy)
    assert segments.batch_crc(part) != segments.batch_crc(batch.slice(5, 8))


def test_min_versions_of_a_slice_stop_at_its_end():
    s = random_samples(random.Random(5), 30)
    batch = samples_to_batch(s)
    col, mask = batch.column("versions"), batch.column("loss_mask")
    for a, b in ((0, 30), (3, 10), (29, 1), (12, 0)):
        want = [x.min_version() for x in s[a : a + b]]
        assert min_versions(col.slice(a, b), mask.slice(a, b)).tolist() == want


def test_check_batch_on_slices():
    s = random_samples(random.Random(4), 6)
    s[4] = msgspec.structs.replace(s[4], uid="")
    batch = reference_samples_to_batch(s)
    check_batch(batch.slice(0, 4))  # the empty uid is outside this slice
    with pytest.raises(ProtocolError, match="empty uid"):
        check_batch(batch.slice(3, 3))
    bad = reference_samples_to_batch([msgspec.structs.replace(x, status="nope") for x in s[:2]])
    with pytest.raises(ProtocolError, match="unknown status"):
        check_batch(bad)
    cols = reference_samples_to_batch(s[:3]).columns
    cols[ARROW_SCHEMA.get_field_index("reward_parts")] = pa.array(["{}", "[1]", "{}"])
    with pytest.raises(ProtocolError, match="reward_parts holds '\\[1\\]', not a JSON object"):
        check_batch(pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA))


def test_crc_of_nothing_keeps_the_running_value():
    """An empty (even null-pointer) buffer leaves the CRC as it was, as zlib does."""
    import zlib

    from buffer.segments import crc32

    for data in (pa.foreign_buffer(0, 0), b"", np.zeros(0, np.uint8)):
        assert crc32(data, 5) == zlib.crc32(b"", 5) == 5
