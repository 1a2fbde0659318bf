"""Issue #40's directed proof that SGLang's prefix (radix) cache, keyed by weight version as the engine
sends it (rollout.sglang.radix_cache), never serves KV computed under other weights, on one GPU:

    python bench/gpu_cache_check.py [--model smollm2-135m] [--results bench/results/gpu_cache_check.jsonl]

One server with the radix cache on. Greedy requests on one long prompt P:
  1. before the push, under the engine's key (v0): P is prefilled and cached under the old weights;
  2. a push of very different weights (every matrix + 0.5 of its own std of noise), version 1, by CUDA IPC;
  3. P under the engine's key again (v1 now): `after_push` (must prefill P: cached_tokens 0);
  4. P under v1 once more: `same_version_again` (must hit the cache: cached_tokens > 0, same tokens);
  5. P under a key nothing used: `fresh` (a whole prefill under the new weights, the reference);
  6. the control, P under the OLD key v0 (what an unkeyed cache does after a push): `old_key`.
The row: each request's cached tokens and its mean |dlogp| against `fresh` over the greedy tokens they
share, and the first answer token's |dlogp|. Passing (`no_kv_crossed_a_push`): after_push prefilled P
anew, same_version_again was served from the cache, and both give fresh's first token within 0.05;
old_key is the control: the crossing the key prevents, measured. Needs sglang==0.5.17 (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from _results import record  # bench/ is on sys.path when a bench runs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def gap(a, b) -> dict:
    """Mean |dlogp| of `a` against `b` over the tokens both sampled alike (greedy: the same prefix), and
    how many of the first tokens agree."""
    same = 0
    for x, y in zip(a.response_ids, b.response_ids):
        if x != y:
            break
        same += 1
    diffs = [abs(x - y) for x, y in zip(a.logprobs[: max(same, 1)], b.logprobs[: max(same, 1)])]
    return {
        "same_tokens": same,
        "of": len(b.response_ids),
        "mean_abs_dlogp": round(sum(diffs) / len(diffs), 5) if diffs else None,
        "cached_tokens": a.meta.get("cached_tokens"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--results", default="")
    ap.add_argument("--log-dir", default="", help="the server's log folder (default: a temporary one)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from bench.gpu_lora_push import model_dir
    from stages.rollout.config import SGLangConfig
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.sglang_engine import SGLangEngine

    row: dict = {"bench": "gpu_cache_check", "model": args.model, "prompt_tokens": args.prompt_tokens}
    try:
        path = model_dir(args.model)
        base = {}
        for f in Path(path).glob("*.safetensors"):
            base.update({k: v.cuda() for k, v in load_file(f).items()})
        g = torch.Generator(device="cuda").manual_seed(0)
        other = {
            n: (t + 0.5 * t.float().std() * torch.randn(t.shape, generator=g, device="cuda")).to(t.dtype)
            if t.dim() == 2
            else t
            for n, t in base.items()
        }
        cfg = SGLangConfig(
            mem_fraction_static=0.4, radix_cache=True, keep_weights_copy=False, log_dir=args.log_dir
        )
        prompt = [100 + (7 * i) % 40000 for i in range(args.prompt_tokens)]
        # every answer runs its length: an early EOS would leave too few tokens to compare
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)

        eng = SGLangEngine(path, cfg, dtype="bfloat16")
        try:

            def ask(key: str | None = None, rid: str = "p"):
                if key is not None:
                    eng.cache_namespace = key
                (res,) = asyncio.run(eng.generate([GenRequest(prompt_ids=prompt, params=greedy, rid=rid)]))
                return res

            before = ask(rid="before")
            old_key = eng.cache_namespace
            row["keys"] = {"before": old_key}
            eng.update_weights_from_tensor(list(other.items()), version=1)
            row["keys"]["after_push"] = eng.cache_namespace
            after = ask(rid="after")
            again = ask(rid="again")
            fresh = ask("check-fresh", rid="fresh")
            crossing = ask(old_key, rid="old-key")
        finally:
            eng.close()
        row["before_push"] = gap(before, fresh)  # other weights: should differ from fresh
        row["after_push"] = gap(after, fresh)
        row["same_version_again"] = gap(again, fresh)
        row["old_key"] = gap(crossing, fresh)
        row["fresh_cached_tokens"] = fresh.meta.get("cached_tokens")
        # judged on the first answer token, which every request computes from P's KV: a prefix served from
        # the cache is computed differently from a whole prefill (bf16), so later greedy tokens may part
        # at a near tie without any KV having crossed; old weights' KV moves it by far more
        first = {k: abs(r.logprobs[0] - fresh.logprobs[0]) for k, r in (("after", after), ("again", again))}
        first["old_key"] = abs(crossing.logprobs[0] - fresh.logprobs[0])
        row["first_token_abs_dlogp"] = {k: round(v, 5) for k, v in first.items()}
        same_first = all(r.response_ids[:1] == fresh.response_ids[:1] for r in (after, again))
        ok_after = row["after_push"]["cached_tokens"] == 0
        ok_again = (row["same_version_again"]["cached_tokens"] or 0) > 0
        row["no_kv_crossed_a_push"] = bool(
            ok_after and ok_again and same_first and max(first["after"], first["again"]) <= 0.05
        )
        row["old_key_reused_old_kv"] = (row["old_key"]["cached_tokens"] or 0) > 0
    except Exception as e:  # what was measured before it is still the result, with the error beside it
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    finally:
        record(row, args.results, device=torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
