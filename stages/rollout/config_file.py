"""The rollout stage's share of a run's YAML config, for `python -m stages.rollout`: the file (default
configs/default.yaml) with `a.b=c` overrides applied (stages/config_loader.py), read into the sections
this stage runs on. The `rollout:` and `model:` sections are checked in full (unknown keys and bad values
are errors); of the others only the values the stage takes are read: run.seed and run.max_staleness
(RolloutRun), trainer.routing_replay and trainer.batch_groups (the batch the generators share),
trainer.lora's rank, push and target_modules (SGLang's LoRA serving for adapter pushes) and
trainer.distill.server (the served teacher the generators ask). The
launcher reads the whole file through pipeline/config.py and checks every section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages.config_loader import ConfigError, convert, load_tree, section
from stages.models import ModelConfig
from stages.rollout.config import RolloutConfig
from stages.rollout.run import RolloutRun, check_served_teacher, lora_serving

__all__ = ["ConfigError", "RolloutStageConfig", "load"]


@dataclass(frozen=True)
class RolloutStageConfig:
    rollout: RolloutConfig
    model: ModelConfig
    run: RolloutRun
    batch_groups: int  # trainer.batch_groups: the groups of a batch, shared by the generators


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> RolloutStageConfig:
    tree, where = load_tree(path, overrides)
    run, trainer = section(tree, "run", where), section(tree, "trainer", where)
    lora, teacher = trainer.get("lora") or {}, str((trainer.get("distill") or {}).get("server", ""))
    try:
        rollout = convert(tree, "rollout", RolloutConfig, where)
        staleness = int(run.get("max_staleness", 2))
        check_served_teacher(teacher, rollout.sampling.temperature)
        serving = lora_serving(
            int(lora.get("rank", 0)),
            str(lora.get("push", "merge")),
            list(lora.get("target_modules", [])),
            rollout.engine,
            staleness,
        )
        cfg = RolloutStageConfig(
            rollout=rollout,
            model=convert(tree, "model", ModelConfig, where),
            run=RolloutRun(
                seed=int(run.get("seed", 0)),
                max_staleness=staleness,
                routing_replay=bool(trainer.get("routing_replay", False)),
                lora_serving=serving,
                teacher_url=teacher,
            ),
            batch_groups=int(trainer.get("batch_groups", 8)),
        )
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from None
    if cfg.rollout.num_generators > cfg.batch_groups:
        raise ConfigError(
            f"{where}: rollout.num_generators={cfg.rollout.num_generators} > trainer.batch_groups="
            f"{cfg.batch_groups}: each generator needs at least one group of every batch"
        )
    return cfg
