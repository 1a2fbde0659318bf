"""End to end through Ray: the default pipeline for a few steps, sync mode, and a failing stage."""

import json
import platform
import re
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.orchestration.launcher import run_pipeline


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


def test_sync_mode_trains_on_policy_with_the_pushed_weights(tmp_path, ray_session):
    """run.mode=sync trains every batch on samples of the previous step's weights (staleness 0), and the
    engine samples with exactly the weights the trainer pushed: the trainer's logp_old of tokens the
    engine tagged with the trainer's current version equals the engine's logprob (~2e-7 in fp32; an
    engine that bumps its version but keeps stale weights is ~0.5 off), so the importance ratios and
    the off-policy correction are computed on what was really sampled."""
    res = run_pipeline(_cfg(tmp_path, "run.mode=sync", "run.steps=5"), stop_ray=False)
    assert res.status == "completed", res.error
    train = [h for h in res.history if "version" in h]
    assert [h["staleness/max"] for h in train] == [0] * 5
    fresh = [h for h in train if h["logp/same_version_tokens"] > 0]
    # sync: every batch is generated after the previous push landed, so (nearly) every step has such
    # tokens (all 5 today); step 1's are the engine's own load of the model, steps 2.. the pushed weights
    assert len(fresh) >= 4, [h["logp/same_version_tokens"] for h in train]
    diffs = {h["version"]: h["logp/abs_diff_same_version"] for h in fresh}
    assert all(d <= 1e-4 for d in diffs.values()), f"engine logprobs differ from the trainer's: {diffs}"


def test_a_bad_dataset_line_fails_before_any_stage_starts(tmp_path, ray_session):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "12", "label": "12"}\n{"prompt": "34", "label": \n')
    res = run_pipeline(
        _cfg(tmp_path, f"rollout.data.source={bad}", "rollout.reward.fn=exact_match"), stop_ray=False
    )
    assert res.status == "failed" and res.elapsed_s < 30  # checked in the driver, before Ray starts
    assert "prompts.jsonl:2: not valid JSON" in res.error and "rollout.data.on_bad_line=skip" in res.error


def test_failing_stage_stops_the_run_with_its_error(tmp_path, ray_session):
    """A generator that raises (here: every prompt is longer than max_prompt_tokens, overlong=skip) stops
    the run with its name and error at once; it is not restarted, since it would raise again."""
    res = run_pipeline(_cfg(tmp_path, "rollout.data.max_prompt_tokens=1"), stop_ray=False)
    assert res.status == "failed"
    assert res.error.startswith("generator gen-0 failed") and "max_prompt_tokens" in res.error
    # where it raised is kept beside the run, named in the error (the message has the last line only)
    where = re.search(r"\(traceback: (\S+)\)$", res.error)
    assert where, res.error
    report = Path(where.group(1)).read_text()
    assert Path(where.group(1)).parent == res.run_dir / "errors"
    assert 'File "' in report and "stages/rollout/" in report and "max_prompt_tokens" in report


def test_rerun_in_the_same_run_dir_resumes_and_is_not_starved_by_duplicates(tmp_path, ray_session):
    # 4 steps > max_staleness 2: unless the resumed trainer sends the engines its checkpoint's weights
    # first, every group they make from the base model is too stale to train on
    first = run_pipeline(_cfg(tmp_path, "run.steps=4"), stop_ray=False)
    assert first.status == "completed", first.error
    # same directory: the buffer recovers the old uids and the trainer its checkpoint; new samples must
    # not collide with the recovered uids (they would be dropped as duplicates and the trainer would starve)
    # the generator's data position is kept in the run directory; a re-run continues from it (marked
    # here as epoch 5, which a fresh start could not reach in two steps)
    state_file = first.run_dir / "generators" / "gen-0.json"
    state = json.loads(state_file.read_text())
    assert state["data"]["index"] > 0 and state["group_counter"] > 0
    state["data"]["epoch"] = 5
    state_file.write_text(json.dumps(state))
    # run.steps is the total: the checkpoint is at 4, so the re-run trains steps 5 and 6 only
    again = run_pipeline(
        _cfg(tmp_path, "run.steps=6", "run.timeout_s=60", "trainer.fetch_timeout_s=60"), stop_ray=False
    )
    assert again.status == "completed", again.error
    assert [h["version"] for h in again.history if "version" in h] == [5, 6]
    # one series in metrics.jsonl: one line per step 1..6, and the resume marked where it happened
    rows = [json.loads(line) for line in (again.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "version" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r.get("event") == "resume"] == [4]
    assert json.loads(state_file.read_text())["data"]["epoch"] >= 5
    assert again.history[-1]["generator/data_epoch"] >= 5


# dp=2 in the pipeline is also run by test_healing's 2-rank trainer kill; slow-marked for the suite's time
@pytest.mark.parametrize("layout", [pytest.param("trainer.dp=2", marks=pytest.mark.slow), "trainer.tp=2"])
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
