"""The trainer stage's share of a run's YAML config, for `python -m stages.trainer`: the `trainer:`,
`weights:` and `model:` sections in full (unknown keys and bad values are errors), and of the others
only the values the trainer takes (TrainerRun: run.seed, steps, max_staleness and mode; the sampling
temperature). The launcher reads the whole file through pipeline/config.py and checks every section.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml

from stages.config_loader import ConfigError, convert, load_tree, section
from stages.models import ModelConfig
from stages.trainer.config import TrainerConfig, TrainerRun
from stages.weights.config import WeightsConfig


@dataclass(frozen=True)
class TrainerStageConfig:
    trainer: TrainerConfig
    weights: WeightsConfig
    model: ModelConfig
    run: TrainerRun


def load(
    path: str | Path | None = None, overrides: list[str] | None = None, run_dir: str = ""
) -> TrainerStageConfig:
    """The stage's config; the run directory is `run_dir`, else run.dir, else a fresh one under run.root."""
    tree, where = load_tree(path, overrides)
    run, sampling = section(tree, "run", where), section(section(tree, "rollout", where), "sampling", where)
    run_dir = (
        run_dir
        or run.get("dir")
        or os.path.join(
            run.get("root", "runs"), f"{run.get('name', 'default')}-trainer-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    )
    try:
        # sync mode is async with a staleness bound of 0 (pipeline.config.effective_staleness)
        sync = run.get("mode", "async") == "sync"
        params = TrainerRun(
            run_dir=str(run_dir),
            seed=int(run.get("seed", 0)),
            steps=int(run.get("steps", 60)),
            max_staleness=0 if sync else int(run.get("max_staleness", 2)),
            temperature=float(sampling.get("temperature", 1.0)),
            fp32_lm_head=bool(section(tree, "model", where).get("fp32_lm_head", True)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: run: {e}") from None
    return TrainerStageConfig(
        trainer=convert(tree, "trainer", TrainerConfig, where),
        weights=convert(tree, "weights", WeightsConfig, where),
        model=convert(tree, "model", ModelConfig, where),
        run=params,
    )


def write_resolved(cfg: TrainerStageConfig) -> Path:
    """The sections the trainer ran with, as YAML, into its run directory; returns the file."""
    out = Path(cfg.run.run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tree = {k: msgspec.to_builtins(getattr(cfg, k)) for k in ("trainer", "weights", "model")}
    tree["trainer_run"] = {k: getattr(cfg.run, k) for k in cfg.run.__dataclass_fields__}
    out.write_text(yaml.safe_dump(tree, sort_keys=False))
    return out
