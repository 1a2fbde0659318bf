"""Build a Trainer from a whole RunConfig, as the launcher does (tests/ is on sys.path): the trainer takes
its own sections and a TrainerRun (pipeline.config.trainer_run), never the RunConfig."""

from __future__ import annotations

from typing import Any

from pipeline.config import RunConfig, trainer_run


def make_trainer(cfg: RunConfig, source: Any, model_path: str, run_dir: str, **kw: Any):
    """Trainer(cfg.trainer, trainer_run(cfg, run_dir), source, model_path, weights=cfg.weights, **kw)."""
    from stages.trainer.trainer import Trainer

    return Trainer(cfg.trainer, trainer_run(cfg, str(run_dir)), source, model_path, weights=cfg.weights, **kw)
