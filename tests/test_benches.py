"""The buffer benches run end to end and report what bench/RESULTS.md quotes (tiny volumes: these
check that the benches work, not how fast anything is)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench(*args: str, timeout: float = 240) -> dict:
    p = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / args[0]), *args[1:], *(["--timeout-s", str(timeout)])],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its servers, sinks and producers share its process group
    )
    try:
        out, err = p.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the group this test started, by id
        out, err = p.communicate()
        pytest.fail(f"{args[0]} did not finish within {timeout + 30}s:\n{err[-3000:]}")
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [[], ["--steady"]], ids=["plain", "steady"])
def test_buffer_ingest_reports_every_goal(extra):
    r = _bench(
        "buffer_ingest.py", "--total-mb", "6", "--msg-mb", "1", "--runs", "1", "--tokens", "2048", *extra
    )
    for key in (
        "memory_vs_raw_zmq",
        "durable_vs_disk",
        "vs_pickle",
        "raw_zmq_disk_vs_disk",
        "durable_vs_raw_zmq_disk",
    ):
        assert r[key] > 0, key
    assert ("memory_steady_vs_raw_zmq" in r) == bool(extra)
    rates = r["by_tokens"]["2048"]
    assert all(
        rates[f"{v}_GB_s"] > 0 for v in ("memory", "raw_zmq", "raw_zmq_keep", "durable", "disk", "pickle")
    )


def test_buffer_ingest_with_several_producers():
    r = _bench(
        "buffer_ingest.py",
        "--total-mb",
        "6",
        "--msg-mb",
        "1",
        "--runs",
        "1",
        "--tokens",
        "512",
        "--producers",
        "2",
        "--steady",
    )
    assert r["producers"] == 2
    for key in ("memory_vs_raw_zmq", "memory_steady_vs_raw_zmq", "durable_vs_disk"):
        assert r[key] > 0, key
    assert "vs_pickle" not in r  # the pickle baseline is single-producer only


def test_ingest_threads_reports_server_and_client_threads():
    r = _bench("ingest_threads.py", "--mb", "48", "--runs", "1", "--prebuilt")
    (run,) = r["runs"]
    assert run["wall_ms"] > 0 and run["GB_s"] > 0
    # 48 MB take tens of ms of CPU on both ends (the counters tick every 10 ms)
    assert sum(run["server"].values()) + sum(run["client"].values()) >= 10, run
    assert r["cores"] >= 1


def test_trainer_gpu_moe_shape_counts_and_folder(tmp_path, monkeypatch):
    """bench/trainer_gpu.py's moe-small: total and active parameter counts match the HF model (built on
    the meta device), the dense shapes' counts are unchanged, and build_model writes a Qwen3-MoE folder
    (per-expert bf16 tensors, a random router) that transformers loads; a tiny variant, on the CPU."""
    import torch
    from safetensors import safe_open
    from transformers import (
        AutoModelForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from bench import trainer_gpu as tg

    c = tg.SHAPES["moe-small"]
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen3MoeForCausalLM(Qwen3MoeConfig(**c)).parameters())
    idle = c["num_hidden_layers"] * (c["num_experts"] - c["num_experts_per_tok"])
    assert tg.param_count("moe-small") == total == 1_956_566_016
    assert tg.param_count("moe-small", active=True) == total - idle * 3 * 2048 * 1024 == 1_050_596_352
    for shape in ("0.5b", "7b"):
        with torch.device("meta"):
            n = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**tg.SHAPES[shape])).parameters())
        assert tg.param_count(shape) == tg.param_count(shape, active=True) == n

    tiny = dict(c, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    tiny.update(
        head_dim=16, moe_intermediate_size=32, intermediate_size=96, vocab_size=512, mlp_only_layers=[0]
    )
    monkeypatch.setitem(tg.SHAPES, "moe-tiny", tiny)
    path = tg.build_model("moe-tiny", str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3_moe" and model.config.architectures == ["Qwen3MoeForCausalLM"]
    assert sum(p.numel() for p in model.parameters()) == tg.param_count("moe-tiny")
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
        assert float(f.get_tensor("model.layers.1.mlp.gate.weight").float().std()) > 0.01
    assert "model.layers.1.mlp.experts.15.up_proj.weight" in keys  # the format SGLang reads
    assert "model.layers.0.mlp.down_proj.weight" in keys  # mlp_only_layers: a dense MLP


def test_async_vs_sync_takes_the_engines_idle_share_over_the_steady_window_only(monkeypatch):
    """`generator/idle_share` counts from the engines' start, start-up included (the figure that made a
    busy engine look 62 % idle); the bench takes the window's share from the cumulative seconds, and
    falls back to that figure only for rows without them or when they went back (a healed generator)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_async_vs_sync as avs

    rows = []
    for i in range(6):  # 100 s of start-up, all idle, then steps of 10 s at 90 % busy
        busy, idle = 9.0 * i, 100.0 + 1.0 * i
        rows.append(
            {
                "reward/mean": 0.5,
                "time": 1000.0 + 10 * i,
                "samples": 128,
                "generator/tokens": 5000 * i,
                "time/data_wait_s": 1.0,
                "generator/idle_share": idle / (busy + idle),
                "generator/engine_busy_s": busy,
                "generator/engine_idle_s": idle,
            }
        )
    out = avs.steady(rows, skip=1)
    assert out["engine_idle_share"] == pytest.approx(0.1)
    assert out["s_per_step"] == pytest.approx(10.0) and out["rollout_tokens_per_s"] == pytest.approx(500.0)
    assert rows[-1]["generator/idle_share"] == pytest.approx(0.7)  # what the cumulative figure says
    legacy = [{k: v for k, v in r.items() if not k.startswith("generator/engine_")} for r in rows]
    assert avs.steady(legacy, skip=1)["engine_idle_share"] == pytest.approx(
        sum(r["generator/idle_share"] for r in rows[2:]) / 4, abs=1e-4
    )
    healed = [dict(r) for r in rows]
    healed[-1]["generator/engine_busy_s"] = 1.0  # a new incarnation counts afresh
    assert avs.window_idle_share(healed[1:]) is None


def test_the_generator_only_baseline_runs_the_generator_of_the_run_without_a_trainer(monkeypatch, tmp_path):
    """bench/gpu_async_vs_sync.py's second ceiling (the run's engine and client, no trainer) on the CPU
    default: the torch engine stands in for SGLang; the GPU run uses the same code on the run's server."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_async_vs_sync as avs

    overrides = [
        f"model.cache_dir={tmp_path / 'models'}",
        "rollout.sampling.max_new_tokens=8",
        "rollout.group_size=4",
        "rollout.max_inflight_groups=4",
    ]
    out = avs.generator_throughput("configs/default.yaml", overrides, 6, tmp_path / "gen.log")
    assert out["groups"] == 6 and out["tokens"] > 0 and out["tokens_per_s"] > 0
    assert (tmp_path / "gen.log").exists()


def _learning_runs(
    folder: Path,
    seed: int,
    lr: float,
    bound: int | None = None,
    variants=("sync", "async_tis", "async_no_tis"),
) -> None:
    """The variants' metrics files of one seed, as bench/gpu_learning.py writes them (`bound`: the async
    runs' recorded staleness bound; None: runs from before it was recorded)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in variants:
        push = {} if name == "sync" else {"push/prev_seconds": 0.05}  # one a second: a 5 % stall
        if bound is not None and name != "sync":
            push["bench/staleness_bound"] = bound
        rows = [
            {"reward/mean": 0.1 * i / 20, "samples": 128, "logp/abs_diff_train_rollout": 0.03,
             "staleness/mean": 0.0, "time": float(i), "lr": lr, **push}
            for i in range(20)
        ]  # fmt: skip
        (folder / f"{name}-seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_learning_summary_refuses_seeds_of_another_comparison_and_overrides_taken_for_folders(tmp_path):
    """A device session put its overrides after --prior, which took them for folders: its seeds trained
    at the config's learning rate, and a summary counted them with a seed at another. Both are refused
    now, by name, and so are async runs at another staleness bound; runs of one comparison are
    summarised (here, without running anything)."""

    def summary(*args: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            str(REPO / "bench" / "gpu_learning.py"),
            "--config",
            "configs/gpu-1x-colocated.yaml",
        ]
        return subprocess.run(
            [*cmd, "--steps", "20", "--tail", "5", "--seeds", "--out", str(tmp_path / "out"), *args],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    _learning_runs(tmp_path / "a", seed=0, lr=1e-5)
    _learning_runs(tmp_path / "b", seed=1, lr=2e-6)
    mixed = summary("--prior", str(tmp_path / "a"), str(tmp_path / "b"))
    assert mixed.returncode != 0 and "different learning rates" in mixed.stderr
    swallowed = summary("--prior", str(tmp_path / "a"), "trainer.lr=1.0e-5")
    assert swallowed.returncode != 0 and "--prior trainer.lr=1.0e-5: no such folder" in swallowed.stderr
    _learning_runs(tmp_path / "c", seed=2, lr=1e-5, bound=8)  # more lag: another comparison
    other_bound = summary("--prior", str(tmp_path / "a"), str(tmp_path / "c"))
    assert other_bound.returncode != 0 and "other staleness bounds than --staleness 4" in other_bound.stderr
    assert summary("--staleness", "8", "--prior", str(tmp_path / "c")).returncode == 0
    _learning_runs(tmp_path / "b", seed=1, lr=1e-5)
    one_rate = summary("--prior", str(tmp_path / "a"), str(tmp_path / "b"))
    assert one_rate.returncode == 0, one_rate.stderr[-2000:]
    line = json.loads(one_rate.stdout.strip().splitlines()[-1])
    assert line["seeds"] == [0, 1] and line["runs"]["sync"][0]["lr"] == 1e-5
    # the push stall the issue bounds at 5 % in every config, which the learning runs are the colocated one of
    assert line["stall_share"] == {"sync": None, "async_tis": 0.05, "async_no_tis": 0.05}
    assert line["mean_reward"]["sync"] == pytest.approx(0.1 * 9.5 / 20, abs=1e-4)  # rewards 0 .. 0.095
    # a study at another bound runs only the async variants and counts an earlier study's sync runs
    _learning_runs(tmp_path / "s8", seed=0, lr=1e-5, bound=8, variants=("async_tis", "async_no_tis"))
    no_sync = summary("--staleness", "8", "--prior", str(tmp_path / "s8"))
    assert no_sync.returncode != 0 and "no complete seed" in no_sync.stderr
    assert "seed 0 left out: no sync run" in no_sync.stderr
    s8 = summary("--staleness", "8", "--prior", str(tmp_path / "s8"), "--prior-sync", str(tmp_path / "a"))
    assert s8.returncode == 0, s8.stderr[-2000:]
    prior = json.loads(s8.stdout.strip().splitlines()[-1])["prior"]
    assert prior == {
        "async_no_tis-seed0": str(tmp_path / "s8"),
        "async_tis-seed0": str(tmp_path / "s8"),
        "sync-seed0": str(tmp_path / "a"),  # its async runs (bound 4) are not taken
    }
    twice = summary("--prior", str(tmp_path / "a"), "--prior-sync", str(tmp_path / "a"))
    assert twice.returncode != 0 and "sync seed 0 is in both" in twice.stderr
    # a seed to run whose sync run is nowhere: refused before any run starts
    lacking = summary(
        "--seeds", "3", "--variants", "async_tis", "async_no_tis", "--prior-sync", str(tmp_path / "a")
    )
    assert lacking.returncode != 0 and "seed 3: no sync run" in lacking.stderr


def test_the_learning_bench_bounds_only_the_async_runs_at_its_staleness(tmp_path, monkeypatch):
    """`--staleness 8` (more lag for the correction to undo) reaches both async runs, after the user's
    overrides so that nothing there wins, and leaves the sync run alone."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_learning

    calls: list[list[str]] = []
    # no rows: the run itself is not what this checks
    monkeypatch.setattr(gpu_learning, "run", lambda overrides, config: (calls.append(overrides) or [], None))
    bounds = {}
    for name in gpu_learning.VARIANTS:
        gpu_learning.one_run("configs/default.yaml", ["run.max_staleness=2"], tmp_path, name, 0, 8)
        bounds[name] = [o for o in calls[-1] if o.startswith("run.max_staleness=")][-1]
    assert bounds == {
        "sync": "run.max_staleness=2",  # the user's: sync never lags, whatever the bound
        "async_tis": "run.max_staleness=8",
        "async_no_tis": "run.max_staleness=8",
    }


def test_the_gc_bench_reads_sglangs_own_log_lines():
    """bench/sglang_gc.py judges the GC by SGLang's log: its freeze lines (SGLang 0.5.17's format, from
    its source: no run has logged one yet) and its long-collection warnings (the first two lines are
    session 6's server log as written; the third, a generation-1 collection, is made up)."""
    sys.path.insert(0, str(REPO / "bench"))
    from sglang_gc import read_log

    log = "\n".join(
        [
            "[2026-11-27 01:01:05] Freezing GC in Tokenizer Manager process. gen0: 312->0, gen1: 40->0, "
            "gen2: 801234->0",
            "[2026-11-27 01:01:05] Freezing GC in Scheduler process. gen0: 10->0, gen1: 2->0, gen2: 654321->0",
            "[2026-11-27 01:01:11] LONG GARBAGE COLLECTION DETECTED | Generation 2 | Duration: 0.5594s | "
            "# Objects: gen0=3, gen1=0, gen2=862714 | This may cause latency jitter. Consider calling the "
            "freeze_gc API after sending a few warmup requests.",
            "[2026-11-27 01:01:25] LONG GARBAGE COLLECTION DETECTED | Generation 2 | Duration: 0.4952s | "
            "# Objects: gen0=3, gen1=0, gen2=861344 | This may cause latency jitter. Consider calling the "
            "freeze_gc API after sending a few warmup requests.",
            "[2026-11-27 01:01:26] LONG GARBAGE COLLECTION DETECTED | Generation 1 | Duration: 0.0612s | "
            "# Objects: gen0=0, gen1=0, gen2=12000 | This may cause latency jitter.",
        ]
    )
    got = read_log(log)
    assert got["frozen"] == {
        "Tokenizer Manager": {"gen2_before": 801234, "gen2_after": 0},
        "Scheduler": {"gen2_before": 654321, "gen2_after": 0},
    }
    assert (got["long_collections"], got["full_collections"]) == (3, 2)
    assert got["full_collection_s_max"] == 0.5594 and got["gen2_objects_max"] == 862714
    assert read_log("")["full_collection_s_max"] is None


def test_the_offload_summary_takes_the_handover_share_of_the_steps_wall_time():
    sys.path.insert(0, str(REPO / "bench"))
    from offload_summary import kv_cache_tokens, summarise

    rows = []
    for step in range(1, 7):  # a step every 10 s, after two start-up steps of 60 s
        rows.append(
            {
                "step": step,
                "time": 60.0 * min(step, 2) + 10.0 * max(step - 2, 0),
                "time/data_wait_s": 6.0,
                "time/train_s": 3.0,
                "offload/train_s": 0.2,
                "offload/rollout_s": 0.1,
                "onload/train_s": 0.3,
                "onload/rollout_s": 0.1,
                "push/snapshot_s": 0.05,
                "push/wait_s": 0.25,
                "memory/train_gb/train": 70.0,
                "memory/train_gb/generate": 2.0,
            }
        )
    out = summarise(rows, skip=2)
    assert out["step_s"] == 10.0 and out["handover_s"] == 1.0 and out["handover_share"] == 0.1
    assert out["generate_s"] == 6.0 and out["memory_train_gb_generate"] == 2.0
    log = "[2026] KV Cache is allocated. #tokens: 1234567, K size: 30 GB\n[2026] max_total_num_tokens=1234567"
    assert kv_cache_tokens(log) == 1234567 and kv_cache_tokens("no such line") is None
    with pytest.raises(ValueError, match="need more than"):
        summarise(rows[:2], skip=2)


def test_the_push_profile_splits_each_loads_time_by_function_and_op(tmp_path):
    """bench/sglang_profile.py reads SGLang's torch-profiler trace (Chrome trace events): the loads are
    the outermost update_weights_from_distributed calls on their thread, and their time is split into self
    time (not inside a nested event) and inclusive time per function or op, with call counts. Other
    threads' events and events outside a load are not counted."""
    import gzip

    sys.path.insert(0, str(REPO / "bench"))
    from sglang_profile import summarise

    def ev(name, ts, dur, cat="python_function", tid=1):
        return {"ph": "X", "name": name, "ts": ts * 1000, "dur": dur * 1000, "cat": cat, "pid": 7, "tid": tid}

    root = "sglang/srt/model_executor/weight_updater.py(222): update_weights_from_distributed"
    events = [
        ev("scheduler.py(10): wrapper", 0, 400),  # the call that holds the loads: not counted
        ev(root, 0, 100),
        ev("sglang/srt/models/qwen3_moe.py(1102): load_weights", 10, 80),
        ev("fused_moe_triton/layer.py(899): weight_loader", 20, 10),
        ev("aten::copy_", 25, 3, cat="cpu_op"),
        ev("fused_moe_triton/layer.py(899): weight_loader", 40, 10),
        ev(root, 200, 50),
        ev("sglang/srt/models/qwen3_moe.py(1102): load_weights", 205, 40),
        ev("aten::copy_", 150, 20, cat="cpu_op"),  # between the loads
        ev("aten::copy_", 20, 30, cat="cpu_op", tid=2),  # another thread
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarise(path)
    assert s["loads"] == 2 and s["total_ms"] == 150  # the events above in ms (the trace's are in us)
    self_ms = {n: (ms, calls) for n, ms, calls in s["by_self_ms"]}
    assert self_ms["qwen3_moe.py(1102): load_weights"] == (100, 2)  # 80 - 20 + 40
    assert self_ms["layer.py(899): weight_loader"] == (17, 2)  # 10 - 3 + 10
    assert self_ms["aten::copy_"] == (3, 1)
    incl = {n: ms for n, ms, _ in s["by_inclusive_ms"]}
    assert incl["qwen3_moe.py(1102): load_weights"] == 120 and incl["layer.py(899): weight_loader"] == 20
    assert summarise(path, root="nothing_like_it")["error"].startswith("no call named")
