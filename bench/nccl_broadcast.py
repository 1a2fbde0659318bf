"""Raw baselines for a weight push of one model's bytes, on the GPU machine (docs/gpu.md):

- `raw_broadcast_s`: an NCCL broadcast of every weight tensor (same names, shapes, dtype, order as a
  push) from one process on GPU A to one process on GPU B, nothing else running in either process;
- `raw_broadcast_flat_s`: the same bytes as one flat tensor, one broadcast (what a push sends per
  bucket since pushes use SGLang's flattened-bucket format): the floor of the disaggregated push;
- `d2d_copy_s`: a device-to-device copy of the same tensors on one GPU, tensor by tensor (what the
  colocated (CUDA IPC) push does: the engine copies each tensor into its own weights);
- `d2d_copy_flat_s`: the same bytes as one copy: the memory-bandwidth floor.

    python bench/nccl_broadcast.py MODEL_DIR [--dtype bfloat16] [--gpus 0,1] [--runs 5]

Medians over --runs after two warm-ups. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
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


def _tensors(spec, dtype, device):
    return [torch.ones(s, dtype=dtype, device=device) for _, s in spec]


def _worker(rank: int, port: int, gpus: list[int], spec, dtype, runs: int, q) -> None:
    from stages.weights.base import align_nccl_env

    align_nccl_env()  # as the trainer and the SGLang servers run
    torch.cuda.set_device(gpus[rank])
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpus", default="0,1", help="the two GPUs of the broadcast (the first one also copies)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    spec, dtype = shapes(a.model_dir), getattr(torch, a.dtype)
    gpus = [int(g) for g in a.gpus.split(",")]
    nbytes = sum(torch.Size(s).numel() for _, s in spec) * dtype.itemsize
    out = {"bench": "weights_raw_baselines", "tensors": len(spec), "bytes": nbytes}
    out["d2d_copy_s"] = round(statistics.median(d2d(spec, dtype, gpus[0], a.runs)), 5)
    torch.cuda.empty_cache()  # the copies' 2x model bytes stay cached otherwise (the workers need room)
    flat = [("flat", [sum(torch.Size(s).numel() for _, s in spec)])]
    out["d2d_copy_flat_s"] = round(statistics.median(d2d(flat, dtype, gpus[0], a.runs)), 5)
    torch.cuda.empty_cache()
    if torch.cuda.device_count() >= 2 and len(gpus) == 2:
        from pipeline.net import free_port

        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(r, port, gpus, spec, dtype, a.runs, q))
            for port in [free_port()]
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            times = q.get(timeout=300)
        except Exception:
            codes = [p.exitcode for p in procs]
            raise SystemExit(
                f"the broadcast workers gave no result in 300 s (exit codes {codes}); see above"
            ) from None
        for p in procs:
            p.join(timeout=60)
        out["raw_broadcast_s"] = round(statistics.median(times["per_tensor"]), 5)
        out["raw_broadcast_flat_s"] = round(statistics.median(times["flat"]), 5)
        out["raw_broadcast_GBps"] = round(nbytes / out["raw_broadcast_flat_s"] / 1e9, 2)
    out["device"] = torch.cuda.get_device_name(gpus[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
