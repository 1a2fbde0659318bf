"""Per-step metric series, for every plot of a run: the run's own PNG (orchestration/metrics.py), the
run report (orchestration/report.py) and `buffer-inspect plot` (pipeline/inspect.py), and the benches.
Imports nothing of the project, so every layer may use it; matplotlib only inside `draw_steps`."""

from __future__ import annotations

import math
from typing import Any


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): what a per-step metric may plot or log."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows of metrics.jsonl that have a step and a finite value."""
    pts = [(h["step"], float(h[key])) for h in history if "step" in h and is_number(h.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def moving_average(xs: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (of fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """~2 % of a run of `n` steps: per-step values are noisy, their trend is the question."""
    return max(1, n // 50)


def draw_steps(ax, history: list[dict[str, Any]], keys: list[tuple[str, str]], title: str) -> None:
    """One panel of per-step series: on a long run each raw series faint behind its moving average."""
    for key, label in keys:
        xs, ys = series(history, key)
        if not ys:
            continue
        w = smoothing_window(len(ys))
        if w > 1:
            line = ax.plot(xs, ys, alpha=0.25)[0]
            ax.plot(xs, moving_average(ys, w), color=line.get_color(), label=f"{label} ({w}-step mean)")
        else:
            ax.plot(xs, ys, "o-" if len(ys) < 30 else "-", label=label, markersize=3)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
