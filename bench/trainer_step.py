"""Trainer throughput: trained tokens/s and the share of step time spent waiting for data.

Synthetic complete groups go through a real in-process buffer (buffer.inproc.InProcBuffer) into the
megatron trainer; by default the buffer is filled ahead (pure trainer speed, wait share ~0); with
--produce-groups-per-s a producer thread feeds it at that rate instead, so the wait share shows how
much a slower generator starves the trainer.

  python bench/trainer_step.py                                   # CPU, tiny-qwen2
  python bench/trainer_step.py --device cuda --model smollm2-135m --precision bf16 --response-len 512
  python bench/trainer_step.py --checkpoint-every-step --steps 30  # step time: no / sync / async saves

--checkpoint-every-step times the same trainer in rounds of --round steps that take turns: no
checkpoint, a synchronous checkpoint after every step, an asynchronous one (trainer.async_save) after
every step. A step's time is its wall time with its save (Trainer.step's time/step_s leaves the save
out). Before the next round the async round waits for its last save, which so overlaps no timed step
(one save in --round); that wait is reported apart (async_wait_s), not in the step times. Goal (issue
#39): async within 10 % of none.

Prints one JSON line last: {"tokens_per_s", "data_wait_share", ...} and appends it to
bench/results/trainer_step.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _results import record  # noqa: E402 - bench/ is the script's own folder

MODES = ("none", "sync", "async")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2, smollm2-135m or an HF folder")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps not counted")
    ap.add_argument("--groups", type=int, default=8, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--produce-groups-per-s", type=float, default=0.0, help="0: buffer filled ahead")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--checkpoint-every-step", action="store_true", help="time none / sync / async saves")
    ap.add_argument("--round", type=int, default=8, help="steps per mode before the next mode's turn")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "trainer_step.jsonl"))
    return ap.parse_args()


def main() -> None:
    a = parse()
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from buffer.config import BufferConfig
    from buffer.inproc import InProcBuffer
    from pipeline.config import ModelConfig, RunConfig, trainer_run
    from stages.models import resolve_model
    from stages.trainer.testing import make_samples
    from stages.trainer.trainer import Trainer

    model_path = str(resolve_model(ModelConfig(name=a.model)))
    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    cfg = RunConfig()
    tc = cfg.trainer
    tc.batch_groups, tc.micro_batch_tokens, tc.precision, tc.threads = (
        a.groups,
        a.micro_batch_tokens,
        a.precision,
        a.threads,
    )
    tc.fetch_timeout_s, tc.resume = 600.0, False
    tc.checkpoint_every_s = 0.0  # saves only where this bench asks for them
    total = a.steps * (len(MODES) if a.checkpoint_every_step else 1) + a.warmup
    cfg.run.max_staleness, cfg.run.steps = 10**6, total
    plen = (a.prompt_len // 2, a.prompt_len + 1)
    rlen = (a.response_len // 2, a.response_len + 1)

    def groups(i: int, n: int):
        return make_samples(
            n, a.group_size, vocab=vocab, seed=i, prompt_len=plen, response_len=rlen, prefix=f"b{i}-"
        )

    tmp = tempfile.mkdtemp(prefix="bench-trainer-")
    buf = InProcBuffer(
        cfg=BufferConfig(policy="fifo", durable=False, capacity_samples=10**6), directory=f"{tmp}/buf"
    )
    if a.produce_groups_per_s <= 0:
        for i in range(total):
            buf.put(groups(i, a.groups))
    else:

        def produce():
            for i in range(total * a.groups):
                buf.put(groups(i, 1))
                time.sleep(1.0 / a.produce_groups_per_s)

        threading.Thread(target=produce, daemon=True).start()
    trainer = Trainer(cfg.trainer, trainer_run(cfg, f"{tmp}/run"), buf, model_path, weights=cfg.weights)
    if a.checkpoint_every_step:
        extra = checkpoint_rounds(a, trainer)
    else:
        tokens = wait = step_s = 0.0
        for s in range(total):
            m = trainer.step()
            if s >= a.warmup:
                tokens += m["tokens/total"]
                wait += m["time/data_wait_s"]
                step_s += m["time/step_s"]
            _show(m)
        extra = {
            "tokens_per_s": round(tokens / step_s, 1),
            "data_wait_share": round(wait / step_s, 4),
            "step_s": round(step_s / a.steps, 4),
            "tokens_per_step": tokens / a.steps,
        }
    import torch

    dev = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    out = {
        **extra,
        "model": a.model,
        "device": dev,
        "precision": a.precision,
        "groups": a.groups,
        "group_size": a.group_size,
        "micro_batch_tokens": a.micro_batch_tokens,
        "produce_groups_per_s": a.produce_groups_per_s,
    }
    record(out, a.results)


def _show(m: dict, note: str = "") -> None:
    print(
        f"step {m['version']}: {m['tokens/total']:.0f} tokens in {m['time/step_s']:.3f}s "
        f"(wait {m['time/data_wait_s']:.3f}s) loss {m['loss']:.4f}{note}",
        flush=True,
    )


def checkpoint_rounds(a: argparse.Namespace, trainer) -> dict:
    """a.steps timed steps per mode (after a.warmup untimed ones), the modes taking turns every a.round
    steps so that a slower minute of the shared machine falls on all of them alike. Each step's time
    is its wall time including its save."""
    from stages.trainer.checkpoint import CheckpointManager

    keep = trainer.tc.keep_checkpoints
    managers = {
        "sync": CheckpointManager(trainer.run_dir, keep=keep),
        "async": CheckpointManager(trainer.run_dir, keep=keep, async_save=True),
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    waits = {m: 0.0 for m in MODES}  # the wait for a round's last save, before the next round
    # the warm-up saves asynchronously: the writer process's start (imports, ~2 s) is not a step's
    trainer.tc.checkpoint_every, trainer.checkpoints = 1, managers["async"]
    for _ in range(a.warmup):
        _show(trainer.step(), " (warm-up)")
    trainer.checkpoints.wait()
    load = os.getloadavg()[0]  # the shared box: what else ran (cores busy) around the timed steps
    turn = 0
    while min(len(t) for t in times.values()) < a.steps:
        mode = MODES[turn % len(MODES)]
        turn += 1
        trainer.tc.checkpoint_every = 0 if mode == "none" else 1
        trainer.checkpoints = managers.get(mode, managers["sync"])
        for _ in range(min(a.round, a.steps - len(times[mode]))):
            t0 = time.perf_counter()
            m = trainer.step()
            times[mode].append(time.perf_counter() - t0)
            _show(m, f" [{mode}: {times[mode][-1]:.3f}s with the save]")
        t0 = time.perf_counter()
        trainer.checkpoints.wait()
        waits[mode] += time.perf_counter() - t0
    managers["async"].close()
    per = {m: sum(times[m]) / a.steps for m in MODES}
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(os.path.join(trainer.run_dir, "checkpoints"))
        for f in files
    ) / max(1, keep)
    return {
        "checkpoint_every_step": True,
        **{f"step_s_{m}": round(per[m], 4) for m in MODES},
        **{f"step_s_{m}_median": round(statistics.median(times[m]), 4) for m in MODES},
        "sync_overhead": round(per["sync"] / per["none"] - 1, 4),
        "async_overhead": round(per["async"] / per["none"] - 1, 4),
        **{
            f"{m}_overhead_median": round(
                statistics.median(times[m]) / statistics.median(times["none"]) - 1, 4
            )
            for m in ("sync", "async")
        },
        "async_wait_s": round(waits["async"], 4),
        "checkpoint_mb": round(size / 2**20, 2),
        "steps_per_mode": a.steps,
        "round": a.round,
        "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],  # before and after the timed rounds
    }


if __name__ == "__main__":
    main()
