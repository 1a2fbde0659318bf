"""bin/run-report: a run directory's metrics become one PNG of the panels that have data and a Markdown
summary with the reward at the start and the end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from pipeline.orchestration.report import PANELS, main, summarise

REPO = Path(__file__).resolve().parent.parent


def _run_dir(tmp_path: Path, steps: int = 150) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {
            "step": s,
            "time": 1000.0 + s,
            "reward/mean": 0.2 + 0.6 * s / steps,
            "staleness/mean": 1.5,
            "staleness/max": 2,
            "trainer/idle_share": 0.1,
            "run/restarts": 1 if s > 50 else 0,
        }
        for s in range(1, steps + 1)
    ]
    rows.insert(40, {"event": "resume", "step": 40, "time": 1040.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(
        yaml.safe_dump({"run": {"name": "r", "mode": "async", "max_staleness": 2}, "model": {"name": "m"}})
    )
    return run


def test_report_writes_the_panels_with_data_and_a_summary(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert main([str(run)]) == 0
    md = (run / "report.md").read_text()
    assert md.strip() in capsys.readouterr().out  # printed as well
    assert "150 steps" in md and "reward 0.232 -> 0.772" in md and "Restarts: 1, resumes: 1" in md
    assert "(`staleness/mean`) | 1.5 |" in md and "(`trainer/idle_share`) | 0.1 |" in md
    assert "push/prev_seconds" not in md  # a series the run did not log gets no row (and no panel)
    assert (run / "report.png").stat().st_size > 10_000


def test_summary_figures_are_the_medians_and_the_tenths():
    history = [
        {"step": s, "time": float(s), "reward/mean": float(s), "tis/weight_mean": 1.0 + s % 3}
        for s in range(1, 21)
    ]
    s = summarise(history, {})
    assert (s["reward_first"], s["reward_last"]) == (1.5, 19.5) and s["tis/weight_mean"] == 2.0
    assert {k for _, keys in PANELS[1:] for k, _ in keys} <= set(s)


def test_a_directory_without_metrics_is_named(tmp_path):
    res = subprocess.run(
        [str(REPO / "bin" / "run-report"), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and f"{tmp_path} has no metrics.jsonl" in res.stderr


def test_wandb_gets_the_entity_group_and_mode_keys(tmp_path, monkeypatch):
    """metrics.wandb_entity / wandb_group / wandb_mode reach wandb.init (a stand-in module records the
    call: wandb itself is an optional extra)."""
    import sys
    import types

    from pipeline.config import load_config
    from pipeline.orchestration.metrics import MetricsWriter

    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: (
            calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
        )
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(
        None, ["metrics.wandb_project=p", "metrics.wandb_entity=team", "metrics.wandb_mode=offline"]
    )
    m = cfg.metrics
    w = MetricsWriter(
        tmp_path,
        tensorboard=False,
        wandb_project=m.wandb_project,
        wandb_init={"entity": m.wandb_entity, "group": m.wandb_group, "mode": m.wandb_mode},
    )
    w.close()
    assert (
        calls
        and calls[0]["project"] == "p"
        and calls[0]["entity"] == "team"
        and calls[0]["mode"] == "offline"
    )
    assert "group" not in calls[0]  # empty: wandb's default
