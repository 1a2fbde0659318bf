"""Routing replay's effect on the engine-vs-trainer logprob gap, from two pipeline runs of the same MoE
config in sync mode (every token made by the trainer's current weights), replay off and on.

    python bench/replay_summary.py RUN_DIR_OFF RUN_DIR_ON      # prints one JSON line

`gap_off` / `gap_on`: `logp/abs_diff_same_version`, token-weighted over the run (bench/pipeline_summary);
`agreement`: the replay run's `routing/agreement`, the share of (position, layer) where the trainer's
own top-k equals the engine's recorded experts (what replay overrides). Adds `device` and `date`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline_summary import summarise  # noqa: E402
from pipeline.orchestration.metrics import read_history  # noqa: E402


def main() -> None:
    off, on = Path(sys.argv[1]), Path(sys.argv[2])
    s_off, s_on = summarise(off), summarise(on)
    rows = [r for r in read_history(on / "metrics.jsonl") if "routing/agreement" in r]
    agreement = round(statistics.mean(r["routing/agreement"] for r in rows), 4) if rows else None
    out = {
        "bench": "gpu_routing_replay",
        "model": s_on["model"],
        "gap_off": s_off["logp_abs_diff_same_version"],
        "gap_on": s_on["logp_abs_diff_same_version"],
        "tokens_off": s_off["same_version_tokens"],
        "tokens_on": s_on["same_version_tokens"],
        "agreement": agreement,
        "steps": [s_off["steps"], s_on["steps"]],
        "reward_last": [s_off["reward_last"], s_on["reward_last"]],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import torch

        out["device"] = f"{torch.cuda.get_device_name(0)} (one per run)"
    except Exception:
        out["device"] = "unknown"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
