"""The small whole-pipeline config the healing and elastic tests run (tests/ is on sys.path)."""

from __future__ import annotations

from pipeline.config import RunConfig, load_config


def small_run(tmp_path, *extra: str) -> RunConfig:
    """The default config in `tmp_path`/run with small batches (4 groups of 4), a 120 s timeout and no
    progress line or TensorBoard, plus `extra` overrides."""
    return load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.timeout_s=120",
            "metrics.progress=false",
            "metrics.tensorboard=false",
            "trainer.batch_groups=4",
            "rollout.group_size=4",
            *extra,
        ],
    )
