"""The live progress line and the closing summary printed by bin/run-pipeline."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


class Progress:
    """One line, rewritten in place on a terminal; otherwise (logs, CI) a line every `log_every_s`
    seconds and at the last step, not one per step (a 1000-step run would write 1000 lines)."""

    def __init__(
        self, total_steps: int, enabled: bool = True, stream: TextIO = sys.stdout, log_every_s: float = 10.0
    ):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.time()
        self.log_every_s = log_every_s
        self._last_line = float("-inf")
        self._samples = 0

    def update(self, step: int, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._samples += int(m.get("samples", 0))
        elapsed = max(time.time() - self.start, 1e-9)
        line = (
            f"step {step}/{self.total}  v{m.get('version', '-')}  "
            f"reward {_fmt(m.get('reward/mean'))}  "
            f"stale {_fmt(m.get('staleness/mean'), '.1f')}/{_fmt(m.get('staleness/max'), '.0f')}  "
            f"{self._samples / elapsed:.1f} samples/s  "
            f"trainer idle {_fmt(100 * m['trainer/idle_share'] if 'trainer/idle_share' in m else None, '.0f')}%  "
            f"gen idle {_fmt(100 * m['generator/idle_share'] if 'generator/idle_share' in m else None, '.0f')}%  "
            f"{m.get('generators/count', '-')} gen  "
            f"{elapsed:.0f}s"
        )
        if "eval/accuracy" in m:
            line += f"  eval acc {m['eval/accuracy']:.2f}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        elif step >= self.total or time.time() - self._last_line >= self.log_every_s:
            self.stream.write(line + "\n")
            self._last_line = time.time()
        else:
            return
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def summary(run_dir: str, history: list[dict[str, Any]], elapsed_s: float, status: str) -> str:
    """A few lines naming the run directory and what is in it."""
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    first = sum(rewards[:3]) / len(rewards[:3]) if rewards else float("nan")
    last = sum(rewards[-3:]) / len(rewards[-3:]) if rewards else float("nan")
    lines = [
        f"run {status}: {len(history)} steps in {elapsed_s:.0f}s; reward {first:.2f} -> {last:.2f} "
        "(mean of first / last 3 steps)",
        f"run directory: {run_dir}",
    ]
    contents = [
        ("config.yaml", "the resolved config"),
        ("metrics.jsonl", "one line per step"),
        ("tensorboard", "TensorBoard events (tensorboard --logdir ...)"),
        ("buffer", f"Arrow segments (bin/buffer-inspect summary {run_dir}/buffer)"),
        ("checkpoints", "megatron checkpoints (a re-run in this directory resumes)"),
        ("hf", "HF export of the policy"),
        ("reward_staleness.png", f"reward and staleness over steps (more panels: bin/run-report {run_dir})"),
    ]
    for name, what in contents:  # only what this run wrote (tensorboard off, buffer.dir elsewhere, ...)
        if (Path(run_dir) / name).exists():
            lines.append(f"  {name + ('/' if (Path(run_dir) / name).is_dir() else ''):21}{what}")
    return "\n".join(lines)
