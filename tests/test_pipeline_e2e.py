"""End to end through Ray: the default pipeline for a few steps, sync mode, and a failing stage."""

import json
import platform

import pytest

from pipeline.config import load_config
from pipeline.launcher import run_pipeline, start_ray


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    start_ray(load_config(None, ["cluster.num_cpus=4"]))  # 4 logical CPUs: room for eval on 2 cores
    yield
    ray.shutdown()


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=4",
            "run.timeout_s=180",
            "metrics.progress=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            *extra,
        ],
    )


def test_default_pipeline_flows_versions_advance_and_pushes_land(tmp_path, ray_session):
    res = run_pipeline(
        _cfg(tmp_path, "eval.every_steps=2", "eval.num_prompts=4", "eval.samples_per_prompt=2"),
        stop_ray=False,
    )
    assert res.status == "completed", res.error
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "version" in r]
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    assert all(r["samples"] == 16 for r in train)  # 4 groups x 4 samples per step
    assert max(r["generator/engine_version_min"] for r in train) >= 1  # pushes reached the engine
    assert all(r["staleness/max"] <= 2 for r in train)
    for r in train:  # the staleness histogram counts every trained sample once
        assert sum(v for k, v in r.items() if k.startswith("staleness/hist_")) == r["samples"]
    # a generator running ahead may make nothing between two steps, but over the run it makes tokens
    assert sum(r["throughput/generated_tokens_per_s"] for r in train[1:]) > 0
    assert any("eval/accuracy" in r for r in rows)
    assert (res.run_dir / "config.yaml").exists() and (res.run_dir / "reward_staleness.png").exists()
    assert list((res.run_dir / "tensorboard").iterdir())
    assert list((res.run_dir / "buffer").glob("*.arrow")), "the buffer keeps its segments in the run dir"
    if platform.libc_ver()[0] == "glibc":  # the buffer actor runs with its malloc settings (buffer/memory.py)
        assert train[-1]["buffer/malloc_settings"] == 1 and train[-1]["buffer/reserved_mb"] == 256


def test_sync_mode_trains_on_policy(tmp_path, ray_session):
    res = run_pipeline(_cfg(tmp_path, "run.mode=sync", "run.steps=3"), stop_ray=False)
    assert res.status == "completed", res.error
    assert [h["staleness/max"] for h in res.history] == [0, 0, 0]


def test_failing_stage_stops_the_run_with_its_error(tmp_path, ray_session):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "12", "label": "12"}\n{"prompt": "34", "label": \n')
    res = run_pipeline(
        _cfg(tmp_path, f"rollout.data.source={bad}", "rollout.reward.fn=exact_match"), stop_ray=False
    )
    assert res.status == "failed"
    assert "generator gen-0" in res.error and "prompts.jsonl:2: not valid JSON" in res.error


def test_rerun_in_the_same_run_dir_resumes_and_is_not_starved_by_duplicates(tmp_path, ray_session):
    # 4 steps > max_staleness 2: unless the resumed trainer sends the engines its checkpoint's weights
    # first, every group they make from the base model is too stale to train on
    first = run_pipeline(_cfg(tmp_path, "run.steps=4"), stop_ray=False)
    assert first.status == "completed", first.error
    # same directory: the buffer recovers the old uids and the trainer its checkpoint; new samples must
    # not collide with the recovered uids (they would be dropped as duplicates and the trainer would starve)
    again = run_pipeline(
        _cfg(tmp_path, "run.steps=2", "run.timeout_s=60", "trainer.fetch_timeout_s=60"), stop_ray=False
    )
    assert again.status == "completed", again.error
    assert [h["version"] for h in again.history if "version" in h] == [5, 6]


@pytest.mark.parametrize("layout", ["trainer.dp=2", "trainer.tp=2"])
def test_trainer_of_two_ranks_runs_in_the_pipeline(tmp_path, ray_session, layout):
    """bin/run-pipeline trainer.tp=2 (or dp=2): two trainer actors form one gloo world, rank 0 fetches and
    broadcasts, pushes reach the engine, and the final HF export has the model's own vocabulary (the
    default tiny model's 259 rows are padded to 260 at TP=2)."""
    from safetensors import safe_open

    res = run_pipeline(_cfg(tmp_path, layout, "run.steps=3"), stop_ray=False)
    assert res.status == "completed", res.error
    train = [h for h in res.history if "version" in h]
    assert [r["version"] for r in train] == [1, 2, 3]
    assert all(r["trainer/ranks"] == 2 for r in train)
    assert max(r["generator/engine_version_min"] for r in train) >= 1
    vocab = json.loads((res.run_dir / "hf" / "step_000003" / "config.json").read_text())["vocab_size"]
    with safe_open(str(next((res.run_dir / "hf" / "step_000003").glob("*.safetensors"))), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == vocab
