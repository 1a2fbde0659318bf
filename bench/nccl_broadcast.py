"""Raw baselines for a weight push of one model's bytes, on the GPU machine (docs/gpu.md):

- `raw_broadcast_s`: an NCCL broadcast of every weight tensor (same names, shapes, dtype, order as a
  push) from one process on GPU A to one process on GPU B, nothing else running in either process;
- `raw_broadcast_flat_s`: the same bytes as one flat tensor, one broadcast (what a push sends per
  bucket since pushes use SGLang's flattened-bucket format): the floor of the disaggregated push;
- `d2d_copy_s`: a device-to-device copy of the same tensors on one GPU, tensor by tensor (what the
  colocated (CUDA IPC) push does: the engine copies each tensor into its own weights);
- `d2d_copy_flat_s`: the same bytes as one copy: the memory-bandwidth floor.

    python bench/nccl_broadcast.py MODEL_DIR [--dtype bfloat16] [--gpus 0,1] [--runs 5] [--timeout 420]

Medians over --runs after two warm-ups. Progress goes to stderr with timestamps (a 7B run that gave no
result in 300 s twice left nothing to say where it stood). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def shapes(model_dir: str) -> list[tuple[str, list[int]]]:
    from safetensors import safe_open

    out = []
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            out += [(n, list(h.get_slice(n).get_shape())) for n in h.keys()]
    if not out:
        raise SystemExit(f"{model_dir}: no *.safetensors files (give an HF model folder)")
    return out


def _say(what: str) -> None:
    print(f"[nccl_broadcast {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _tensors(spec, dtype, device):
    return [torch.ones(s, dtype=dtype, device=device) for _, s in spec]


def _worker(rank: int, port: int, gpus: list[int], spec, dtype, runs: int, q) -> None:
    from stages.weights.sglang_protocol import align_nccl_env

    align_nccl_env()  # as the trainer and the SGLang servers run
    torch.cuda.set_device(gpus[rank])
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=180),  # a dead peer fails the collective instead of hanging it
    )
    _say(f"rank {rank}: group formed on GPU {gpus[rank]}")
    times = {"per_tensor": [], "flat": []}
    numel = sum(torch.Size(s).numel() for _, s in spec)
    for kind in ("per_tensor", "flat"):
        # one set of buffers at a time: at 7B two would be 30 GB per GPU next to the parent's
        group = (
            _tensors(spec, dtype, "cuda")
            if kind == "per_tensor"
            else [torch.ones(numel * dtype.itemsize, dtype=torch.uint8, device="cuda")]
        )
        for i in range(runs + 2):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for t in group:
                dist.broadcast(t, src=0)
            torch.cuda.synchronize()
            if i >= 2:
                times[kind].append(time.perf_counter() - t0)
        if rank == 0:
            _say(f"{kind}: {len(group)} tensors, median {statistics.median(times[kind]):.4f}s")
        del group
        torch.cuda.empty_cache()
    if rank == 0:
        q.put(times)
    dist.barrier()
    dist.destroy_process_group()


def d2d(spec, dtype, gpu: int, runs: int) -> list[float]:
    torch.cuda.set_device(gpu)
    src, dst = _tensors(spec, dtype, "cuda"), _tensors(spec, dtype, "cuda")
    times = []
    for i in range(runs + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a, b in zip(dst, src):
            a.copy_(b)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def _wait_for_result(q, procs, timeout_s: float) -> dict:
    """The workers' timings, or a clear exit as soon as one of them died or the time is up (a worker
    that dies leaves its peer blocked in a collective; waiting on the queue alone would hang)."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=5)
        except queue.Empty:
            pass
        dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        late = time.monotonic() > deadline
        if dead or late:
            for p in procs:
                p.kill()
            why = f"worker(s) {dead} died" if dead else f"no result in {timeout_s:.0f}s"
            raise SystemExit(f"nccl_broadcast: {why}; their progress and errors are above (stderr)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpus", default="0,1", help="the two GPUs of the broadcast (the first one also copies)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=420, help="seconds the broadcast workers may take")
    a = ap.parse_args()
    spec, dtype = shapes(a.model_dir), getattr(torch, a.dtype)
    gpus = [int(g) for g in a.gpus.split(",")]
    nbytes = sum(torch.Size(s).numel() for _, s in spec) * dtype.itemsize
    out = {"bench": "weights_raw_baselines", "tensors": len(spec), "bytes": nbytes}
    _say(f"{len(spec)} tensors, {nbytes / 1e9:.2f} GB; device copies on GPU {gpus[0]}")
    out["d2d_copy_s"] = round(statistics.median(d2d(spec, dtype, gpus[0], a.runs)), 5)
    torch.cuda.empty_cache()  # the copies' 2x model bytes stay cached otherwise (the workers need room)
    flat = [("flat", [sum(torch.Size(s).numel() for _, s in spec)])]
    out["d2d_copy_flat_s"] = round(statistics.median(d2d(flat, dtype, gpus[0], a.runs)), 5)
    torch.cuda.empty_cache()
    if torch.cuda.device_count() >= 2 and len(gpus) == 2:
        from buffer.net import free_port

        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(r, port, gpus, spec, dtype, a.runs, q))
            for port in [free_port()]
            for r in range(2)
        ]
        for p in procs:
            p.start()
        times = _wait_for_result(q, procs, a.timeout)
        for p in procs:
            p.join(timeout=60)
        out["raw_broadcast_s"] = round(statistics.median(times["per_tensor"]), 5)
        out["raw_broadcast_flat_s"] = round(statistics.median(times["flat"]), 5)
        out["raw_broadcast_GBps"] = round(nbytes / out["raw_broadcast_flat_s"] / 1e9, 2)
    out["device"] = torch.cuda.get_device_name(gpus[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
