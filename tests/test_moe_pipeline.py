"""The whole pipeline on the tiny MoE model (configs/tiny-moe-cpu.yaml): torch engine, buffer, megatron
MoE trainer, weight pushes into the engine's fused experts; in sync mode the engine's logprobs equal the
trainer's on tokens of the pushed weights."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.orchestration.launcher import run_pipeline


@pytest.mark.slow  # ~19 s with Ray's start
@pytest.mark.parametrize("replay", [False, True], ids=["own-routing", "routing-replay"])
def test_tiny_moe_pipeline_sync(tmp_path, ray_session, replay):
    """With trainer.routing_replay the engine's recorded experts go through the buffer to the trainer,
    which replays every recorded position (routing/replayed counts them) and still equals the engine."""
    cfg = load_config(
        "configs/tiny-moe-cpu.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=4",
            "run.mode=sync",
            "run.timeout_s=180",
            "metrics.progress=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            f"trainer.routing_replay={str(replay).lower()}",
        ],
    )
    res = run_pipeline(cfg, stop_ray=False)
    assert res.status == "completed", res.error
    train = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "version" in r]
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    fresh = {
        r["version"]: r["logp/abs_diff_same_version"] for r in train if r["logp/same_version_tokens"] > 0
    }
    assert len(fresh) >= 3 and max(r["generator/engine_version_min"] for r in train) >= 2  # pushes landed
    assert all(d <= 1e-4 for d in fresh.values()), f"engine logprobs differ from the trainer's: {fresh}"
    if replay:  # every trained sample carried its recording: positions x MoE layers, all replayed
        assert all(r["routing/replayed"] > 0 for r in train)
        assert all(r["routing/agreement"] > 0.9 for r in train)  # sync, fp32: the same routing
    else:
        assert not any("routing/replayed" in r for r in train)
