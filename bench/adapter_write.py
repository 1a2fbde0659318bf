"""The engine-side write of an adapter push (trainer.lora.push=adapter into SGLang, issue #37) on this CPU
box: SmolLM2-135M's rank-64 adapters (420 tensors, 37 MB in bf16) written as the PEFT folder that SGLang's
/load_lora_adapter reads, the old way against the new, in one run:

- old: the trainer's fp32 tensors, cast to bf16 on the engine's host (sglang_lora.host_cast) and written by
  safetensors' save_file (which copies every tensor twice before the write);
- new: bf16 tensors as the trainer now sends them (cast on its GPU: lora_peft.adapter_push_state), written
  by sglang_lora.write_adapter_folder (safetensors_write: one writev of the tensors' own memory).

    .venv/bin/python bench/adapter_write.py [--rank 64] [--repeats 20] [--results FILE]

The two alternate, 20 times each after one warm-up; medians in ms. Both write where a push writes
(/dev/shm when it has room). Prints one JSON line last (appended to --results when given).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import record  # bench/ is on sys.path when a bench runs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# SmolLM2-135M's config.json, as far as the adapters' shapes go (gpu_lora_push.linears reads these)
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def adapters(rank: int) -> dict:
    """The adapters gpu_lora_push.py pushes (every decoder layer's q/k/v/o/gate/up/down), fp32, under
    PEFT's names as the engine writes them."""
    from gpu_lora_push import random_adapters

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(SMOLLM2_135M))
        return {"base_model.model." + n: t for n, t in random_adapters(d, rank, seed=0).items()}


def old_write(tensors: dict, config: dict, dtype) -> tuple[str, float]:
    """The write before: host cast, then save_file; returns the folder and the cast's seconds."""
    from safetensors.torch import save_file

    from stages.rollout.sglang_lora import adapter_folder_root, host_cast

    t0 = time.perf_counter()
    host = {n: host_cast(t, dtype) for n, t in tensors.items()}
    cast_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    folder = tempfile.mkdtemp(prefix="slipstream-adapter-", dir=adapter_folder_root(nbytes))
    save_file(host, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder, cast_s


def timed(fn) -> tuple[float, str, float]:
    t0 = time.perf_counter()
    folder, cast_s = fn()
    s = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)  # (the push removes it after the load: not timed)
    return s, folder, cast_s


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--results", default="", help="a .jsonl file to append the line to (default: none)")
    args = ap.parse_args()
    import torch

    from stages.rollout.sglang_lora import adapter_config, adapter_folder_root, write_adapter_folder

    fp32 = adapters(args.rank)
    bf16 = {n: t.to(torch.bfloat16) for n, t in fp32.items()}
    config = adapter_config(bf16, args.rank)
    old = lambda: old_write(fp32, config, torch.bfloat16)  # noqa: E731
    new = lambda: (write_adapter_folder(bf16, config, torch.bfloat16), 0.0)  # noqa: E731
    timed(old), timed(new)  # warm-up: the first write of a size faults in the page cache's pages
    runs = {"old": [], "new": []}
    casts = []
    for _ in range(args.repeats):
        for kind, fn in (("old", old), ("new", new)):
            s, _, cast_s = timed(fn)
            runs[kind].append(s)
            casts.append(cast_s) if kind == "old" else None
    nbytes = sum(t.numel() * 2 for t in bf16.values())
    out = {
        "bench": "adapter_write",
        "model": "smollm2-135m",
        "rank": args.rank,
        "tensors": len(bf16),
        "adapter_mb": round(nbytes / 2**20, 1),
        "root": adapter_folder_root(nbytes),
        "repeats": args.repeats,
        "old_write_ms": ms(runs["old"]),
        "old_host_cast_ms": ms(casts),
        "new_write_ms": ms(runs["new"]),
        "speedup": round(statistics.median(runs["old"]) / statistics.median(runs["new"]), 2),
        "torch_threads": torch.get_num_threads(),
    }
    record(out, args.results or None)


if __name__ == "__main__":
    main()
