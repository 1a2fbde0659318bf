"""The config seam: each stage is handed its own sections plus a small typed object of run-wide values
(pipeline.config's rollout_run, trainer_run). Sync mode is one of those values, not a rewrite of the
config: the run directory's config.yaml and the driver keep run.max_staleness as the user gave it."""

from __future__ import annotations

import yaml

from pipeline.config import load_config, rollout_run, sync_mode, trainer_run, write_resolved
from pipeline.orchestration.driver import Pipeline


def test_sync_mode_runs_the_stages_at_staleness_zero_and_leaves_the_config_as_given(tmp_path):
    cfg = load_config(None, ["run.mode=sync", "run.max_staleness=3", "run.seed=5", "run.steps=7"])
    assert sync_mode(cfg)
    assert rollout_run(cfg).max_staleness == 0 and rollout_run(cfg).seed == 5
    t = trainer_run(cfg, str(tmp_path))
    assert (t.max_staleness, t.seed, t.steps, t.run_dir) == (0, 5, 7, str(tmp_path))
    # the driver and its stages' supervisors hold the config as given, and so does the run directory
    pipe = Pipeline(cfg, tmp_path)
    assert pipe.cfg is cfg and pipe.site.cfg is cfg and cfg.run.max_staleness == 3
    written = yaml.safe_load(write_resolved(cfg, tmp_path).read_text())
    assert written["run"]["mode"] == "sync" and written["run"]["max_staleness"] == 3


def test_async_mode_hands_the_stages_the_bound_as_given(tmp_path):
    cfg = load_config(None, ["run.max_staleness=4", "trainer.routing_replay=true"])
    assert not sync_mode(cfg)
    assert rollout_run(cfg).max_staleness == 4 and rollout_run(cfg).routing_replay
    assert trainer_run(cfg, str(tmp_path)).max_staleness == 4
