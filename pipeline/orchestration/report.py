"""A run's report: one PNG with the panels that say whether a run is healthy, and a short Markdown
summary of the same figures, from the run directory's metrics.jsonl and config.yaml.

    bin/run-report RUN_DIR        # writes RUN_DIR/report.png and RUN_DIR/report.md, prints the Markdown

A panel is drawn only when the run logged its series (an SGLang run has no generator idle share, a run
without pushes no push times), so every panel on the page says something about this run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from pipeline.orchestration.metrics import read_history
from pipeline.series import draw_steps, is_number, series

# (panel title, [(metric key, label)]): the questions a reader of an RL run asks, in that order
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("reward/mean", "train reward"), ("eval/accuracy", "eval accuracy")]),
    ("staleness (versions)", [("staleness/mean", "mean"), ("staleness/max", "max")]),
    ("off-policy weight (TIS)", [("tis/weight_mean", "mean weight"), ("tis/clip_frac", "share clipped")]),
    (
        "logprob gap, engine vs trainer (mean abs per token)",
        [("logp/abs_diff_train_rollout", "all tokens"), ("logp/abs_diff_same_version", "same weights")],
    ),
    ("idle share", [("trainer/idle_share", "trainer"), ("generator/idle_share", "generators")]),
    (
        "tokens / s",
        [("throughput/generated_tokens_per_s", "generated"), ("throughput/trained_tokens_per_s", "trained")],
    ),
    ("weight push (s)", [("push/prev_seconds", "push"), ("push/snapshot_s", "trainer's snapshot")]),
]


def plot_report(history: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, keys) for t, keys in PANELS if any(series(history, k)[0] for k, _ in keys)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, keys) in zip(axes[:, 0], panels):
        draw_steps(ax, history, keys, name)
    axes[-1, 0].set_xlabel("trainer step")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def summarise(history: list[dict], config: dict[str, Any]) -> dict[str, Any]:
    """The report's figures: reward at the start and the end (first / last tenth of the steps), and the
    median of every other panel's series."""
    steps = [h for h in history if "reward/mean" in h]
    if not steps:
        raise SystemExit("no training step in metrics.jsonl: nothing to report")
    k = max(1, len(steps) // 10)

    def med(key: str) -> float | None:
        vals = [float(h[key]) for h in steps if is_number(h.get(key))]
        return round(statistics.median(vals), 4) if vals else None

    out: dict[str, Any] = {
        "run": config.get("run", {}).get("name", ""),
        "model": config.get("model", {}).get("name", ""),
        "mode": config.get("run", {}).get("mode", ""),
        "max_staleness": config.get("run", {}).get("max_staleness"),
        "steps": len(steps),
        "wall_s": round(steps[-1]["time"] - steps[0]["time"], 1) if len(steps) > 1 else 0.0,
        "reward_first": round(statistics.mean(h["reward/mean"] for h in steps[:k]), 3),
        "reward_last": round(statistics.mean(h["reward/mean"] for h in steps[-k:]), 3),
        "restarts": int(steps[-1].get("run/restarts", 0)),
        "resumes": sum(1 for h in history if h.get("event") == "resume"),
        "skipped_steps": int(steps[-1].get("optimizer/skipped_total", 0)),
    }
    evals = [h["eval/accuracy"] for h in history if is_number(h.get("eval/accuracy"))]
    if evals:
        out["eval_accuracy_last"] = round(evals[-1], 3)
    for _, keys in PANELS[1:]:
        for key, _ in keys:
            out[key] = med(key)
    return out


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# Run report: {s['run']}",
        "",
        f"{s['model']}, {s['mode']} mode, max staleness {s['max_staleness']}: {s['steps']} steps in "
        f"{s['wall_s']} s; reward {s['reward_first']} -> {s['reward_last']} (first / last tenth of the steps)"
        + (f"; eval accuracy {s['eval_accuracy_last']} at the end" if "eval_accuracy_last" in s else "")
        + ".",
        f"Restarts: {s['restarts']}, resumes: {s['resumes']}, skipped (non-finite) steps: {s['skipped_steps']}.",
        "",
        "| figure (median over steps) | value |",
        "|---|---|",
    ]
    for title, keys in PANELS[1:]:
        for key, label in keys:
            if s.get(key) is not None:
                lines.append(f"| {title}: {label} (`{key}`) | {s[key]} |")
    lines += ["", "![panels](report.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import yaml

    ap = argparse.ArgumentParser(prog="run-report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl and config.yaml)")
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    if not (run / "metrics.jsonl").exists():
        print(f"run-report: {run} has no metrics.jsonl; give a run directory", file=sys.stderr)
        return 2
    history = read_history(run / "metrics.jsonl")
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    s = summarise(history, config)
    plot_report(history, run / "report.png", f"{s['run']}: {s['model']}, {s['steps']} steps")
    text = markdown(s)
    (run / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
