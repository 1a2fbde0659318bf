"""Elastic rollout (docs/elastic.md): generators added to and removed from a run while it goes, through
a request file in the run directory. The run completes its steps, nothing acknowledged is lost and
nothing is trained twice, an added generator's samples are trained, and a malformed or impossible
request is reported and ignored."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from run_setup import small_run

from pipeline.orchestration.elastic import (
    REJECTED_FILE,
    REQUEST_FILE,
    Scaler,
    read_status,
    take_request,
    write_request,
)
from pipeline.orchestration.placement import PlacementError, check_room
from stages.rollout.admission import StalenessAdmission

REPO = Path(__file__).resolve().parents[1]


# -- the request file -----------------------------------------------------------------------------
def test_a_request_is_taken_once_and_a_malformed_one_is_kept_aside_with_the_fix(tmp_path):
    assert take_request(tmp_path) is None
    req = write_request(tmp_path, 3)
    got = take_request(tmp_path)
    assert got == req and not (tmp_path / REQUEST_FILE).exists()
    assert take_request(tmp_path) is None  # taken: not handled twice
    (tmp_path / REQUEST_FILE).write_text('{"generators": "three"}')
    msg = take_request(tmp_path)
    assert isinstance(msg, str)
    assert str(tmp_path / REQUEST_FILE) in msg and "--generators N" in msg and "ignored" in msg
    assert (tmp_path / REJECTED_FILE).read_text() == '{"generators": "three"}'
    (tmp_path / REQUEST_FILE).write_text('{"generators": 2, "workers": 1}')  # a typo'd key
    assert "workers" in take_request(tmp_path)


@pytest.mark.parametrize(
    "overrides, n, says",
    [
        ([], 5, "ask for 1 to 4 generators"),
        ([], 0, "ask for 1 to 4 generators"),
        (["run.mode=sync", "cluster.offload.train=true"], 2, "cluster.offload is on"),
        (["rollout.engine=sglang"], 2, "weights.transport=auto"),
        (["rollout.engine=sglang", "weights.transport=nccl"], 2, "with weights.transport=cpu each generator"),
        (["rollout.engine=sglang", "weights.transport=cpu"], 2, ""),  # receivers: generators come and go
        ([], 4, ""),
    ],
)
def test_impossible_counts_and_setups_are_refused_naming_the_fix(tmp_path, overrides, n, says):
    scaler = Scaler(small_run(tmp_path, *overrides), None, None, None, None, None)
    why = scaler.refusal(n)
    assert (says in why) if says else why == ""
    if "offload" in says or "transport" in says:  # a way on: start again with the count
        assert f"rollout.num_generators={n}" in why


def test_an_added_generator_that_does_not_fit_the_cluster_is_refused_naming_the_resource():
    check_room({"CPU": 1}, 2, {"CPU": 2.0})
    with pytest.raises(PlacementError, match=r"need 2 GPU .* has 1 GPU free"):
        check_room({"CPU": 1, "GPU": 1}, 2, {"CPU": 8.0, "GPU": 1.0})


# -- the admission bound --------------------------------------------------------------------------
class _Engine:
    def __init__(self, version: int):
        self.version = version

    def version_and_relaunches(self):
        return self.version, 0


def test_a_new_share_keeps_the_groups_ahead_and_measures_the_window_in_it():
    """At engine version 10 a generator of share 2 that kept pace (20 consumed + 3 ahead) goes to share
    4 (a generator left): it may have (max_staleness + 1) * 4 groups ahead, not 2's window, nor a
    window per version already trained."""
    eng = _Engine(10)
    adm = StalenessAdmission(eng, batch_groups=2, max_staleness=1, name="g")
    assert adm.admits(live=23, running=0, dip_wait_s=1.0)  # 3 ahead < (1+1)*2
    assert not adm.admits(live=24, running=0, dip_wait_s=1.0)
    adm.reshare(4)
    assert adm.admits(live=23 + 4, running=0, dip_wait_s=1.0)  # 7 ahead < 8
    assert not adm.admits(live=24 + 4, running=0, dip_wait_s=1.0)
    adm.reshare(1)  # three more joined: 8 ahead at version 10, far past share 1's window of 2
    assert not adm.admits(live=28, running=0, dip_wait_s=1.0)
    eng.version = 16  # 6 of them consumed at 1 a version: 2 ahead, not < 2
    assert not adm.admits(live=28, running=0, dip_wait_s=1.0)
    eng.version = 17
    assert adm.admits(live=28, running=0, dip_wait_s=1.0)
    with pytest.raises(ValueError, match="need >= 1"):
        adm.reshare(0)


def test_a_rebase_counts_the_window_from_the_buffers_tally_whatever_share_was_taken_before():
    """After a removal the one left takes the whole batch. Its groups ahead of the trainer are what the
    buffer holds of its own plus what runs, however many of its groups the earlier batches took: 3
    buffered + 1 running at share 4 and max_staleness 1 leave 4 places in the window of 8."""
    eng = _Engine(10)
    adm = StalenessAdmission(eng, batch_groups=2, max_staleness=1, name="g")
    # 60 kept-or-running groups so far: far more than 10 versions x 2 (the other generator was slower)
    adm.rebase(live=60, running=1, buffered=3, trainer_version=10, batch_groups=4)
    assert adm.batch_groups == 4
    assert adm.admits(live=60 + 3, running=1, dip_wait_s=1.0)  # 7 ahead < 8
    assert not adm.admits(live=60 + 4, running=1, dip_wait_s=1.0)  # 8 ahead: the window is full
    eng.version = 11  # the trainer took one batch of 4: room for 4 more
    assert adm.admits(live=60 + 7, running=1, dip_wait_s=1.0)
    with pytest.raises(ValueError, match="need >= 1"):
        adm.rebase(live=60, running=0, buffered=0, trainer_version=10, batch_groups=0)


class _TallySink:
    """A buffer as a generator asks it: `buffered` of generator "g"'s groups unconsumed at trainer version
    `version`, `evicted` of its groups evicted as too stale."""

    def __init__(self, version: int, buffered: int, evicted: int):
        self.version, self.buffered, self.evicted = version, buffered, evicted

    def stats(self):
        return {
            "rows": self.buffered,
            "version": self.version,
            "evicted_groups_by_producer": {"g": self.evicted},
        }

    def peek(self, rows):
        import pyarrow as pa

        ids = [f"g-{i}" for i in range(self.buffered)]
        return pa.table({"generator_id": ["g"] * rows, "group_id": ids[:rows], "metadata": ["{}"] * rows})

    def evicted_groups(self, producer):
        return self.evicted


def test_a_generator_whose_groups_were_evicted_recounts_its_window_from_the_buffers_tally(tmp_path_factory):
    """A surplus in the admission count (here 10 groups it counts as consumed that were not) makes the
    buffer evict groups of ours, and since an evicted group frees its place the surplus would live on.
    Told of the evictions, the generator counts its groups ahead of the trainer from the buffer's tally:
    5 buffered at share 2 and max_staleness 1 fill the window of 4; a batch taken frees one place."""
    import asyncio

    from stages.rollout.generator import Generator
    from tests.test_rollout_generator import make_cfg, rollout_args

    eng = _Engine(10)
    cfg = make_cfg(tmp_path_factory)  # run.max_staleness 1
    sink = _TallySink(version=10, buffered=5, evicted=0)
    gen = Generator(*rollout_args(cfg), sink, eng, "g", batch_groups=2)
    gen.counters["groups_started"] = 30  # 20 consumed by version 10, 5 buffered, 5 to be evicted
    gen._admission._kept_offset = 10  # the surplus
    assert gen.admissible()
    sink.evicted = 5
    asyncio.run(gen._refresh_evicted())
    assert gen.counters["groups_evicted"] == 5
    assert not gen.admissible()  # 5 ahead of the trainer at version 10: the window of (1 + 1) x 2 is full
    eng.version = 11  # the trainer took a batch of 2 of ours: 3 ahead
    assert gen.admissible()
    gen.counters["groups_started"] += 1
    assert not gen.admissible()


# -- the command ----------------------------------------------------------------------------------
def test_the_scale_command_names_a_directory_that_is_not_a_run_and_writes_a_request_in_one(tmp_path):
    cmd = [sys.executable, "-m", "pipeline", "scale"]
    bad = subprocess.run([*cmd, str(tmp_path), "--generators", "2"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
    (tmp_path / "config.yaml").write_text("run: {}\n")
    ok = subprocess.run(
        [*cmd, str(tmp_path), "--generators", "2", "--wait", "0"], cwd=REPO, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / REQUEST_FILE).read_text())["generators"] == 2
    late = subprocess.run(
        [*cmd, str(tmp_path), "--generators", "2", "--wait", "0.5"], cwd=REPO, capture_output=True, text=True
    )
    assert late.returncode == 3 and "no answer" in late.stderr


# -- a run ----------------------------------------------------------------------------------------
def _request_at(run_dir: Path, metrics, step: int, body: str | int, answers: list) -> threading.Thread:
    """Once the driver logged `step` (at most 120 s), write a request (a count, or raw text) and wait for
    the driver's answer (at most 60 s) into `answers`."""

    def run():
        deadline = time.monotonic() + 120
        # metrics.history is looked up each time: the writer replaces the list when the run (re)starts
        while time.monotonic() < deadline and not any(h.get("step", 0) >= step for h in metrics.history):
            time.sleep(0.02)
        if isinstance(body, int):
            rid = write_request(run_dir, body).id
        else:
            (run_dir / REQUEST_FILE).write_text(body)
            rid = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = read_status(run_dir)
            if st is not None and st.id == rid and (rid or st.outcome == "malformed"):
                answers.append(st)
                return
            time.sleep(0.05)
        answers.append(f"no answer to the request at step {step} within 60 s")

    t = threading.Thread(target=run, daemon=True, name=f"scale request at step {step}")
    t.start()
    return t


def test_a_generator_added_and_one_removed_mid_run_loses_and_repeats_nothing(tmp_path, ray_session):
    import ray

    from buffer.segments import iter_log, recover_segments
    from pipeline.orchestration.launcher import Pipeline
    from pipeline.orchestration.metrics import MetricsWriter
    from pipeline.orchestration.progress import Progress

    cfg = small_run(tmp_path, "run.steps=12")
    run_dir = Path(cfg.run.dir)
    metrics = MetricsWriter(run_dir, tensorboard=False)
    pipe = Pipeline(cfg, run_dir)
    answers: list = []
    failed, accepted = True, None
    try:
        pipe.start()
        threads = [
            _request_at(run_dir, metrics, 1, "generators: 2", answers),
            _request_at(run_dir, metrics, 2, 2, answers),
            _request_at(run_dir, metrics, 7, 1, answers),
        ]
        steps = pipe.train(metrics, Progress(cfg.run.steps, enabled=False))
        for t in threads:
            t.join(timeout=70)
        accepted = ray.get(pipe.buffer.stats.remote(), timeout=60)["accepted"]
        failed = False
    finally:
        pipe.shutdown(failed=failed)
        metrics.close()
    assert steps == 12 and [h["version"] for h in metrics.history if "version" in h] == list(range(1, 13))
    outcomes = sorted(a.outcome if not isinstance(a, str) else a for a in answers)
    assert outcomes == ["applied", "applied", "malformed"], answers
    counts = [h["generators/count"] for h in metrics.history]
    assert 2 in counts and counts[0] == 1 and counts[-1] == 1, counts
    log = list(iter_log(run_dir / "buffer"))
    served = collections.Counter(u for r in log if r.op == "served" for u in r.uids)
    assert served and max(served.values()) == 1, "a sample was trained twice"
    stored = {u for _, b in recover_segments(run_dir / "buffer").batches for u in b.column("uid").to_pylist()}
    assert accepted is not None and accepted <= len(stored), "an acknowledged sample was lost"
    assert set(served) <= stored
    slots = collections.Counter(u.split(".", 1)[0] for u in served)  # gen-<i>.<incarnation>-...
    assert slots.get("gen-1", 0) > 0, f"the added generator's samples were never trained: {slots}"


@pytest.mark.slow  # ~45 s: the added generator killed, healed in its own placement group, then removed
def test_an_added_generator_that_dies_is_healed_in_its_own_placement_and_can_then_leave(
    tmp_path, ray_session
):
    import os
    import signal

    import ray

    from buffer.segments import iter_log
    from pipeline.orchestration.launcher import Pipeline
    from pipeline.orchestration.metrics import MetricsWriter
    from pipeline.orchestration.progress import Progress

    cfg = small_run(tmp_path, "run.steps=14")
    run_dir = Path(cfg.run.dir)
    metrics = MetricsWriter(run_dir, tensorboard=False)
    pipe = Pipeline(cfg, run_dir)
    answers: list = []
    failed = True

    def kill_added():  # once the run has a second generator, after step 5 (at most 120 s)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            len(pipe.generators) == 2 and any(h.get("step", 0) >= 5 for h in metrics.history)
        ):
            time.sleep(0.05)
        os.kill(ray.get(pipe.generators[1].pid.remote(), timeout=30), signal.SIGKILL)

    try:
        pipe.start()
        threads = [_request_at(run_dir, metrics, 1, 2, answers), _request_at(run_dir, metrics, 9, 1, answers)]
        threading.Thread(target=kill_added, daemon=True, name="kill the added generator").start()
        steps = pipe.train(metrics, Progress(cfg.run.steps, enabled=False))
        for t in threads:
            t.join(timeout=70)
        failed = False
    finally:
        pipe.shutdown(failed=failed)
        metrics.close()
    assert steps == 14 and [a.outcome for a in answers] == ["applied", "applied"], answers
    assert pipe.healer.deaths.get("generator gen-1"), "the added generator's death was not healed"
    served = collections.Counter(u for r in iter_log(run_dir / "buffer") if r.op == "served" for u in r.uids)
    assert max(served.values()) == 1
    incarnations = {u.split("-", 2)[1].split(".")[1] for u in served if u.startswith("gen-1.")}
    assert len(incarnations) == 2, incarnations  # the added one and its healed incarnation both trained
