"""Generated tokens/s of the built-in torch engine against a plain HF `model.generate` loop, on the
same model, prompts and lengths in the same run. Prints one JSON line last (`vs_hf_generate` > 1 means
the engine is faster).

  python bench/rollout_throughput.py [--shapes tiny,mid] [--batch 32] [--new 64] [--threads 1]

Shapes: "tiny" is the tiny-qwen2 default model; "mid" is a random Qwen2 of hidden 512, 8 layers (about
30M parameters with the byte vocabulary), built in a temp folder. Both sides sample at temperature 1
with no early stop (the engine also computes per-token logprobs, which generate does not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def build_mid(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=259,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=258,
        pad_token_id=256,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    return out


def bench_engine(path, prompts, new_tokens: int) -> tuple[float, int]:
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.torch_engine import TorchEngine

    eng = TorchEngine(path, max_batch_size=len(prompts), chunk_tokens=8)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [GenRequest(prompt_ids=p, params=params) for p in prompts]
    asyncio.run(eng.generate(reqs[:2]))  # warm-up
    t0 = time.perf_counter()
    res = asyncio.run(eng.generate(reqs))
    dt = time.perf_counter() - t0
    eng.close()
    return dt, sum(len(r.response_ids) for r in res)


def bench_hf(path, prompts, new_tokens: int) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 256)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=256)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw
        )
        dt = time.perf_counter() - t0
    return dt, int((out.shape[1] - width) * len(prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,mid")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import random

    import torch

    from stages.models import resolve_model

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [
        [257] + [rng.randrange(32, 127) for _ in range(rng.randint(8, 24))] + [258, 257]
        for _ in range(args.batch)
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            if shape == "tiny":
                path = resolve_model(SimpleNamespace(name="tiny-qwen2", cache_dir=f"{tmp}/models"))
            else:
                path = build_mid(Path(tmp) / "mid")
            # interleaved repeats, best of each: on a shared machine the load changes by the second
            eng, hf = [], []
            for _ in range(args.repeats):
                dt, tok = bench_engine(path, prompts, args.new)
                eng.append(tok / dt)
                dt, tok = bench_hf(path, prompts, args.new)
                hf.append(tok / dt)
            results[shape] = {
                "engine_tok_s": round(max(eng), 1),
                "hf_generate_tok_s": round(max(hf), 1),
                "vs_hf_generate": round(max(eng) / max(hf), 3),
                "tokens": tok,
            }
            print(json.dumps({"shape": shape, **results[shape]}), flush=True)
    print(
        json.dumps(
            {
                "bench": "rollout_throughput",
                "batch": args.batch,
                "new_tokens": args.new,
                "threads": args.threads,
                "repeats": args.repeats,
                "vs_hf_generate": min(r["vs_hf_generate"] for r in results.values()),
                "shapes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
