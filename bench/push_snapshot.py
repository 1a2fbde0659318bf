"""The trainer's side of a weight push: gather the shards into full HF tensors and copy them somewhere
the push can read while training goes on (weights.snapshot). Baseline in the same run: the copy on
trainer rank 0's GPU (what every push did before); against it the pinned host copy, filled one
gathered tensor at a time (weights.snapshot=cpu, the auto choice for models over 10 % of the GPU with
pipeline stages; without, auto pushes such a model direct, with no copy).

    python bench/push_snapshot.py --shape 1.5b                       # one GPU
    torchrun --nproc-per-node 2 bench/push_snapshot.py --shape 7b --tp 2
    python bench/push_snapshot.py --shape tiny --device cpu          # the code path on CPU (smoke)

Per mode: seconds per snapshot (the first host one includes pinning its buffers) and the GPU memory it
adds at its peak over the trained state. Prints one JSON line last; appends it, with device and date,
to bench/results/push_snapshot.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import RESULTS, record  # noqa: E402 - bench/ is on sys.path when a bench runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.5b", help="a bench/trainer_gpu.py shape, or tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()

    import torch

    from pipeline.config import RunConfig, trainer_run
    from stages.trainer.export import HostSnapshot, export_hf_state
    from stages.trainer.testing import ListSource, make_tiny_hf
    from stages.trainer.trainer import Trainer

    rank = int(os.environ.get("RANK", 0))
    cuda = a.device == "cuda"
    tmp = tempfile.mkdtemp(prefix="bench-push-snapshot-", dir=a.workdir)
    if a.shape == "tiny":
        path = make_tiny_hf(f"{tmp}/tiny") if rank == 0 else f"{tmp}/tiny"
    else:
        from bench.trainer_gpu import build_model

        path = build_model(a.shape, a.workdir or "/tmp")
    cfg = RunConfig()
    cfg.trainer.tp, cfg.trainer.resume = a.tp, False
    cfg.trainer.device = "cuda" if cuda else "cpu"
    cfg.trainer.precision = "bf16" if cuda else "fp32"
    run = trainer_run(cfg, f"{tmp}/run")
    trainer = Trainer(
        cfg.trainer, run, ListSource([]), path, weights=cfg.weights
    )  # no steps: the weights as loaded
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def measure(**target) -> dict:
        times, extra = [], 0.0
        for _ in range(a.repeats):
            sync()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            state = export_hf_state(trainer.policy, **target)
            sync()
            times.append(time.perf_counter() - t0)
            if cuda:
                extra = max(extra, (torch.cuda.max_memory_allocated() - base) / 1e9)
            nbytes = sum(t.numel() * t.element_size() for t in state.values()) if state else 0
            del state
        return {
            "first_s": round(times[0], 4),
            "s": round(min(times[1:] or times), 4),
            "gpu_extra_gb": round(extra, 2),
            "bytes": nbytes,
        }

    gpu = measure(device="cuda" if cuda else "cpu")
    host = measure(host=HostSnapshot())
    if rank != 0:
        return
    out = {
        "bench": "push_snapshot",
        "shape": a.shape,
        "tp": a.tp,
        "bytes": host["bytes"],
        "gpu_copy": gpu,
        "host_pinned": host,
        "host_vs_gpu_s": round(host["s"] / gpu["s"], 2) if gpu["s"] else None,
        "host_gb_per_s": round(host["bytes"] / host["s"] / 1e9, 1) if host["s"] else None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    # a CPU run only checks the code path: recorded only when asked (BENCH_RECORD=1)
    path = RESULTS / "push_snapshot.jsonl" if cuda or os.environ.get("BENCH_RECORD") else None
    record(out, path, device=torch.cuda.get_device_name() + f" x{a.tp}" if cuda else None)


if __name__ == "__main__":
    main()
