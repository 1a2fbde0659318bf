"""Custom rollouts through the whole pipeline (Ray, buffer, megatron trainer): the calculator-tool
config trains (slow: it builds tiny-qwen2-calc, ~1 min once per model cache), and a rollout_fn from a
file outside the repository drives a run (~10 s)."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.config import REPO_ROOT, load_config
from pipeline.orchestration.launcher import run_pipeline


@pytest.mark.slow
def test_tool_calc_config_trains_end_to_end(tmp_path, ray_session):
    cfg = load_config(
        REPO_ROOT / "configs" / "tool-calc-cpu.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=6",
            "run.timeout_s=300",
            "metrics.progress=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            "eval.every_steps=3",
            "eval.num_prompts=4",
            "eval.samples_per_prompt=2",
        ],
    )
    res = run_pipeline(cfg, stop_ray=False)
    assert res.status == "completed", res.error
    train = [h for h in res.history if "version" in h]
    assert [h["version"] for h in train] == list(range(1, 7))
    assert all(h["samples"] == 16 for h in train)
    assert any("eval/accuracy" in h for h in res.history)  # evaluated on generator 0's engine
    from buffer.record import batch_to_samples
    from pipeline.inspect import load

    samples = batch_to_samples(load(str(res.run_dir / "buffer"))[0])
    called = [s for s in samples if s.metadata.get("tool_calls")]
    assert called, "no episode called the tool"
    for s in called[:20]:  # the tool's tokens are in the response, masked out
        mask = s.array("loss_mask")
        assert 0 < mask.sum() < len(mask) and s.metadata["model_turns"] >= 2


def test_a_rollout_fn_from_outside_the_repo_drives_a_run(tmp_path, ray_session):
    hook = tmp_path / "elsewhere" / "loop.py"
    hook.parent.mkdir()
    hook.write_text(
        textwrap.dedent(
            """
            from stages.rollout.hooks import fill_response

            async def rollout(ctx):
                while (group := await ctx.start_group()) is not None:
                    results = await ctx.engine.generate(group.prompt.ids, ctx.params, n=len(group.samples))
                    for s, r in zip(group.samples, results):
                        fill_response(s, response_ids=r.response_ids, rollout_logprobs=r.logprobs,
                                      versions=r.versions)
                        s.metadata["via"] = "rollout_fn"
                    yield group.samples
            """
        )
    )
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=4",
            "run.timeout_s=180",
            "metrics.progress=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            f"rollout.rollout_fn={hook}:rollout",
        ],
    )
    res = run_pipeline(cfg, stop_ray=False)
    assert res.status == "completed", res.error
    train = [h for h in res.history if "version" in h]
    assert [h["version"] for h in train] == [1, 2, 3, 4] and all(h["staleness/max"] <= 2 for h in train)
    from buffer.record import batch_to_samples
    from pipeline.inspect import load

    assert {s.metadata["via"] for s in batch_to_samples(load(str(res.run_dir / "buffer"))[0])} == {
        "rollout_fn"
    }
