"""configs/agent-calc-cpu.yaml through the whole pipeline (Ray, buffer, megatron trainer): the agent,
written only against the `openai` client, trains through the generator's endpoint, and every episode
in the buffer is token-exact (each model turn's tokens are the engine's, checked against the checksums
recorded as the engine answered)."""

from __future__ import annotations

import pytest

from buffer.record import Status, batch_to_samples
from pipeline.config import REPO_ROOT, load_config
from pipeline.inspect import load
from pipeline.orchestration.launcher import run_pipeline
from stages.rollout.agent_session import turn_mismatches

CONFIG = REPO_ROOT / "configs" / "agent-calc-cpu.yaml"


def _run(tmp_path, *extra):
    cfg = load_config(
        CONFIG,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.timeout_s=300",
            "metrics.progress=false",
            "trainer.batch_groups=2",
            "rollout.group_size=4",
            *extra,
        ],
    )
    res = run_pipeline(cfg, stop_ray=False)
    assert res.status == "completed", res.error
    return res, batch_to_samples(load(str(res.run_dir / "buffer"))[0])


def test_the_agent_config_runs_end_to_end_token_exact(tmp_path, ray_session):
    """With tiny-qwen2 (built by the default suite anyway; it answers without the tool) so that the
    default suite need not build tiny-qwen2-calc: the endpoint, the sessions and the sample format."""
    res, samples = _run(tmp_path, "run.steps=3", "model.name=tiny-qwen2")
    train = [h for h in res.history if "version" in h]
    assert [h["version"] for h in train] == [1, 2, 3]
    assert samples and all(s.metadata["agent"]["session"].startswith(s.group_id) for s in samples)
    assert sum(turn_mismatches(s) for s in samples) == 0
    assert all(s.status != Status.FAILED for s in samples), [s.error for s in samples if s.error][:1]
    assert all(s.metadata["rewarded_by"] == "reward_fn" for s in samples)


@pytest.mark.slow
def test_the_calculator_agent_calls_the_tool_and_trains(tmp_path, ray_session):
    """The shipped config as it is (builds tiny-qwen2-calc, ~1 min once per model cache)."""
    res, samples = _run(tmp_path, "run.steps=6")
    assert len([h for h in res.history if "version" in h]) == 6
    assert sum(turn_mismatches(s) for s in samples) == 0
    called = [s for s in samples if s.metadata["model_turns"] >= 2]
    assert called, "no episode called the tool"
    for s in called[:20]:  # the tool result's tokens are in the response, masked out
        mask = s.array("loss_mask")
        assert 0 < mask.sum() < len(mask) and s.metadata["agent"]["segments"] == 1
