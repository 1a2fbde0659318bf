"""LoRA against full fine-tuning on the embedded CPU default (issue #37), in one invocation: the steps and
seconds each takes to reach a reward of 0.9 (moving average over 10 steps), and the bytes of one push.

    .venv/bin/python bench/lora_cpu.py [--steps 650] [--rank 16] [--lr 4e-3]

Three runs of configs/default.yaml: full fine-tuning (its own lr), LoRA on every linear layer, and LoRA
with the embeddings trained whole (trainer.lora.modules_to_save=[embed_tokens]). Goal: a LoRA run reaches
0.9 within twice the steps full fine-tuning takes. Prints one JSON line last and appends it to
bench/results/lora_cpu.jsonl.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _results import record
from _runs import moving_average, run


def reach(rows: list[dict], target: float = 0.9, window: int = 10) -> dict:
    avg = moving_average([r["reward/mean"] for r in rows], window)
    hit = next((i for i, a in enumerate(avg) if i + 1 >= window and a >= target), None)
    pushed = [r["push/prev_bytes"] for r in rows if r.get("push/prev_bytes")]
    return {
        "step_at_0_9": rows[hit]["step"] if hit is not None else None,
        "reward_end": round(avg[-1], 3),
        "push_bytes": pushed[-1] if pushed else None,
        "run_s": round(rows[-1]["time"] - rows[0]["time"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=650)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-3, help="the LoRA runs' trainer.lr")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "lora_cpu.jsonl"))
    a = ap.parse_args()
    steps = [f"run.steps={a.steps}"]
    lora = [f"trainer.lora.rank={a.rank}", f"trainer.lora.alpha={2 * a.rank}", f"trainer.lr={a.lr}"]
    out = {"steps": a.steps, "rank": a.rank, "alpha": 2 * a.rank, "lora_lr": a.lr}
    out["full"] = reach(run(steps)[0])
    out["lora_linears"] = reach(run(steps + lora)[0])
    out["lora_embed_tokens"] = reach(run(steps + lora + ["trainer.lora.modules_to_save=[embed_tokens]"])[0])
    full = out["full"]["step_at_0_9"]
    best = [out[k]["step_at_0_9"] for k in ("lora_linears", "lora_embed_tokens") if out[k]["step_at_0_9"]]
    out["goal_met"] = bool(full and best and min(best) <= 2 * full)
    record(out, a.results)


if __name__ == "__main__":
    main()
