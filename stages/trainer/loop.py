"""The trainer's continuous loop: step until run.steps, logging metrics, then finish the last push
and checkpoint. Kept apart from Trainer so launchers can drive `Trainer.step()` themselves."""

from __future__ import annotations

import json
import logging
import os
import time

from stages.trainer.feed import SourceExhausted
from stages.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def run(trainer: Trainer, steps: int, *, on_metrics=None, log_every: int = 1) -> dict:
    """Train until `trainer.version == steps` (or a replay source runs out). Returns the last metrics.

    Rank 0 appends every step's metrics as one JSON line to <run dir>/trainer_metrics.jsonl.
    """
    last: dict = {}
    path = os.path.join(trainer.run_dir, "trainer_metrics.jsonl")
    out = None
    if trainer.rank == 0:
        os.makedirs(trainer.run_dir, exist_ok=True)
        out = open(path, "a")
    try:
        while trainer.version < steps:
            try:
                last = trainer.step()
            except SourceExhausted as e:
                log.info("stopping at version %d: %s", trainer.version, e)
                break
            last["time/unix"] = time.time()
            if out is not None:
                out.write(json.dumps(last) + "\n")
                out.flush()
                if log_every and trainer.version % log_every == 0:
                    log.info(_line(last))
            if on_metrics is not None:
                on_metrics(last)
        trainer.close()
    finally:
        if out is not None:
            out.close()
    return last


def _line(m: dict) -> str:
    return (
        f"v{m['version']} loss {m['loss']:.4f} reward {m['reward/mean']:.3f} gnorm {m['grad_norm']:.3f} "
        f"tis {m['tis/weight_mean']:.3f} (clip {m['tis/clip_frac']:.3f}) stale {m['staleness/mean']:.2f} "
        f"tok {m['tokens/trained']:.0f} step {m['time/step_s']:.2f}s wait {m['time/data_wait_s']:.2f}s"
    )
