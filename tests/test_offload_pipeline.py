"""Colocated offload through Ray (cluster.offload, docs/offload.md): the default tiny run in run.mode=sync,
the trainer and the torch engine handing their memory to each other at every step, trains exactly as the
same run without offload (sync on the CPU is deterministic: same rewards, same losses, same final
weights), and each phase's memory says the hand-overs really freed it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.orchestration.launcher import Pipeline, run_pipeline
from pipeline.orchestration.metrics import MetricsWriter
from pipeline.orchestration.progress import Progress

STEPS = 3
BOTH = ("cluster.offload.train=true", "cluster.offload.rollout=true")


def _run(tmp_path, name: str, *extra: str):
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / name}",
            f"run.steps={STEPS}",
            "run.mode=sync",
            "run.timeout_s=180",
            "metrics.progress=false",
            "metrics.tensorboard=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            *extra,
        ],
    )
    res = run_pipeline(cfg, stop_ray=False)
    assert res.status == "completed", res.error
    rows = [h for h in res.history if "version" in h]
    assert [h["version"] for h in rows] == list(range(1, STEPS + 1))
    weights = load_file(str(res.run_dir / "hf" / f"step_{STEPS:06d}" / "model.safetensors"))
    return rows, weights


def test_sync_run_with_offload_trains_as_the_run_without(tmp_path, ray_session):
    plain, plain_w = _run(tmp_path, "plain")
    off, off_w = _run(tmp_path, "offload", *BOTH)
    for a, b in zip(plain, off):
        assert (a["reward/mean"], a["loss"], a["grad_norm"]) == (b["reward/mean"], b["loss"], b["grad_norm"])
        assert a["staleness/max"] == b["staleness/max"] == 0
    assert plain_w.keys() == off_w.keys() and all(torch.equal(plain_w[k], off_w[k]) for k in plain_w)
    for m in off:
        # the trainer's state is off while the engine generates, the engine's while the trainer steps
        assert m["memory/train_gb/generate"] == 0 < m["memory/train_gb/train"]
        assert m["memory/rollout_gb/train"] == 0 < m["memory/rollout_gb/generate"]
        for k in ("offload/train_s", "onload/train_s", "offload/rollout_s", "onload/rollout_s"):
            assert m[k] > 0, k
        assert m["push/seconds"] > 0  # every step's push, into the woken engine
    assert not any(k.startswith(("offload/", "onload/", "memory/")) for k in plain[0])


@pytest.mark.slow
def test_offload_of_the_trainer_alone_keeps_the_engine_awake(tmp_path, ray_session):
    rows, _ = _run(tmp_path, "train-only", "cluster.offload.train=true")
    for m in rows:
        assert m["memory/train_gb/generate"] == 0 < m["memory/train_gb/train"]
        assert m["memory/rollout_gb/train"] == m["memory/rollout_gb/generate"] > 0
        assert m["offload/rollout_s"] < 0.05 and m["onload/rollout_s"] < 0.05  # nothing moved


def _kill_after(actor_of, metrics: MetricsWriter, step: int) -> threading.Thread:
    """SIGKILL the process of `actor_of()` once the driver has logged `step`."""
    import ray

    def run():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(h.get("step", 0) >= step for h in metrics.history):
            time.sleep(0.02)
        os.kill(ray.get(actor_of().pid.remote(), timeout=30), signal.SIGKILL)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["trainer", "generator"])
def test_a_stage_killed_mid_run_with_offload_is_healed_and_the_run_finishes(tmp_path, ray_session, stage):
    """A restarted trainer takes the start-up's turns (the engine releases before its state is built,
    then gets its weights); a healed generator starts awake and takes the hand-over calls in its turn."""
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=6",
            "run.mode=sync",
            "run.timeout_s=120",
            "metrics.progress=false",
            "metrics.tensorboard=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            "trainer.checkpoint_every=2",
            *BOTH,
        ],
    )
    metrics = MetricsWriter(tmp_path / "run", tensorboard=False)
    pipe = Pipeline(cfg, tmp_path / "run")
    try:
        pipe.start()
        killer = _kill_after(lambda: pipe.trainer if stage == "trainer" else pipe.generators[0], metrics, 3)
        steps = pipe.train(metrics, Progress(cfg.run.steps, enabled=False))
        killer.join(timeout=1)
    finally:
        pipe.shutdown(failed=False)
        metrics.close()
    rows = [h for h in metrics.history if "version" in h]
    assert steps == 6 and [h["version"] for h in rows] == list(range(1, 7))
    assert rows[-1]["run/restarts"] == 1
    assert all(h["staleness/max"] == 0 and h["memory/rollout_gb/train"] == 0 for h in rows)
