"""A re-run in the same directory continues one run: rows left by a trainer that got further than the
checkpoint are evicted and counted when the new trainer announces its (lower) version (never trained at negative staleness), and metrics.jsonl keeps one
line per step with the resume marked."""

from __future__ import annotations

import json

from buffer.config import BufferConfig
from buffer.inproc import InProcBuffer
from pipeline.orchestration.metrics import MetricsWriter
from stages.trainer.testing import make_samples


def test_rows_newer_than_the_trainer_are_evicted_and_counted(tmp_path):
    # the default policy (staleness_fifo) enforces the staleness bound
    buf = InProcBuffer(cfg=BufferConfig(durable=False), directory=str(tmp_path / "b"))
    buf.set_version(41)  # the old run's trainer got to 41 ...
    buf.put(make_samples(1, 4, version=40, prefix="old-"))  # ... and left rows of version 40
    buf.put(make_samples(1, 4, version=2, prefix="new-", seed=1))
    buf.set_version(3)  # the re-run's trainer resumed from a checkpoint at 3
    batch = buf.fetch(1, version=3, max_staleness=2, timeout_s=5)
    assert batch is not None and set(batch.column("group_id").to_pylist()) == {"new-g0-s1"}
    st = buf.stats()
    assert st["evicted_future"] == 4
    assert buf.fetch(1, version=3, max_staleness=2, timeout_s=0.05) is None  # the old group is gone


def test_metrics_resume_keeps_one_line_per_step(tmp_path):
    m = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 8):  # a run that logged 7 steps, then died; its checkpoint is at step 5
        m.log(step, {"version": step})
    m.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "ver')  # a line torn by kill -9
    m = MetricsWriter(tmp_path, tensorboard=False)
    m.resume_at(5)
    for step in (6, 7, 8):
        m.log(step, {"version": step})
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "version" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    marker = [r for r in rows if r.get("event") == "resume"]
    assert len(marker) == 1 and marker[0]["step"] == 5 and marker[0]["lines_dropped"] == 3


def test_live_stats_survive_a_restart_and_an_empty_segment_is_removed(tmp_path):
    from buffer.demo import synthetic_samples
    from buffer.storage import Buffer

    buf = Buffer(BufferConfig(), tmp_path)
    buf.insert(synthetic_samples(2, version=0, prefix="old"))
    buf.insert(synthetic_samples(1, version=5, prefix="new"))
    buf.fetch(1, version=5, max_staleness=2)  # evicts the two old groups, serves the new one
    before = buf.stats()
    buf.close()
    (tmp_path / "seg-999999.arrow").write_bytes(b"")  # left by a kill right after creating it
    again = Buffer(BufferConfig(), tmp_path)
    st = again.stats()
    for k in ("evicted_stale", "evicted_groups", "accepted", "evicted_groups_by_producer"):
        assert st[k] == before[k], k
    assert st["evicted_stale"] == 8 and any("empty" in t["problem"] for t in st["recovery"]["torn_segments"])
    again.close()
    third = Buffer(BufferConfig(), tmp_path)  # the empty file is gone: not reported at every restart
    assert third.stats()["recovery"]["torn_segments"] == []
    third.close()
