"""What SGLang's garbage collector walks in its HTTP process, and what a pause costs under streaming load,
with the start-up objects frozen (`rollout.sglang.freeze_gc`, the default) or not (`--no-freeze`).

    python bench/sglang_gc.py [--load-s 30] [--streams 256] [--no-freeze] [--results FILE]

One server through SGLangEngine (SmolLM2-135M-Instruct, CUDA graphs off, SGLang's long-GC warning at
50 ms), `--streams` requests of 256 new tokens kept in flight for `--load-s` seconds while a pause and
continue is timed every 0.5 s, as a weight push does them. Then the server's log gives SGLang's own
"Freezing GC" lines (objects per generation before and after) and its long-collection warnings. Session
6's pipeline runs (not frozen) logged a 0.47-0.67 s full collection over ~0.9M objects every ~6 s, and
every pause over 0.3 s met one. JSON last line.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FROZEN = re.compile(
    r"Freezing GC in ([\w ]+) process\. gen0: (\d+)->(\d+), gen1: (\d+)->(\d+), gen2: (\d+)->(\d+)"
)
LONG_GC = re.compile(
    r"LONG GARBAGE COLLECTION DETECTED \| Generation (\d) \| Duration: ([\d.]+)s \| # Objects: gen0=(\d+), gen1=(\d+), gen2=(\d+)"
)


def read_log(text: str) -> dict:
    """SGLang's freeze lines (per process: gen2 objects before -> after) and its long collections."""
    frozen = {m[1]: {"gen2_before": int(m[6]), "gen2_after": int(m[7])} for m in FROZEN.finditer(text)}
    long = [(int(m[1]), float(m[2]), int(m[5])) for m in LONG_GC.finditer(text)]
    full = [d for gen, d, _ in long if gen == 2]
    return {
        "frozen": frozen,
        "long_collections": len(long),
        "full_collections": len(full),
        "full_collection_s_max": max(full, default=None),
        "full_collection_s_median": statistics.median(full) if full else None,
        "gen2_objects_max": max((g2 for *_, g2 in long), default=None),
    }


async def drive(eng, prompt_ids: list[int], streams: int, load_s: float) -> tuple[float, list[float]]:
    """`streams` requests in flight for `load_s` seconds (a finished one is replaced), a pause and
    continue timed every 0.5 s meanwhile. Returns the tokens made per second and the pause-to-continue
    seconds."""
    from stages.rollout.engine import GenRequest, SamplingParams

    # 256 tokens a request: a stream that outlives --load-s ends within a few seconds of it
    params = SamplingParams(temperature=1.0, max_new_tokens=256, ignore_eos=True)
    end, tokens, n = time.monotonic() + load_s, 0, 0

    async def stream():
        nonlocal tokens, n
        while time.monotonic() < end:
            n += 1
            (r,) = await eng.generate([GenRequest(prompt_ids=prompt_ids, params=params, rid=f"r{n}")])
            tokens += len(r.response_ids)

    async def pauses() -> list[float]:
        out = []
        await asyncio.sleep(5.0)  # the streams under way first
        while time.monotonic() < end - 1.0:
            t0 = time.perf_counter()
            await asyncio.to_thread(eng.pause_generation)
            await asyncio.to_thread(eng.continue_generation)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.5)
        return out

    t0 = time.perf_counter()
    timed = asyncio.create_task(pauses())
    await asyncio.gather(*(stream() for _ in range(streams)))
    return tokens / (time.perf_counter() - t0), await timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load-s", type=float, default=30.0)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--no-freeze", action="store_true", help="rollout.sglang.freeze_gc=false")
    ap.add_argument("--results", default="", help="append the JSON (with device and date) to this .jsonl")
    a = ap.parse_args()

    from _results import record

    from pipeline.config import load_config
    from stages.models import load_tokenizer, resolve_model
    from stages.rollout.sglang_engine import SGLangEngine

    work = Path(tempfile.mkdtemp(prefix="sglang-gc-"))
    freeze = "false" if a.no_freeze else "true"
    cfg = load_config(
        "configs/gpu-1x-colocated.yaml",
        [f"model.cache_dir={work}", "rollout.sglang.disable_cuda_graph=true", f"rollout.sglang.freeze_gc={freeze}",
         "rollout.sglang.mem_fraction_static=0.5", f"rollout.sglang.log_dir={work / 'logs'}"],
    )  # fmt: skip
    model = resolve_model(cfg.model)
    prompt = load_tokenizer(model).encode("Write a long story about a lighthouse keeper and the sea.")
    t0 = time.perf_counter()
    eng = SGLangEngine(model, cfg.rollout.sglang, dtype="bfloat16", name="gc-probe")
    started_s = time.perf_counter() - t0
    try:
        tokens_per_s, pauses = asyncio.run(drive(eng, prompt, a.streams, a.load_s))
    finally:
        eng.close()
    log = read_log(eng.log_path.read_text(errors="replace"))
    result = {
        "bench": "sglang_gc",
        "freeze_gc": not a.no_freeze,
        "streams": a.streams,
        "load_s": a.load_s,
        "start_s": round(started_s, 1),
        "tokens_per_s": round(tokens_per_s, 1),
        "pauses": len(pauses),
        "pause_continue_s_median": round(statistics.median(pauses), 4) if pauses else None,
        "pause_continue_s_max": round(max(pauses), 4) if pauses else None,
        "pauses_over_0_1s": sum(p > 0.1 for p in pauses),
        **log,
        "log": str(eng.log_path),
    }
    import torch

    record(result, a.results, device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


if __name__ == "__main__":
    main()
