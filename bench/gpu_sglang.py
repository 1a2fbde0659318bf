"""Benchmark SGLangEngine on one GPU: startup, generation tokens/s with per-token logprobs, and the phases
of a CUDA-IPC weight update made while requests are in flight. Prints one JSON line last.

    PYTHONPATH=. python bench/gpu_sglang.py [--model PATH] [--batch 64] [--max-new 256] [--updates 5]
    PYTHONPATH=. python bench/gpu_sglang.py --model PATH --spec NGRAM   # speculative decoding (issue #41)

Without --model it builds a random-init Qwen2 (4 layers, hidden 512) in a temporary folder. With --spec
the same measurement runs twice in the invocation, without speculative decoding (the baseline) and with
`--speculative-algorithm ALGO` (plus --spec-args), and the row has both, `spec_speedup` (tokens/s with
over without) and whether every sampled token still came with its logprob and the updates still applied;
an engine that fails with it records the error instead. NGRAM needs no draft model; EAGLE/MTP need one
(--spec-args "--speculative-draft-model-path DIR ...").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time


def build_tiny() -> str:
    from stages.trainer.testing import make_sglang_tiny

    path = tempfile.mkdtemp(prefix="tiny-qwen2-")
    make_sglang_tiny(path)  # the GPU tests' model (eos/bos ids do not matter here: ignore_eos)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--spec", default="", help="also measure with --speculative-algorithm SPEC (e.g. NGRAM)")
    ap.add_argument("--spec-args", default="", help="more SGLang flags for the speculative run")
    args = ap.parse_args()
    import torch

    path = args.model or build_tiny()
    row = {"bench": "gpu_sglang", "device": torch.cuda.get_device_name(0), **measure(path, args, [])}
    if args.spec:
        extra = ["--speculative-algorithm", args.spec, *args.spec_args.split()]
        try:
            spec = measure(path, args, extra)
        except Exception as e:  # a server that refuses the combination: the reason is the result
            spec = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        row["spec"] = {"extra_args": extra, **spec}
        if spec.get("tokens_per_s"):
            row["spec_speedup"] = round(spec["tokens_per_s"] / row["tokens_per_s"], 3)
    print(json.dumps(row))


def measure(path: str, args, extra_args: list[str]) -> dict:
    """One server with `extra_args`: start-up, tokens/s, and the updates made while requests run."""
    from safetensors.torch import load_file

    from stages.rollout.config import SGLangConfig
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.sglang_engine import SGLangEngine

    cfg = SGLangConfig(
        mem_fraction_static=0.3,
        disable_cuda_graph=not args.cuda_graph,
        keep_weights_copy=False,
        extra_args=list(extra_args),
    )
    t0 = time.perf_counter()
    eng = SGLangEngine(path, cfg, dtype="bfloat16")
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, ignore_eos=True)
    reqs = [GenRequest(prompt_ids=list(range(3, 19)), params=params, rid=str(i)) for i in range(args.batch)]
    try:
        asyncio.run(eng.generate(reqs[:4]))  # warm-up
        t0 = time.perf_counter()
        res = asyncio.run(eng.generate(reqs))
        gen_s = time.perf_counter() - t0
        ntok = sum(len(r.response_ids) for r in res)
        weights = {}
        for f in __import__("pathlib").Path(path).glob("*.safetensors"):
            weights.update({k: v.cuda() for k, v in load_file(f).items()})
        named = list(weights.items())
        mb = sum(v.numel() * v.element_size() for v in weights.values()) / 2**20

        async def with_updates():
            task = asyncio.create_task(eng.generate(reqs))
            times = []
            for v in range(1, args.updates + 1):
                await asyncio.sleep(0.2)
                times.append(await asyncio.to_thread(eng.update_weights, named, v))
            out = await task
            return times, out

        times, res2 = asyncio.run(with_updates())
        kept = all(len(r.response_ids) == args.max_new for r in res2)
    finally:
        eng.close()
    med = {k[:-2] + "_ms": round(statistics.median(t[k] for t in times) * 1e3, 2) for k in times[0]}
    return {
        "startup_s": round(startup, 1),
        "batch": args.batch,
        "tokens": ntok,
        "tokens_per_s": round(ntok / gen_s),
        # every sampled token came with its logprob and version (what TIS needs)
        "logprobs_complete": all(
            len(r.logprobs) == len(r.versions) == len(r.response_ids) for r in res + res2
        ),
        "versions_after_updates": sorted({v for r in res2 for v in r.versions}),
        "weights_mb": round(mb, 1),
        "update_ms_median": med,
        "inflight_requests_kept": kept,
        "cuda_graph": args.cuda_graph,
    }


if __name__ == "__main__":
    main()
