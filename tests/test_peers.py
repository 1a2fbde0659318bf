"""bench/peers (issue #43): the JSONL -> verl parquet converter, the verl reward wrapper, the parsers of
verl's console and file-logger output and of slipstream's metrics, the figures and ratio row, and the
commands the driver would run. No verl, SGLang or GPU needed: the verl formats come from
bench/peers/samples/, written by verl 0.9.1's own logging code with synthetic values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.peers import summary
from bench.peers.jobs import JOBS, parse_mode, slipstream_overrides, verl_gpus, verl_overrides
from bench.peers.to_parquet import convert, verl_row
from stages.reward.builtin import math_answer

SAMPLES = Path(__file__).resolve().parent.parent / "bench" / "peers" / "samples"
DATA = Path(__file__).resolve().parent.parent / "bench" / "data" / "basic_arithmetic.jsonl"


def test_verl_row_keeps_messages_and_label():
    ex = json.loads(DATA.read_text().splitlines()[0])
    row = verl_row(ex, 7, "train")
    assert row["prompt"] == ex["prompt"]
    assert row["reward_model"] == {"style": "rule", "ground_truth": ex["label"]}
    assert row["data_source"] == "basic_arithmetic" and row["extra_info"] == {"split": "train", "index": 7}
    # a plain-text prompt becomes one user message; a row without label or messages is refused
    assert verl_row({"prompt": "2+2?", "label": 4}, 0, "val")["prompt"] == [
        {"role": "user", "content": "2+2?"}
    ]
    with pytest.raises(ValueError, match="label"):
        verl_row({"prompt": "2+2?"}, 3, "train")
    with pytest.raises(ValueError, match="chat messages"):
        verl_row({"prompt": [{"text": "x"}], "label": "1"}, 4, "train")


def test_convert_writes_train_and_val_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "few.jsonl"
    src.write_text("".join(DATA.read_text().splitlines(keepends=True)[:20]))
    out = convert(src, tmp_path / "data", val=5)
    assert out["rows"] == 20 and out["val_rows"] == 5
    train = pq.read_table(out["train"]).to_pylist()
    val = pq.read_table(out["val"]).to_pylist()
    assert len(train) == 20 and len(val) == 5
    first = json.loads(src.read_text().splitlines()[0])
    assert (
        train[0]["prompt"] == first["prompt"] and train[0]["reward_model"]["ground_truth"] == first["label"]
    )
    assert val[0]["extra_info"] == {"split": "val", "index": 0}
    assert set(train[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}


def test_verl_reward_is_slipstreams_math_reward():
    from types import SimpleNamespace

    from bench.peers.verl_reward import compute_score

    cases = [("<answer>-25</answer>", "-25"), ("so \\boxed{3/4}", "0.75"), ("I think 12", "13"), ("", "1")]
    for response, truth in cases:
        want = math_answer(SimpleNamespace(label=truth), response)
        got = compute_score(
            data_source="basic_arithmetic", solution_str=response, ground_truth=truth, extra_info={}
        )
        assert got == want
    assert compute_score(solution_str="<answer>-25</answer>", ground_truth="-25") == 1.0


def test_parse_value_reads_pformat_output():
    assert summary.parse_value("np.float64(0.25)") == 0.25
    assert summary.parse_value("np.int64(3)") == 3.0
    assert summary.parse_value("1e-05") == 1e-05
    assert summary.parse_value("True") == 1.0
    assert summary.parse_value("nan") is None and summary.parse_value("'text'") is None


def test_console_sample_parses_steps_times_and_values():
    recs = summary.verl_console_records((SAMPLES / "verl_console.log").read_text())
    assert [s for s, _, _ in recs] == [1, 2, 3, 4, 5]  # Ray, SGLang and tqdm lines skipped
    step, m, t = recs[0]
    assert m["critic/score/mean"] == 0.03125 and m["timing_s/step"] == 21.5
    assert m["actor/lr"] == 1e-05 and m["perf/total_num_tokens"] == 19328
    assert t == pytest.approx(1795830021.5)


def test_verl_steps_take_metrics_from_file_and_times_from_console():
    steps = summary.verl_steps(
        (SAMPLES / "verl_metrics.jsonl").read_text(),
        (SAMPLES / "verl_console.log").read_text(),
        samples_per_step=128,
    )
    assert [s.step for s in steps] == [1, 2, 3, 4, 5]
    assert steps[1].reward == 0.046875 and steps[1].samples == 128
    assert steps[1].gen_tokens == pytest.approx(98.5 * 128)  # response_length/mean x samples
    assert steps[4].t - steps[3].t == pytest.approx(5.875)
    # the console alone gives the same steps
    alone = summary.verl_steps("", (SAMPLES / "verl_console.log").read_text(), samples_per_step=128)
    assert [(s.step, s.reward, s.t) for s in alone] == [(s.step, s.reward, s.t) for s in steps]


def test_verl_steps_without_console_times_sum_durations():
    steps = summary.verl_steps((SAMPLES / "verl_metrics.jsonl").read_text(), "", samples_per_step=128)
    assert [s.t for s in steps] == pytest.approx([21.5, 27.75, 33.75, 39.875, 45.75])
    out = summary.summarise(steps, gpus=2, threshold=0.05, window=2, equal_samples=640, launch_t=1795829000.0)
    assert out["startup_s"] is None  # relative times: no start-up to report
    # steps 4-5 (256 samples) over the end of step 3 -> the end of step 5 (12 s)
    assert out["samples_per_s"] == pytest.approx(256 / 12.0, rel=1e-3)


def _steps(rewards, *, dt=2.0, t0=1795830000.0, samples=128, tokens=100.0):
    return [
        summary.Step(
            step=i + 1,
            samples=samples,
            gen_tokens=tokens * samples,
            reward=r,
            t=t0 + dt * (i + 1),
            duration=dt,
        )
        for i, r in enumerate(rewards)
    ]


def test_summarise_steady_rates_crossing_and_final_reward():
    rewards = [0.0, 0.0, 0.1, 0.1, 0.3, 0.3, 0.3, 0.2]
    out = summary.summarise(
        _steps(rewards), gpus=2, threshold=0.2, window=3, equal_samples=6 * 128, launch_t=1795829900.0
    )
    # steady = steps 3..8: 5 steps of 128 samples in 10 s, on 2 GPUs
    assert out["samples_per_s"] == pytest.approx(64.0) and out["samples_per_s_per_gpu"] == pytest.approx(32.0)
    assert out["gen_tokens_per_s_per_gpu"] == pytest.approx(3200.0)
    assert out["s_per_step"] == pytest.approx(2.0)
    # trailing 3-step means: -, -, .033, .067, .167, .233 -> first crossing at step 6
    assert out["step_to_reward"] == 6 and out["samples_to_reward"] == 6 * 128
    assert out["time_to_reward_s"] == pytest.approx(10.0)  # end of step 1 -> end of step 6
    assert out["time_to_reward_from_launch_s"] == pytest.approx(112.0)
    assert out["startup_s"] == pytest.approx(100.0)  # launch -> start of step 1
    # the first 768 samples are steps 1-6; the last 3 of them: 0.1, 0.3, 0.3 (figures are rounded to 4 places)
    assert out["final_reward"] == pytest.approx((0.1 + 0.3 + 0.3) / 3, abs=1e-4)
    assert out["reward_ma_max"] == pytest.approx(0.3)


def test_summarise_no_crossing_short_run_and_too_few_steps():
    out = summary.summarise(_steps([0.0] * 5), gpus=2, threshold=0.5, window=2, equal_samples=10 * 128)
    assert out["step_to_reward"] is None and out["time_to_reward_s"] is None
    assert out["final_reward"] is None  # the run stopped short of the equal sample count
    with pytest.raises(ValueError, match="steady state"):
        summary.summarise(_steps([0.0] * 3), gpus=2, threshold=0.5, window=2, equal_samples=128)


def test_slipstream_steps_from_metrics_rows():
    rows = [
        {"step": 2, "time": 1795830010.0, "reward/mean": 0.5, "samples": 128, "tokens/trained": 9000.0},
        {"event": "resume", "step": 1, "time": 1.0},
        {"step": 1, "time": 1795830008.0, "reward/mean": 0.25, "samples": 128, "tokens/trained": 8000.0},
    ]
    steps = summary.slipstream_steps("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    assert [(s.step, s.reward, s.gen_tokens, s.t) for s in steps] == [
        (1, 0.25, 8000.0, 1795830008.0),
        (2, 0.5, 9000.0, 1795830010.0),
    ]


def test_ratio_row_takes_each_frameworks_best_mode():
    rows = [
        {"framework": "verl", "mode": "sync", "samples_per_s": 40.0, "time_to_reward_s": 300.0},
        {"framework": "verl", "mode": "separate_async", "samples_per_s": 50.0, "time_to_reward_s": None},
        {"framework": "slipstream", "mode": "async", "samples_per_s": 100.0, "time_to_reward_s": 150.0},
        {"framework": "slipstream", "mode": "sync", "samples_per_s": 30.0, "time_to_reward_s": 400.0},
    ]
    r = summary.ratio_row(rows, peer="verl")
    assert r["peer"] == "verl" and r["samples_per_s_ratio"] == 2.0 and r["time_to_reward_ratio"] == 0.5
    assert r["samples_per_s_modes"] == ["async", "separate_async"] and r["time_to_reward_modes"] == [
        "async",
        "sync",
    ]
    none = summary.ratio_row(rows[2:], peer="verl")
    assert none["samples_per_s_ratio"] is None and none["time_to_reward_ratio"] is None


def _kv(args: list[str]) -> dict:
    return dict(a.lstrip("+").split("=", 1) for a in args)


def test_verl_and_slipstream_get_the_same_job():
    job = JOBS["learn"]
    kw = dict(model="/m", train="/d/train.parquet", val="/d/val.parquet", name="n", ckpt_dir="/c")
    v = _kv(verl_overrides(job, "sync", **kw))
    cfg, s = slipstream_overrides(job, "async", model="/m")
    s = _kv(s)
    assert cfg == "configs/gpu-2x-disaggregated.yaml"
    assert v["actor_rollout_ref.model.path"] == s["model.name"] == "/m"
    assert int(v["actor_rollout_ref.rollout.n"]) == int(s["rollout.group_size"]) == 8
    assert (
        int(v["data.train_batch_size"])
        == int(s["trainer.batch_groups"])
        == int(v["actor_rollout_ref.actor.ppo_mini_batch_size"])
    )
    assert int(v["data.max_response_length"]) == int(s["rollout.sampling.max_new_tokens"]) == 128
    assert float(v["actor_rollout_ref.actor.optim.lr"]) == float(s["trainer.lr"]) == 1e-5
    assert int(v["trainer.total_training_steps"]) == int(s["run.steps"]) == 100
    assert v["reward.custom_reward_function.path"].endswith("bench/peers/verl_reward.py")
    assert v["trainer.n_gpus_per_node"] == "2" and verl_gpus("sync") == {"trainer": 2, "rollout": 0}


def test_verl_separate_async_splits_the_gpus_and_syncs_every_batch():
    job = JOBS["speed"]
    v = _kv(verl_overrides(job, "separate_async", model="/m", train="t", val="v", name="n", ckpt_dir="c"))
    assert v["trainer.n_gpus_per_node"] == "1" and v["actor_rollout_ref.rollout.n_gpus_per_node"] == "1"
    # verl's V1 invariant: train_batch_size = parameter_sync_step x ppo_mini_batch_size
    assert int(v["data.train_batch_size"]) == int(v["trainer.v1.separate_async.parameter_sync_step"]) * int(
        v["actor_rollout_ref.actor.ppo_mini_batch_size"]
    )
    assert v["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    assert v["trainer.v1.sampler.max_off_policy_threshold"] == str(job.staleness)
    assert v["data.max_response_length"] == "512"
    with pytest.raises(ValueError, match="unknown mode"):
        parse_mode("verl:fully_async")
    assert parse_mode("slipstream:sync") == ("slipstream", "sync")


def test_driver_dry_run_prints_each_command(tmp_path, capsys, monkeypatch):
    from bench.peers import driver

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    driver.main(
        ["--job", "learn", "--model", str(model), "--out", str(tmp_path / "out"), "--dry-run", "--steps", "7"]
    )
    text = capsys.readouterr().out
    assert text.count("verl.trainer.main_ppo") == 2 and "gpu_pipeline.sh" in text
    assert "trainer.total_training_steps=7" in text and "run.steps=7" in text
    assert (tmp_path / "out" / "data" / "train.parquet").exists()
    env = driver.with_path({"PYTHONPATH": "/tmp/site:/tmp/peer-tf"}, ["/a", "/b"], drop=["/tmp/peer-tf"])
    assert env["PYTHONPATH"] == "/a:/b:/tmp/site"


def test_end_leftovers_ends_only_the_runs_tagged_processes(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from bench.peers.driver import _alive, end_leftovers

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    # in a session of its own, as Ray's head processes are: outside the run's process group
    tagged = subprocess.Popen(sleep, env=os.environ | {"PEERS_RUN": "t-run"}, start_new_session=True)
    other = subprocess.Popen(sleep, env=os.environ | {"PEERS_RUN": "t-other"}, start_new_session=True)
    try:
        for _ in range(50):  # the environment is readable once the child has exec'd
            if b"PEERS_RUN=t-run" in Path(f"/proc/{tagged.pid}/environ").read_bytes():
                break
            time.sleep(0.05)
        assert end_leftovers("t-run") == [tagged.pid]
        tagged.wait(timeout=10)
        assert _alive(other.pid)
    finally:
        for p in (tagged, other):
            p.kill()
            p.wait()


def test_run_logged_stamps_verls_lines_and_the_row_reads_them(tmp_path):
    import dataclasses
    import sys
    import time

    from bench.peers import driver

    code = (
        "import time\n"
        "print('ray init kwargs: {}', flush=True)\n"
        "for i in range(1, 6):\n"
        "    time.sleep(0.05)\n"
        "    print(f'(TaskRunner pid=1) step:{i} - critic/score/mean:np.float64(0.{i}) - '\n"
        "          f'response_length/mean:np.float64(50.0) - timing_s/step:0.05', flush=True)\n"
    )
    log = tmp_path / "run" / "console.log"
    launch = time.time()
    rc = driver.run_logged(
        [sys.executable, "-c", code], env=dict(os.environ), cwd=tmp_path, log=log, timeout_s=30
    )
    assert rc == 0 and all(
        line.split(" ", 1)[0].replace(".", "").isdigit() for line in log.read_text().splitlines()
    )
    run = driver.Run("verl", "sync", "t", [], {}, tmp_path, log, tmp_path / "run" / "metrics.jsonl")
    job = dataclasses.replace(JOBS["learn"], steps=5, reward_threshold=0.3, reward_window=2)
    row = driver.summarise_run(run, job, launch_t=launch, rc=rc)
    assert row["steps"] == 5 and row["samples_per_s"] > 0 and row["startup_s"] is not None
    assert row["step_to_reward"] == 4  # trailing 2-step means: -, .15, .25, .35
    assert row["gen_tokens_per_s_per_gpu"] == pytest.approx(row["samples_per_s_per_gpu"] * 50.0, rel=1e-3)
    # a command past its time limit is ended, and what it printed is kept
    rc = driver.run_logged(
        [sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"],
        env=dict(os.environ),
        cwd=tmp_path,
        log=tmp_path / "slow.log",
        timeout_s=1,
    )
    assert rc != 0 and "time limit" in (tmp_path / "slow.log").read_text()
