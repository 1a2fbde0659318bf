"""The end of a run: the trainer's final checkpoint and HF export get the run's stage limit
(run.timeout_s), not a weight push's. A 7B model's final save took longer than the push limit (120 s),
and every 7B run on GPUs ended "failed" after all its steps; when the limit does run out, the error
says which setting to raise."""

from __future__ import annotations

import time

from pipeline.config import load_config
from pipeline.orchestration.driver import Pipeline, finish_limit_s


def _slow_trainer(seconds: float):
    import ray

    @ray.remote(num_cpus=0)
    class SlowFinish:
        """A trainer whose final save takes `seconds` (the shutdown under test only calls finish)."""

        def finish(self) -> dict:
            time.sleep(seconds)
            return {"version": 7}

    return SlowFinish.remote()


def _shutdown(tmp_path, trainer, *overrides) -> dict:
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "metrics.tensorboard=false", *overrides])
    pipe = Pipeline(cfg, tmp_path / "run")
    pipe.trainer_group.ranks = [trainer]
    return pipe.shutdown(failed=False)


def test_the_final_save_may_take_run_timeout_beyond_the_push_limit_and_the_shutdown_grace():
    """At the defaults a 7B run's final save gets run.timeout_s (600 s), not the push's 120 s, nor the
    60 s the shutdown gives generators and buffer."""
    assert finish_limit_s(load_config(None, [])) == 600
    assert finish_limit_s(load_config(None, ["run.timeout_s=1800"])) == 1800
    assert finish_limit_s(load_config(None, ["run.timeout_s=30", "weights.timeout_s=120"])) == 120


def test_a_final_save_longer_than_a_push_but_within_run_timeout_ends_the_run_completed(tmp_path, ray_session):
    out = _shutdown(tmp_path, _slow_trainer(1.5), "weights.timeout_s=0.5", "run.timeout_s=30")
    assert out == {"version": 7}


def test_a_final_save_past_run_timeout_is_named_with_the_setting_to_raise(tmp_path, ray_session):
    t0 = time.monotonic()
    out = _shutdown(tmp_path, _slow_trainer(60.0), "weights.timeout_s=1", "run.timeout_s=2")
    assert "final checkpoint and HF export did not end within 2 s" in out["finish_error"]
    assert "raise run.timeout_s" in out["finish_error"]
    assert time.monotonic() - t0 < 30  # the limit holds: the shutdown does not wait for the save


def test_save_at_end_off_leaves_no_final_checkpoint_and_on_saves_one(tmp_path):
    """trainer.save_at_end=false (benchmarks, throwaway runs): the trainer's close writes no checkpoint
    and the actor no HF export; at the default the same close saves the trained version."""
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.testing import ListSource, make_batch, make_tiny_hf

    model_path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    for save_at_end in (False, True):
        cfg = RunConfig()
        cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens = 2, 64
        cfg.trainer.checkpoint_every_s, cfg.trainer.save_at_end = 0.0, save_at_end
        run_dir = tmp_path / str(save_at_end)
        tr = make_trainer(cfg, ListSource([make_batch(2, 4, seed=4)]), model_path, str(run_dir))
        tr.step()
        tr.close()
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert saved == (["step_000001"] if save_at_end else []), (save_at_end, saved)
