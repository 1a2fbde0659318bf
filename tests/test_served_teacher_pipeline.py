"""A served distillation teacher through the whole pipeline (trainer.distill.server, issue #41): the Ray
generators ask the teacher server, the samples carry its logprobs through the buffer's ZeroMQ wire and
Arrow segments, and the trainer's KL is taken against them. The server is tests/test_served_teacher.py's
stub (SGLang's scoring answers, from a transformers model on the CPU), serving the run's own model."""

from __future__ import annotations

import json

import pytest

from tests.test_served_teacher import serve_teacher  # noqa: F401 - the fixture


@pytest.mark.slow
def test_a_run_distils_from_a_served_teacher(tmp_path, ray_session, serve_teacher):  # noqa: F811
    """The teacher is the initial policy: step 1's samples (version 0) are the teacher's own, so the KL
    to it is ~0 there, and it grows as the policy moves away under the task reward."""
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import run_pipeline
    from stages.models import resolve_model

    base = [f"run.dir={tmp_path / 'run'}", "run.timeout_s=180", "metrics.progress=false"]
    cfg = load_config(None, base)
    url = serve_teacher(str(resolve_model(cfg.model)))
    distill = ["trainer.loss.kl_coef=0", f"trainer.distill.server={url}", "trainer.distill.coef=0.05"]
    extra = ["run.steps=6", "run.mode=sync", "trainer.batch_groups=4", "rollout.group_size=4"]
    res = run_pipeline(load_config(None, [*base, *extra, *distill]), stop_ray=False)
    assert res.status == "completed", res.error
    train = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "version" in r]
    assert [r["version"] for r in train] == list(range(1, 7))
    assert all(r["generator/samples_failed"] == 0 for r in train if "generator/samples_failed" in r)
    assert abs(train[0]["kl/value"]) < 1e-4  # version 0 samples, scored by the policy's own weights
    assert max(r["kl/value"] for r in train[1:]) > 10 * abs(train[0]["kl/value"])
    (handler,) = serve_teacher.handlers()
    assert len(handler.bodies) >= 6 * 16  # every trained sample was scored
