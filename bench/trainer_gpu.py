"""Trainer speed and memory on GPUs at real shapes, against a plain HF loop on the same tokens.

One invocation measures, on the same card(s): the bf16 matmul peak (8192^3), then per shape the
megatron trainer (`Trainer.step()` on synthetic GRPO groups from an in-process buffer) and a plain
HF `Qwen2ForCausalLM` loop (SDPA, bf16 weights, fused AdamW; the same two passes per step as a
trainer that recomputes logp_old: a no-grad forward and a forward/backward with the GRPO token loss)
on the same samples. Models are random-weight Qwen2.5 shapes built on the machine, and `moe-small`, a
Qwen3-MoE (16 experts, top-4, ~2B parameters, ~1B active) whose HF loop runs transformers' MoE block
(grouped_mm where that transformers version has it, else a Python loop over experts).

  python bench/trainer_gpu.py --shapes 0.5b,1.5b             # one GPU
  python bench/trainer_gpu.py --shapes moe-small --results bench/results/trainer_gpu.jsonl
  torchrun --nproc-per-node 2 bench/trainer_gpu.py --shapes 7b --tp 2 --no-hf
  torchrun --nproc-per-node 2 bench/trainer_gpu.py --shapes moe-small --ep 2 --no-hf

Per shape one JSON object (`shape`, `tokens_per_s`, `mfu`, `vs_hf`, `peak_mem_gb`, ...) is printed
and, with --results, appended to that file with `device` and `date`; the last line printed is the
JSON of the last shape. `mfu` = 6 x params x tokens/s over the measured peak (the convention of the
issue; a step does more work than 6N: the logp_old pass and any recompute are not counted); for an
MoE shape N is the active parameters (`active_params`: attention, router, top-k experts per token,
embeddings and head; `params` is the total), as is `tflops` (6 x N x tokens/s per GPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# both loops allocate chunks of varying size every micro-batch; without expandable segments the caching
# allocator fragments and falls back to synchronising cudaFree/cudaMalloc (seen as CPU time in aten::mm)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

SHAPES = {  # Qwen2.5 configs (vocab 151936 in the 0.5B/1.5B releases, 152064 in 7B)
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
SHAPES["1.5b-32k"] = SHAPES["1.5b"]
# Qwen3-MoE (the trainer's MoE family, stages/trainer/moe.py): every layer MoE, no shared expert,
# qk-norm, no qkv bias. 1.96B parameters, 1.05B active (the embeddings and head are 0.62B of both)
SHAPES["moe-small"] = dict(
    hidden_size=2048,
    intermediate_size=6144,  # dense MLP of `mlp_only_layers` (none here)
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=1024,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    tie_word_embeddings=False,
)


# Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8 of ffn 768, 32 heads / 4 KV heads of 128, vocab
# 151936, untied) with fewer layers than its 48, so one GPU holds the training state: the row name
# says how many (`qwen3-30b-a3b-L4`). Active parameters per token: attention, router and 8 experts.
for _layers in (2, 4, 6, 8, 12, 16, 24, 48):
    SHAPES[f"qwen3-30b-a3b-L{_layers}"] = dict(
        SHAPES["moe-small"],
        num_hidden_layers=_layers,
        num_attention_heads=32,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    )


def is_moe(shape: str) -> bool:
    return "num_experts" in SHAPES[shape]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b,1.5b", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument(
        "--micro-batch-tokens",
        default="0.5b=16384,1.5b=16384,1.5b-32k=32768,7b=8192,moe-small=8192,"
        + ",".join(f"{k}=8192" for k in SHAPES if k.startswith("qwen3-30b")),
    )
    ap.add_argument("--hf-micro-batch-tokens", type=int, default=8192, help="halved on OOM")
    ap.add_argument("--recompute", default="1.5b-32k,7b", help="shapes trained with full recompute")
    ap.add_argument(
        "--old-logprobs",
        default="separate_pass,from_train_forward",
        help="trainer.old_logprobs modes to measure (the first is judged against HF)",
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size of MoE shapes (trainer.ep)")
    ap.add_argument(
        "--moe-experts",
        default="grouped,sequential",
        help="trainer.moe_experts of MoE shapes to measure, comma list (the first is the row's; the others "
        "add tokens_per_s_experts_<mode>, e.g. the loop over experts as the baseline)",
    )
    ap.add_argument("--distributed-optimizer", action="store_true", help="trainer.distributed_optimizer")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also train with trainer.lora (this rank, alpha 2x, attention + MLP): keys *_lora<rank>; with "
        "--lora-only the full fine-tune is not run (a model only LoRA fits)",
    )
    ap.add_argument("--lora-only", action="store_true")
    ap.add_argument(
        "--backend",
        default="megatron",
        choices=("megatron", "fsdp"),
        help="trainer.backend (fsdp: HF model under FSDP2 over every rank; --tp must be 1)",
    )
    ap.add_argument("--fsdp-compile", action="store_true", help="trainer.fsdp_compile (with --backend fsdp)")
    ap.add_argument(
        "--baseline",
        default="",
        help="a .jsonl whose last row of the same shape is the megatron backend's run on the same tokens: "
        "adds vs_megatron (tokens/s per GPU over that row's)",
    )
    ap.add_argument("--logits-chunk-tokens", type=int, default=2048)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--parity",
        action="store_true",
        help="also: |logp - HF fp32| for the new and old head (not for 1.5b-32k)",
    )
    ap.add_argument("--results", default="", help="append each shape's JSON to this .jsonl")
    ap.add_argument("--profile", default="", help="write a kernel table of one trainer step to this file")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    return ap.parse_args()


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def log(*a):
    if rank() == 0:
        print(*a, flush=True)


def build_model(shape: str, root: str) -> str:
    """A random-weight HF folder of the shape (bf16 safetensors), built once on rank 0 (on the GPU;
    on the CPU where there is none). MoE shapes are Qwen3MoeForCausalLM, saved in the per-expert
    checkpoint format that SGLang and the trainer read."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = is_moe(shape)
    name = f"qwen3-{shape}-random" if moe else f"qwen2.5-{shape.split('-')[0]}-random"
    path = os.path.join(root, name)
    if rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config_cls, model_cls = (
            (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen2Config, Qwen2ForCausalLM)
        )
        cfg = config_cls(
            **SHAPES[shape],
            max_position_embeddings=32768,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            torch_dtype="bfloat16",
        )
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            m = model_cls(cfg).to(torch.bfloat16)
        if moe:  # some transformers versions start the router at zero: every token to experts 0..k-1
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n.endswith("mlp.gate.weight"):
                        p.normal_(0.0, cfg.initializer_range)
        m.save_pretrained(path)
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.barrier()
    return path


def param_count(shape: str, active: bool = False) -> int:
    """Parameters of the HF model of this shape (embeddings, and the head when untied, included).
    `active`: those one token goes through (an MoE layer's router and top-k experts, not all of them);
    a dense shape's are all of them."""
    c = SHAPES[shape]
    if is_moe(shape):
        return _moe_param_count(c, active)
    h, f, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h  # qkv(+bias), o, mlp, 2 norms
    return v * h * (1 if c["tie_word_embeddings"] else 2) + L * layer + h


def _moe_param_count(c: dict, active: bool) -> int:
    """Qwen3-MoE: q/k/v/o without bias, per-head q/k RMSNorm; MoE layers (every decoder_sparse_step-th,
    except mlp_only_layers, as stages/trainer/moe.moe_layers) have a router [E, h] and E SwiGLU
    experts of moe_intermediate_size, the others a dense SwiGLU MLP of intermediate_size."""
    h, L, v, hd = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = h * (q + 2 * kv) + q * h + 2 * hd  # q, k, v, o, q_norm, k_norm
    step, dense = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
    n_moe = sum(i not in dense and (i + 1) % step == 0 for i in range(L))
    experts = c["num_experts_per_tok"] if active else c["num_experts"]
    moe_mlp = c["num_experts"] * h + experts * 3 * h * c["moe_intermediate_size"]
    mlps = n_moe * moe_mlp + (L - n_moe) * 3 * h * c["intermediate_size"]
    return v * h * (1 if c["tie_word_embeddings"] else 2) + L * (attn + 2 * h) + mlps + h


def matmul_peak() -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def workload(shape: str, a, vocab: int, step: int):
    from stages.trainer.testing import make_samples

    if shape.endswith("32k"):  # one group of 2 sequences of prompt 1k + response 31k
        return make_samples(
            1,
            2,
            vocab=vocab,
            seed=step,
            prompt_len=(1024, 1025),
            response_len=(31 * 1024, 31 * 1024 + 1),
            prefix=f"s{step}-",
        )
    return make_samples(
        a.groups,
        a.group_size,
        vocab=vocab,
        seed=step,
        prompt_len=(128, 257),
        response_len=(512, 1025),
        prefix=f"s{step}-",
    )


def run_trainer(shape, path, a, mbt, recompute, old_mode, experts="auto", lora_rank=0) -> dict:
    import torch

    from buffer.config import BufferConfig
    from buffer.inproc import InProcBuffer
    from pipeline.config import RunConfig, trainer_run
    from stages.trainer.trainer import Trainer

    cfg = RunConfig()
    tc = cfg.trainer
    tc.batch_groups = 1 if shape.endswith("32k") else a.groups
    tc.micro_batch_tokens, tc.precision, tc.recompute, tc.tp = mbt, "bf16", recompute, a.tp
    tc.old_logprobs, tc.fetch_timeout_s, tc.resume, tc.lr = old_mode, 600.0, False, 1e-6
    tc.logits_chunk_tokens = a.logits_chunk_tokens
    tc.ep = a.ep  # as main's init_distributed made the groups (a dense model has no experts to split)
    tc.moe_experts, tc.distributed_optimizer = experts, a.distributed_optimizer
    tc.backend, tc.fsdp_compile = a.backend, a.fsdp_compile
    if lora_rank:
        from stages.trainer.config import LoraConfig

        tc.lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank)
    if is_moe(shape):  # megatron's MoE layers take sequence-parallel input under TP
        tc.sequence_parallel = a.tp > 1
    cfg.run.max_staleness, cfg.run.steps = 10**6, a.steps + a.warmup
    tmp = tempfile.mkdtemp(prefix="bench-trainer-gpu-", dir=a.workdir)
    src = None
    vocab = SHAPES[shape]["vocab_size"]
    if rank() == 0:
        src = InProcBuffer(
            cfg=BufferConfig(policy="fifo", durable=False, capacity_samples=10**6), directory=f"{tmp}/buf"
        )
        for i in range(a.steps + a.warmup):
            src.put(workload(shape, a, vocab, i))
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg.trainer, trainer_run(cfg, f"{tmp}/run"), src, path, weights=cfg.weights)
    torch.cuda.empty_cache()
    log(
        f"  trainer {shape}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated after init "
        f"(weights, grad buffer, fp32 master copy; Adam state comes at the first step)"
    )
    tokens = secs = 0.0
    if a.profile and rank() == 0:
        src.put(workload(shape, a, vocab, 10**4))
    for s in range(a.steps + a.warmup):
        if a.profile and s == a.warmup:  # one extra, untimed step (its batch was put above)
            import contextlib

            from torch.profiler import ProfilerActivity, profile

            # every rank takes the step (its collectives need them all); rank 0 records it
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=acts) if rank() == 0 else contextlib.nullcontext() as prof:
                trainer.step()
                torch.cuda.synchronize()
            if rank() == 0:
                with open(a.profile, "a") as f:
                    f.write(f"# {shape} {old_mode} moe_experts={experts} micro_batch_tokens={mbt}\n")
                    f.write(
                        prof.key_averages().table(
                            sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
                        )
                    )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        log(
            f"  trainer {shape} [{old_mode}] step {s}: {m['tokens/total']:.0f} tokens {dt:.3f}s "
            f"loss {m['loss']:.4f} mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
        if s >= a.warmup:
            tokens += m["tokens/total"]
            secs += dt
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device="cuda")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)  # the fullest GPU's
    out = {
        "tokens_per_s": tokens / secs,
        "step_s": secs / a.steps,
        "peak_mem_gb": peak.item(),
        "params": param_count(shape),
        "active_params": param_count(shape, active=True),
    }
    parity_trainer = trainer if a.parity else None
    return out, parity_trainer


def run_hf(shape, path, a) -> dict:
    """A plain HF loop: length-sorted padded micro-batches, no-grad forward, then forward/backward."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.trainer import advantages

    # SDPA's cuDNN backend builds a new plan for every new sequence length (~4 ms of CPU per backward call
    # here, and every micro-batch has another length): the flash backend gives the HF loop its best time
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    vocab = SHAPES[shape]["vocab_size"]
    mbt = a.hf_micro_batch_tokens
    torch.cuda.reset_peak_memory_stats()

    def batches(samples):
        seqs = sorted(samples, key=lambda s: -(len(s.array("prompt_ids")) + len(s.array("response_ids"))))
        out, cur = [], []
        for s in seqs:
            n = len(s.array("prompt_ids")) + len(s.array("response_ids")) - 1
            longest = max(
                [n] + [len(c.array("prompt_ids")) + len(c.array("response_ids")) - 1 for c in cur[:1]]
            )
            if cur and longest * (len(cur) + 1) > mbt:
                out.append(cur)
                cur = []
            cur.append(s)
        return out + [cur]

    def tensors(group, adv):
        L = max(len(s.array("prompt_ids")) + len(s.array("response_ids")) for s in group) - 1
        ids = torch.zeros(len(group), L, dtype=torch.long)
        tgt = torch.zeros_like(ids)
        att = torch.zeros_like(ids)
        w = torch.zeros(len(group), L)
        for r, s in enumerate(group):
            p, y = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
            full = p + y
            n = len(full) - 1
            ids[r, :n], tgt[r, :n], att[r, :n] = torch.tensor(full[:-1]), torch.tensor(full[1:]), 1
            w[r, len(p) - 1 : n] = adv[s.uid]
        return ids.cuda(), tgt.cuda(), att.cuda(), w.cuda()

    def token_logp(ids, att, tgt):
        # no attention_mask: rows are right-padded, so causal attention keeps real tokens off the
        # padding and SDPA can take its flash kernel (a padding mask would force the slower kernels)
        logits = model(input_ids=ids).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).squeeze(-1)

    tokens = secs = 0.0
    prof = None
    for step in range(a.steps + a.warmup):
        if a.profile and step == a.warmup:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        samples = workload(shape, a, vocab, step)
        r = torch.tensor([s.reward for s in samples])
        g = advantages.group_ids_to_index([s.group_id for s in samples])
        adv = dict(zip([s.uid for s in samples], advantages.advantages(r, g).tolist()))
        mbs = [tensors(b, adv) for b in batches(samples)]
        ntok = sum(len(s.array("prompt_ids")) + len(s.array("response_ids")) for s in samples)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            old = [token_logp(ids, att, tgt) for ids, tgt, att, _ in mbs]
        opt.zero_grad(set_to_none=True)
        denom = sum(float((w != 0).sum()) for *_, w in mbs) or 1.0
        for (ids, tgt, att, w), lo in zip(mbs, old):
            lp = token_logp(ids, att, tgt)
            ratio = torch.exp(lp - lo)
            (-(ratio * w).sum() / denom).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            with open(a.profile, "a") as f:
                f.write(f"# hf {shape} micro_batch_tokens={mbt}\n")
                f.write(
                    prof.key_averages().table(
                        sort_by="cuda_time_total", row_limit=30, max_name_column_width=70
                    )
                )
            prof = None
        log(
            f"  hf {shape} step {step}: {ntok} tokens {dt:.3f}s mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
        if step >= a.warmup:
            tokens += ntok
            secs += dt
    out = {
        "tokens_per_s": tokens / secs,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "micro_batch_tokens": mbt,
    }
    if is_moe(shape):  # grouped_mm (transformers 5's default where torch has it) or a loop over experts
        out["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    model = opt = None  # frees the GPU memory before the next shape (the closure above shares the name)
    return out


def hf_with_retries(shape, path, a) -> dict:
    import torch

    while True:
        try:
            return run_hf(shape, path, a)
        except torch.OutOfMemoryError as e:
            gc.collect()
            torch.cuda.empty_cache()
            if shape.endswith("32k"):  # one sequence is the whole micro-batch: nothing to halve
                return {"error": f"out of memory on one 32k-token sequence: {str(e)[:160]}"}
            if a.hf_micro_batch_tokens <= 1024:
                return {"error": "out of memory at 1024-token micro-batches"}
            a.hf_micro_batch_tokens //= 2
            log(f"  hf {shape}: out of memory, micro-batch tokens -> {a.hf_micro_batch_tokens}")
            continue
        except Exception as e:  # transformers' MoE block on this torch: keep the trainer's numbers
            if not is_moe(shape):
                raise
            error = f"{type(e).__name__}: {str(e)[:300]}"
        gc.collect()  # the traceback, which held the HF model, is gone here
        torch.cuda.empty_cache()
        return {"error": error}


def parity(trainer, path, shape, a) -> dict:
    """Mean |logp - HF fp32 logp| on 4 sequences: the trainer's path (fused head, varlen) and the
    previous path (megatron output layer with fp32 logits, block mask), same tokens, same run."""
    import torch
    from transformers import AutoModelForCausalLM

    from buffer.record import samples_to_batch
    from stages.trainer.model import build_policy, causal_block_mask
    from stages.trainer.packing import pack, to_token_batch

    samples = workload(shape, a, SHAPES[shape]["vocab_size"], 999)[:4]
    tb = to_token_batch(samples_to_batch(samples))
    packed = trainer.policy.layout in ("varlen", "te")
    mbs = pack(tb, list(range(len(samples))), trainer.tc.micro_batch_tokens, packed_row=packed)
    new = trainer.backend.logprobs(tb, mbs).cpu()
    old_policy = build_policy(path, bf16=True, fp32_lm_head=True, attention="sdpa", ddp=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref, prev = [], []
    with torch.no_grad():
        for s in samples:
            p, y = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
            ids = torch.tensor([p + y], device="cuda")
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)[len(p) - 1 : -1]
            ref.append(lp.gather(-1, ids[0, len(p) :, None]).squeeze(-1).cpu())
            x = ids[:, :-1]
            logits = old_policy.model(
                x, torch.arange(x.shape[1], device="cuda")[None], causal_block_mask(torch.zeros_like(x))
            )[0].float()
            lq = torch.log_softmax(logits, -1)[len(p) - 1 :]
            prev.append(lq.gather(-1, ids[0, len(p) :, None]).squeeze(-1).cpu())
    ref, prev = torch.cat(ref), torch.cat(prev)
    del hf, old_policy
    torch.cuda.empty_cache()
    return {
        "parity_new_vs_hf_fp32": float((new - ref).abs().mean()),
        "parity_prev_vs_hf_fp32": float((prev - ref).abs().mean()),
    }


def main() -> None:
    a = parse()
    import torch

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun: the world and this rank's GPU before anything
        from stages.trainer.model import init_distributed

        init_distributed(tp=a.tp, ep=a.ep)
    mbt = dict(kv.split("=") for kv in a.micro_batch_tokens.split(","))
    recompute = set(a.recompute.split(",")) if a.recompute else set()
    peak = matmul_peak()
    dev = torch.cuda.get_device_name()
    n_gpu = int(os.environ.get("WORLD_SIZE", 1))
    log(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s on {dev}")
    last = None
    for shape in a.shapes.split(","):
        path = build_model(shape, a.workdir)
        row = {
            "shape": shape,
            "micro_batch_tokens": int(mbt[shape]),
            "recompute": shape in recompute,
            "tp": a.tp,
            "gpus": n_gpu,
            "peak_tflops": round(peak / 1e12, 1),
        }
        if is_moe(shape):
            row["ep"] = a.ep
        if a.backend != "megatron":
            row["backend"] = a.backend
            row["fsdp_compile"] = a.fsdp_compile
        # variants: each trainer.old_logprobs mode, then (MoE) each further expert implementation
        experts = a.moe_experts.split(",") if is_moe(shape) else ["auto"]
        variants = [
            (m, experts[0], "" if i == 0 else f"_{m}", 0) for i, m in enumerate(a.old_logprobs.split(","))
        ]
        variants += [(variants[0][0], e, f"_experts_{e}", 0) for e in experts[1:]]
        if a.lora_rank:  # the frozen base needs no weight-gradient GEMMs and no optimizer state
            lora = (variants[0][0], experts[0], f"_lora{a.lora_rank}", a.lora_rank)
            variants = [lora] if a.lora_only else [*variants, lora]
            row["lora_rank"] = a.lora_rank
        if is_moe(shape):
            row["moe_experts"] = experts[0]
        # the HF baseline first, on a GPU nothing else has used yet: not all of a trainer's memory comes
        # back when its variant ends, and the HF loop run after a 30B-shape trainer ran out of memory
        # even at 1024-token micro-batches (2026-11-28, one H100)
        if not a.no_hf and rank() == 0 and a.tp == 1 and a.ep == 1:
            hf = hf_with_retries(shape, path, a)
            row["hf_tokens_per_s"] = round(hf.get("tokens_per_s", 0.0), 1) or None
            row["hf_micro_batch_tokens"] = hf.get("micro_batch_tokens")
            row["hf_peak_mem_gb"] = round(hf.get("peak_mem_gb", 0.0), 1) or None
            if "error" in hf:
                row["hf_error"] = hf["error"]
            if "experts_implementation" in hf:
                row["hf_experts_implementation"] = hf["experts_implementation"]
            del hf
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for i, (mode, impl, key, lora_rank) in enumerate(variants):
            try:
                res, tr = run_trainer(
                    shape, path, a, int(mbt[shape]), shape in recompute, mode, impl, lora_rank
                )
            except torch.OutOfMemoryError as e:
                res, tr = {"error": f"out of memory: {str(e)[:200]}"}, None
            if "error" in res:
                row["error" + key] = res["error"]
            else:
                flops = 6 * res["active_params"] * res["tokens_per_s"]  # active = all of a dense model's
                row.update(
                    {
                        f"tokens_per_s{key}": round(res["tokens_per_s"], 1),
                        f"mfu{key}": round(flops / (peak * n_gpu), 4),
                        f"tflops{key}": round(flops / n_gpu / 1e12, 1),
                        f"peak_mem_gb{key}": round(res["peak_mem_gb"], 1),
                        "params": res["params"],
                    }
                )
                if is_moe(shape):
                    row["active_params"] = res["active_params"]
                if i == 0:
                    row["old_logprobs"] = mode
                if (
                    tr is not None and i == 0 and not lora_rank and not shape.endswith("32k")
                ):  # HF fp32 can't hold 32k
                    row.update(parity(tr, path, shape, a))
            del tr
            gc.collect()
            torch.cuda.empty_cache()
        lora_tps = row.get(f"tokens_per_s_lora{a.lora_rank}")
        if a.lora_rank and row.get("tokens_per_s") and lora_tps:
            row["lora_vs_full"] = round(lora_tps / row["tokens_per_s"], 3)
        if row.get("tokens_per_s") and row.get("tokens_per_s_experts_sequential"):
            row["vs_sequential_experts"] = round(
                row["tokens_per_s"] / row["tokens_per_s_experts_sequential"], 3
            )
        if row.get("hf_tokens_per_s") and "tokens_per_s" in row:
            row["vs_hf"] = round(row["tokens_per_s"] / row["hf_tokens_per_s"], 3)
            if "tokens_per_s_from_train_forward" in row:
                row["vs_hf_from_train_forward"] = round(
                    row["tokens_per_s_from_train_forward"] / row["hf_tokens_per_s"], 3
                )
        if a.baseline and not os.path.exists(a.baseline):  # its run failed: this row still counts
            row["vs_megatron_missing"] = f"no baseline file {a.baseline}"
        elif a.baseline and row.get("tokens_per_s"):
            base = [
                r for r in map(json.loads, open(a.baseline).read().splitlines()) if r.get("shape") == shape
            ]
            if base and base[-1].get("tokens_per_s"):
                per_gpu = row["tokens_per_s"] / n_gpu
                row["vs_megatron"] = round(per_gpu / (base[-1]["tokens_per_s"] / base[-1]["gpus"]), 3)
                row["megatron_tokens_per_s"] = base[-1]["tokens_per_s"]
                row["megatron_layout"] = f"tp={base[-1]['tp']} gpus={base[-1]['gpus']}"
        if is_moe(shape) and "vs_hf" not in row:
            row["vs_hf"] = None
            row["vs_hf_reason"] = (
                "--no-hf"
                if a.no_hf
                else "the HF loop runs only with --tp 1 --ep 1"
                if a.tp != 1
                else row.get("hf_error", "no trainer result")
            )
        row.update(device=f"{n_gpu}x {dev}", date=datetime.date.today().isoformat(), torch=torch.__version__)
        if rank() == 0:
            print(json.dumps(row), flush=True)
            if a.results:
                with open(a.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
        last = row
    if rank() == 0 and last is not None:
        print(json.dumps(last), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
