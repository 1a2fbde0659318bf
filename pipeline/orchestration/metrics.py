"""Run metrics: one JSONL line per step (always), TensorBoard events, W&B when configured, and a PNG of
reward and staleness over steps at the end of the run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.series import is_number, moving_average, series, smoothing_window


class MetricsWriter:
    """Append-only metrics sink for the driver. Values that are not finite numbers go to JSONL only."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str = "",
        wandb_init: dict | None = None,
        run_name: str = "",
        config: dict | None = None,
    ):
        """`wandb_init`: extra wandb.init arguments (entity, group, mode) for `wandb_project`."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses at most one line
        self._tb = None
        self._wandb = None
        self.history: list[dict[str, Any]] = []
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError(
                    "metrics.tensorboard=true needs the tensorboard package; pip install "
                    "tensorboard, or set metrics.tensorboard=false"
                ) from None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb_project:
            extra = {k: v for k, v in (wandb_init or {}).items() if v}
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "metrics.wandb_project is set but wandb is not installed; "
                    "pip install -e '.[wandb]' (or pip install wandb), or leave metrics.wandb_project empty"
                ) from None
            self._wandb = wandb.init(
                project=wandb_project, name=run_name, config=config, dir=str(self.run_dir), **extra
            )

    def resume_at(self, step: int) -> None:
        """A run continuing in this directory from `step` (its checkpoint; 0 = from scratch): keep
        only the lines of steps <= `step`, so the file holds one series with one line per step, and
        mark where the new part starts."""
        self._file.close()
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                dropped += 1
                continue
            if isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line)
            else:
                dropped += 1
        if kept or dropped:
            tmp = self.path.with_suffix(".jsonl.tmp")
            marker = {"event": "resume", "step": step, "time": time.time(), "lines_dropped": dropped}
            tmp.write_text("".join(x + "\n" for x in [*kept, json.dumps(marker)]))
            tmp.replace(self.path)
        self._file = self.path.open("a", buffering=1)
        self.history = [h for h in self.history if h.get("step", 0) <= step]  # a restart within this run

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **values}
        self.history.append(row)
        self._file.write(json.dumps(row, default=_jsonable) + "\n")
        scalars = {k: float(v) for k, v in values.items() if is_number(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> Path | None:
        """Flush everything; write reward_staleness.png; return its path (None if nothing was logged)."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if not self.history:
            return None
        try:
            return plot_history(self.history, self.run_dir / "reward_staleness.png")
        except ImportError:  # a GPU box without matplotlib: the JSONL has everything to plot it elsewhere
            return None


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def read_history(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_history(history: list[dict[str, Any]], out: str | Path) -> Path:
    """Reward (and eval accuracy) and staleness over steps, two panels sharing the step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = [h["step"] for h in history]
    xs, ys = series(history, "reward/mean")
    ax1.plot(xs, ys, alpha=0.35, label="train reward (mean per step)")
    w = smoothing_window(len(ys))
    if w > 1:  # the per-step mean is noisy: draw its moving average on top
        ax1.plot(xs, moving_average(ys, w), label=f"moving average ({w} steps)")
    if any("eval/accuracy" in h for h in history):
        ax1.plot(*series(history, "eval/accuracy"), "o-", label="eval accuracy")
    ax1.set_ylabel("reward")
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    ax2.plot(*series(history, "staleness/mean"), label="mean")
    ax2.plot(*series(history, "staleness/max"), label="max", alpha=0.6)
    ax2.set_ylabel("staleness (versions)")
    ax2.set_xlabel("trainer step")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    if steps:
        ax2.set_xlim(min(steps), max(max(steps), min(steps) + 1))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
