"""LoRA pushes into live SGLang servers (issue #37's GPU goals), on two servers one after the other:

- server A, with LoRA serving (--enable-lora):
  - adapter push (trainer.lora.push=adapter): the adapters loaded as a new adapter by the engine's
    load_adapters (stages/rollout/sglang_lora.py), idle and while 64 requests generate; goal <= 50 ms;
  - correctness: greedy samples served under the adapter, their logprobs against an HF forward of the
    merged model on the same tokens (fp32 up to 3B parameters, bf16 above), and as the control the same
    tokens' logprobs under the base model alone: the adapter's gap must be far below the base's;
- server B, without LoRA (the one a merged push goes to):
  - merged push (push=merge): the merge (base + B.A of the adapted tensors only, on the GPU, from adapters
    already there as the trainer holds them) and its push by CUDA IPC, timed together;
  - full push: every tensor of the model, by CUDA IPC (the baseline the merged push must not be slower than);
  - correctness (up to 3B parameters; above, the HF reference is not kept, for memory): greedy samples
    served after a merged push, their logprobs against the same merged HF model.

Two servers because SGLang's LoRA serving wraps every adapted linear (its weight moves to
`<module>.base_layer.weight`) while a weight push loads by the plain `<module>.weight` name and skips names
it does not find: a merged or full push into a LoRA server would load none of the linears.

    PYTHONPATH=. python bench/gpu_lora_push.py [--model DIR|smollm2-135m] [--rank 64] [--pushes 10]

Adapters are random (A and B ~ N(0, 0.02^2)) on every decoder layer's q/k/v/o/gate/up/down, as a trained
one's shapes and bytes are; B is sent with alpha/r folded in, as the trainer sends it. Appends its JSON line
to bench/results/gpu_lora_push.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _results import record  # bench/ is on sys.path when a bench runs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_dir(name: str) -> str:
    from pipeline.config import ModelConfig
    from stages.models import resolve_model

    if Path(name).is_dir():
        return name
    return str(resolve_model(ModelConfig(name=name, cache_dir="/tmp/models-lora-push")))


def linears(path: str) -> dict[str, tuple[int, int]]:
    """Every targeted decoder linear: HF module name -> (out, in)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = (
        cfg["num_attention_heads"] * head,
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head,
    )
    shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    return {f"model.layers.{i}.{m}": s for i in range(layers) for m, s in shapes.items()}


def random_adapters(path: str, rank: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, (o, i) in linears(path).items():
        out[f"{module}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.02
        out[f"{module}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.02
    return out


def merged(base: dict, adapters: dict, dtype=None, device=None) -> dict:
    """base + B.A for every adapted weight, in `dtype` (default: the base's), on `device` (default: the
    base tensor's): fused into one GEMM for a bf16/fp16 base kept in its dtype, as the trainer merges,
    else summed in fp32 (the fp32 HF reference)."""
    import torch

    out = {}
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            w = base[f"{module}.weight"]
            dev = w.device if device is None else device
            a, b = adapters[name].to(dev), adapters[f"{module}.lora_B.weight"].to(dev)
            w = w.to(dev)
            if w.dtype in (torch.bfloat16, torch.float16) and dtype in (None, w.dtype):
                # the trainer's merge (stages/trainer/lora.Lora.merged): one GEMM onto the base
                out[f"{module}.weight"] = torch.addmm(w, b.to(w.dtype), a.to(w.dtype))
            else:
                out[f"{module}.weight"] = (w.float() + b.float() @ a.float()).to(dtype or w.dtype)
    return out


def merge_into(model, adapters: dict) -> None:
    """`model`'s adapted weights += B.A in place (summed in fp32, as `merged`), with no second state dict."""
    import torch

    with torch.no_grad():
        for name in adapters:
            if name.endswith(".lora_A.weight"):
                module = name[: -len(".lora_A.weight")]
                w = model.get_submodule(module).weight
                a = adapters[name].to(w.device, torch.float32)
                b = adapters[f"{module}.lora_B.weight"].to(w.device, torch.float32)
                w.copy_((w.float() + b @ a).to(w.dtype))


def wait_gone(pgid: int | None, timeout_s: float = 30.0) -> None:
    """Wait (at most `timeout_s`) until no process of a closed server's group is left, so its GPU memory
    is back before the next server starts."""
    deadline = time.monotonic() + timeout_s
    while pgid is not None and time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)


def profiled_push(eng, adapter: dict, version: int, top: int = 15) -> list:
    """One idle adapter push under cProfile: the `top` functions by cumulative time, [name, s, calls]."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(eng.update_weights, list(adapter.items()), version)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]
    return [[f"{Path(f).name}:{line}({name})", round(v[3], 4), v[1]] for (f, line, name), v in rows]


def push_while_generating(eng, adapters: list[dict], first_version: int, max_new: int = 128) -> list[float]:
    """Each adapter push timed while 64 requests generate under the adapters loaded before it (the
    engine sends each request under its current adapter, so the pushes swap adapters in SGLang's pool)."""
    from stages.rollout.engine import GenRequest, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
    reqs = [
        GenRequest(prompt_ids=list(range(200 + i, 248 + i)), params=params, rid=f"l{i}") for i in range(64)
    ]

    async def run() -> list[float]:
        times = []
        for v, adapter in enumerate(adapters):
            load = asyncio.create_task(eng.generate(reqs))
            await asyncio.sleep(0.5)  # requests running
            times.append(
                (await asyncio.to_thread(eng.update_weights, list(adapter.items()), first_version + v))[
                    "total_s"
                ]
            )
            await load
        return times

    return asyncio.run(run())


def gap_stats(hf, prompts: list[list[int]], results) -> dict:
    """max and mean |HF logprob - served logprob| over the served responses' tokens."""
    import torch

    gaps = []
    with torch.no_grad():
        for p, r in zip(prompts, results):
            ids = torch.tensor([p + r.response_ids], device="cuda")
            logp = torch.log_softmax(hf(ids).logits[0, len(p) - 1 : -1].float(), -1)
            mine = logp.gather(-1, ids[0, len(p) :, None])[:, 0].cpu()
            gaps.append((mine - torch.tensor(r.logprobs)).abs())
    gap = torch.cat(gaps)
    return {"max": round(gap.max().item(), 4), "mean": round(gap.mean().item(), 5)}


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "gpu_lora_push.jsonl"))
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.rollout.config import SGLangConfig
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.sglang_engine import SGLangEngine
    from stages.rollout.sglang_lora import LoraServing

    row: dict = {"bench": "gpu_lora_push", "model": args.model, "rank": args.rank}
    hf = None  # the merged HF reference, kept for server B's check up to 3B parameters
    try:
        path = model_dir(args.model)
        base = {}
        for f in Path(path).glob("*.safetensors"):
            base.update({k: v.cuda() for k, v in load_file(f).items()})
        params = sum(t.numel() for t in base.values())
        small = params < 3e9  # fp32 reference, and the merged HF model kept for server B's check
        cfg = SGLangConfig(mem_fraction_static=0.4 if small else 0.3, keep_weights_copy=False)
        adapters = [random_adapters(path, args.rank, seed) for seed in range(args.pushes + 1)]
        # as a bf16 trainer sends them: lora_peft.adapter_push_state scales and casts on its GPU
        sent = [{n: t.to(torch.bfloat16) for n, t in a.items()} for a in adapters]
        row["adapter_mb"] = round(sum(t.numel() * 2 for t in adapters[0].values()) / 2**20, 1)  # as bf16
        row["model_mb"] = round(sum(t.numel() * t.element_size() for t in base.values()) / 2**20, 1)
        row["mem_fraction_static"] = cfg.mem_fraction_static
        greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
        prompts = [list(range(100 + 7 * i, 116 + 7 * i)) for i in range(8)]
        reqs = [GenRequest(prompt_ids=p, params=greedy, rid=str(i)) for i, p in enumerate(prompts)]
        last = adapters[args.pushes - 1]  # the adapter server A serves the greedy requests under
        on_gpu = {n: t.cuda() for n, t in last.items()}  # where the trainer holds its adapters

        # -- server A, LoRA serving: adapter pushes, and the adapter-served logprobs against merged HF
        eng = SGLangEngine(path, cfg, dtype="bfloat16", lora=LoraServing(args.rank, TARGETS))
        try:
            phases = []
            for v in range(args.pushes):  # each push, then its unloads (after it, as a step apart)
                phases.append(eng.update_weights(list(sent[v].items()), v + 1))
                eng.finish_unloads()
                phases[-1]["unload_after_s"] = eng.last_unload_s
            idle = [p["total_s"] for p in phases]
            row["adapter_push_ms_idle"] = ms(idle)
            # where an idle push's time goes (2026-11-28 on an H200: 3.7 s idle against 90 ms generating)
            row["adapter_push_phases_ms_idle"] = {k: ms([p.get(k, 0.0) for p in phases]) for k in phases[0]}
            row["adapter_push_ms_idle_each"] = [round(x * 1e3, 1) for x in idle]
            # where an idle push's write goes (3.9 s on a busy 4x H200 host, 40 ms on the CI box): the
            # last adapter once more, profiled
            try:
                row["idle_push_profile"] = profiled_push(eng, sent[args.pushes - 1], args.pushes + 1)
            except Exception as e:  # noqa: BLE001 - a diagnosis; the pushes below still count
                row["idle_push_profile"] = f"{type(e).__name__}: {e}"
            busy = push_while_generating(eng, sent[: args.pushes], args.pushes + 2)
            row["adapter_push_ms_generating"] = ms(busy)
            row["goal_adapter_push_le_50ms"] = ms(busy) <= 50.0
            res = asyncio.run(eng.generate(reqs))
        finally:
            pgid = eng.pid
            eng.close()
            wait_gone(pgid)  # its GPU memory back before server B starts
        # the reference: HF with the merged weights of the adapter the requests were served under; the
        # control: the same tokens under the base alone (what a push that did not land would give)
        dtype = torch.float32 if small else torch.bfloat16
        row["reference_dtype"] = str(dtype).removeprefix("torch.")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
        row["logprob_gap_base_vs_served"] = gap_stats(hf, prompts, res)
        merge_into(hf, on_gpu)  # in place: no second full state dict on the GPU
        row["logprob_gap_vs_merged_hf"] = gap_stats(hf, prompts, res)
        if not small:  # server B's check is skipped at this size: free the reference for its server
            del hf
            hf = None
        gc.collect()
        torch.cuda.empty_cache()

        # -- server B, no LoRA: merged (merge included) against full pushes, by CUDA IPC
        eng = SGLangEngine(path, cfg, dtype="bfloat16")
        try:
            merged_s, merge_s, full_s = [], [], []
            for v in range(args.pushes):
                t0 = time.perf_counter()
                named = list(merged(base, on_gpu).items())
                torch.cuda.synchronize()  # the merge's kernels are done: its own time (the push syncs too)
                t1 = time.perf_counter()
                eng.update_weights_from_tensor(named, version=1000 + 2 * v)
                merged_s.append(time.perf_counter() - t0)
                merge_s.append(t1 - t0)
                del named  # one merged copy on the GPU at a time
                t0 = time.perf_counter()
                eng.update_weights_from_tensor(list(base.items()), version=1001 + 2 * v)
                full_s.append(time.perf_counter() - t0)
            row.update(merged_push_ms=ms(merged_s), merge_ms=ms(merge_s), full_push_ms=ms(full_s))
            row["goal_merged_not_slower_than_full"] = ms(merged_s) <= ms(full_s)
            # the server now holds the base (the last push was a full one): one more merged push, untimed,
            # and the greedy samples it serves against the merged HF model
            if hf is None:
                row["logprob_gap_merged_push_vs_merged_hf"] = "skipped at this size: memory"
            else:
                eng.update_weights_from_tensor(
                    list(merged(base, on_gpu).items()), version=1000 + 2 * args.pushes
                )
                res_b = asyncio.run(eng.generate(reqs))
                row["logprob_gap_merged_push_vs_merged_hf"] = gap_stats(hf, prompts, res_b)
        finally:
            eng.close()
    except Exception as e:  # what was measured before it is still the result, with the error beside it
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    finally:
        record(row, args.results, device=torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
