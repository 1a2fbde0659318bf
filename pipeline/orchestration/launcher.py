"""The top of a run: the run directory, Ray, the pipeline's stages, the metrics, the outcome.

    run_pipeline(cfg)          what bin/run-pipeline runs: read it top-down for what a run does
      preflight                the model folder, the hooks and the dataset, before Ray starts
      start_ray                a local Ray, or a cluster joined (token auth included)
      Pipeline.start           the stages' supervisors, in order (driver.py, supervisors.py)
      Pipeline.train           one trainer step at a time, healing stages that die (healing.py)
      Pipeline.shutdown        final checkpoint and HF export; the buffer's segments stay on disk

Any stage that fails stops the run with that stage's error; Ctrl-C stops it too.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from pipeline.config import RunConfig, write_resolved
from pipeline.orchestration.calls import StageFailed
from pipeline.orchestration.driver import Pipeline
from pipeline.orchestration.metrics import MetricsWriter
from pipeline.orchestration.progress import Progress, summary

# bench/fault_run.py drives a Pipeline itself and imports these from here
__all__ = [
    "Pipeline",
    "RunResult",
    "StageFailed",
    "make_run_dir",
    "print_summary",
    "run_pipeline",
    "start_ray",
]

log = logging.getLogger("slipstream")


@dataclass
class RunResult:
    run_dir: Path
    status: str  # "completed" | "failed" | "interrupted"
    steps: int
    elapsed_s: float
    history: list[dict] = field(default_factory=list)
    plot: Path | None = None
    error: str = ""


def run_pipeline(cfg: RunConfig, run_dir: Path | None = None, *, stop_ray: bool = True) -> RunResult:
    """Run one training run end to end; never leaves actors behind."""
    import ray

    run_dir = run_dir or make_run_dir(cfg)
    write_resolved(cfg, run_dir)
    t0 = time.time()
    metrics = MetricsWriter(
        run_dir,
        tensorboard=cfg.metrics.tensorboard,
        wandb_project=cfg.metrics.wandb_project,
        wandb_init={
            "entity": cfg.metrics.wandb_entity,
            "group": cfg.metrics.wandb_group,
            "mode": cfg.metrics.wandb_mode,
        },
        run_name=run_dir.name,
        config=msgspec.to_builtins(cfg),
    )
    progress = Progress(cfg.run.steps, enabled=cfg.metrics.progress)
    pipe, status, error, steps = None, "completed", "", 0
    try:
        preflight(cfg)
        start_ray(cfg)
        pipe = Pipeline(cfg, run_dir)
        pipe.start()
        steps = pipe.train(metrics, progress)
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by Ctrl-C"
    except StageFailed as e:
        status, error = "failed", str(e)
    finally:
        progress.finish()
        if pipe is not None:
            extra = pipe.shutdown(failed=status != "completed")
            if extra.get("finish_error") and status == "completed":
                status, error = "failed", f"trainer failed at the end of the run: {extra['finish_error']}"
        plot = metrics.close()
        if stop_ray and ray.is_initialized():
            ray.shutdown()
    steps = len({h["step"] for h in metrics.history})
    return RunResult(run_dir, status, steps, time.time() - t0, metrics.history, plot, error)


def make_run_dir(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    else:
        d = Path(cfg.run.root) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while d.exists():
            d = d.with_name(f"{d.name.rsplit('.', 1)[0]}.{n}")
            n += 1
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


def start_ray(cfg: RunConfig) -> None:
    import ray

    from pipeline.orchestration.actors import actor_env

    if ray.is_initialized():
        return
    kw: dict = {
        "runtime_env": actor_env(),
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": True,
        "logging_level": logging.WARNING,
    }
    if cfg.cluster.address == "local":
        if cfg.cluster.num_cpus:
            kw["num_cpus"] = cfg.cluster.num_cpus
        if cfg.cluster.num_gpus:
            kw["num_gpus"] = cfg.cluster.num_gpus
        ray.init(**kw)
    else:
        token = _cluster_token()
        try:
            ray.init(address=cfg.cluster.address, **kw)
        except (ConnectionError, ray.exceptions.RayError) as e:
            hint = (
                ""
                if token
                else "; if the cluster uses Ray's token auth, put its token in RAY_AUTH_TOKEN, "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
            )
            raise StageFailed(
                f"cluster.address={cfg.cluster.address}: cannot join the Ray cluster: {e}{hint}"
            ) from None


def _cluster_token() -> str:
    """Join a cluster that uses Ray's token auth: Ray sends the token (RAY_AUTH_TOKEN, the file at
    RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) only in RAY_AUTH_MODE=token, and turns that mode on by
    itself only for a cluster it finds on its own, never for an explicit address: without this, joining
    failed with "InvalidAuthToken". A mode the user set is kept. Returns where the token came from."""
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    source = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else path if os.path.exists(path) else ""
    if source:
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config  # Ray caches its config: re-read it, as Ray does when it turns
        # the mode on itself (ray._private.authentication.authentication_token_setup._enable_token_auth)

        Config.initialize("")
    return source


def preflight(cfg: RunConfig) -> None:
    """What can be checked before Ray starts, so that a typo fails in a second with one line instead
    of inside an actor's traceback: the model folder, the rollout hooks, and every line of a dataset file."""
    from stages.models import ModelError, resolve_model
    from stages.rollout.data import DataError, is_task, read_source
    from stages.rollout.hooks import HookError, check_hooks

    try:
        resolve_model(cfg.model)
        check_hooks(cfg.rollout)  # rollout.generate_fn / rollout_fn / filter load (a typo fails here)
    except (ModelError, HookError) as e:
        raise StageFailed(str(e)) from None
    data = cfg.rollout.data
    if data.source and not is_task(data.source):
        counters = {"bad_lines": 0}
        try:
            read_source(data.source, data, counters)
        except DataError as e:
            hint = (
                ""
                if data.on_bad_line == "skip"
                else "; or set rollout.data.on_bad_line=skip to skip bad lines"
            )
            raise StageFailed(f"rollout.data.source: {e}{hint}") from None
        if counters["bad_lines"]:
            log.warning(
                "rollout.data.source %s: %d bad line(s) will be skipped (rollout.data.on_bad_line=skip)",
                data.source,
                counters["bad_lines"],
            )


def print_summary(res: RunResult) -> None:
    if res.error:
        print(f"\nerror: {res.error}")
    print(summary(str(res.run_dir), res.history, res.elapsed_s, res.status))
