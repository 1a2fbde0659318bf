"""How far apart are bf16 per-token logprobs from different, correct implementations of the same model?

SmolLM2-135M-Instruct (30 layers). Chat-templated arithmetic prompts get one response each, sampled
at temperature 1 from the fp32 HF model (seeded; with --sglang, by SGLang, see below). Every variant then
scores exactly those response tokens (teacher forcing, one sequence at a time, no padding; mg_trainer
packs them as the trainer does):

  ref             HF transformers, fp32 (log_softmax of fp32 logits)
  a hf_bf16       HF, model.to(bfloat16), logits .float()
  b hf_bf16_f32h  HF bf16 trunk, LM head in fp32: final hidden.float() @ lm_head.weight.float().T
  c mg_bf16_f32h  megatron trainer policy, bf16, fp32_lm_head=True, attention="sdpa"
  d mg_bf16       megatron trainer policy, bf16, fp32_lm_head=False, attention="unfused"
  e mg_fp32       megatron trainer policy, fp32 (sanity: should match ref to ~1e-5)
  f hf_bf16_eager_f32h  (extra) like b, with HF's eager attention (scores in bf16) instead of SDPA

Reported: mean |dlogp| per response token (and max, mean signed) of each variant vs ref, and
pairwise between the bf16 variants; b vs c is the closest analogue of SGLang (fp32 LM head, fp32
attention scores) vs our megatron trainer.

Caveat: CPU bf16 kernels (oneDNN/ATen matmul, SDPA, norms) accumulate and round differently from GPU
kernels (cuBLAS, flash/flashinfer attention, fused RMSNorm), so on CPU the numbers are the size of bf16
implementation noise for this model, not a reproduction of the GPU pair.

GPU (issue #17): `--device cuda` runs every variant on GPU 0 and adds
  mg_trainer      the bf16 policy exactly as the trainer computes logp_old there (layer_spec and
                  attention "auto": FlashAttention varlen over one packed row per micro-batch, or TE's
                  attention when transformer-engine is installed; output_hidden + the fused fp32 LM head
                  of lm_head.head_logprobs; sequences packed by trainer.packing, micro_batch_tokens 4096)
and `--sglang` starts one SGLang server through stages/rollout/sglang_engine.py (bf16,
--enable-fp32-lm-head as the GPU configs run it, --mem-fraction 0.3 so the other variants fit beside
it, no CUDA graphs for a faster start: the kernels are the same) and adds
  sglang          SGLang's own sampling-time logprobs: with --sglang the responses are sampled by SGLang
                  (T=1, all requests at once, as the generators send them; --sample-with sglang, the
                  default there), so these are exactly the rollout_logprobs the pipeline records, and every
                  other variant teacher-forces SGLang's tokens (SGLang's sampling is not seeded)
  sglang_tf       SGLang teacher-forcing the same tokens: one /generate per sequence with input_ids =
                  prompt + response, return_logprob, logprob_start_len = prompt_len - 1, max_new_tokens 1
                  (a prefill; its logprobs are those of the raw distribution at T=1). With --sample-with hf
                  (responses from HF fp32, as on CPU) this is the SGLang variant the gap uses.

  gap          = mean |sglang - mg_trainer| per response token (SGLang vs the trainer's configuration;
                 0.033 measured in the pipeline, `logp/abs_diff_same_version`)
  bf16_floor   = mean of (|hf_bf16_f32h - ref|, |mg_trainer - ref|): the issue's "two correct bf16
                 implementations of the same model on the same tokens, HF bf16 vs the HF fp32 reference and
                 megatron bf16 vs the same reference", each with the fp32 LM head that SGLang and the trainer
                 use. Both components are reported (floor_hf_bf16_vs_ref, floor_mg_bf16_vs_ref), and so is
                 the pairwise alternative floor_pair_hf_vs_mg = mean |hf_bf16_f32h - mg_trainer| (two
                 independent bf16 errors differ by ~sqrt(2) x their distance to fp32, less the part they
                 share, the bf16 rounding of the weights) with gap_vs_pair_floor.
  gap_vs_floor = gap / bf16_floor; goal <= 1.2 (`ok`).
On CPU (no mg_trainer) the trainer's configuration is mg_bf16_f32h (attention "auto" is SDPA there).

Run (CPU, a few minutes):  .venv/bin/python bench/logp_precision.py [--prompts 16 --tokens 64]
Run (GPU, 32 prompts x up to 128 tokens by default there; on an H100 ~2 min, ~3.6 min on a fresh
machine, where SGLang's first forward compiles its kernels for ~75 s; every model is built meanwhile):
  PYTHONPATH=.:$PYTHONPATH python bench/logp_precision.py --device cuda --sglang \
      --results bench/results/gpu_logprobs.jsonl
The last stdout line is one JSON object with all numbers (with --results also appended to that file,
with `device` and `date`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

warnings.filterwarnings("ignore")


def make_prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 50)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        text = f"Calculate {a} {op1} {b} {op2} {c}.\nGive your final answer inside <answer></answer> tags."
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def token_logps(logits: torch.Tensor, seq: torch.Tensor, plen: int) -> torch.Tensor:
    """logits [s, V] of one full sequence -> log p of the response tokens seq[plen:]."""
    z = logits[plen - 1 : len(seq) - 1].float().log_softmax(-1)
    return z.gather(-1, seq[plen:, None]).squeeze(-1)


def stats(x: torch.Tensor, y: torch.Tensor) -> dict:
    d = x.double() - y.double()
    sig = lambda v: float(f"{v:.4g}")  # noqa: E731  (4 significant digits: the fp32 check is ~1e-6)
    return {
        "mean_abs": sig(d.abs().mean().item()),
        "p90_abs": sig(d.abs().quantile(0.9).item()),
        "max_abs": sig(d.abs().max().item()),
        "mean_signed": sig(d.mean().item()),
    }


def hf_f32_head(m, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """HF bf16 trunk, LM head in fp32: final hidden.float() @ lm_head.weight.float().T"""
    h = m(s[None], output_hidden_states=True).hidden_states[-1][0]
    return h.float() @ w.T


def mg_logits(model, s: torch.Tensor) -> torch.Tensor:
    """Logits [s, V] of one sequence from megatron's own output layer (block mask of one segment)."""
    from stages.trainer.model import causal_block_mask

    t = s[None]
    pos = torch.arange(t.shape[1], device=t.device)[None]
    return model(t, pos, causal_block_mask(torch.zeros_like(t)))[0].float()


def mean_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().mean().item()


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=None, help="default 16 on CPU, 32 on CUDA")
    ap.add_argument("--tokens", type=int, default=None, help="max new tokens; default 64 on CPU, 128 on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU runs)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--sglang", action="store_true", help="add SGLang (needs --device cuda)")
    ap.add_argument(
        "--sample-with",
        choices=("hf", "sglang"),
        default=None,
        help="who samples the responses: HF fp32 (default without --sglang) or SGLang (default with it)",
    )
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang's mem_fraction_static")
    ap.add_argument("--results", default="", help="append the JSON line (with device and date) to this file")
    ap.add_argument("--model-cache", default="~/.cache/slipstream/models")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.sglang and not cuda:
        ap.error("--sglang needs --device cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU")
    sample_with = args.sample_with or ("sglang" if args.sglang else "hf")
    if sample_with == "sglang" and not args.sglang:
        ap.error("--sample-with sglang needs --sglang")
    n_prompts = args.prompts or (32 if cuda else 16)
    max_new = args.tokens or (128 if cuda else 64)
    if cuda:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        # the fp32 reference must be fp32: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(args.threads)
    t0 = time.time()

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from pipeline.config import ModelConfig
    from stages.models import load_tokenizer, resolve_model

    path = str(resolve_model(ModelConfig(name="smollm2-135m", cache_dir=args.model_cache)))
    tok = load_tokenizer(path)
    prompts = make_prompts(tok, n_prompts, args.seed)

    scorer = None
    if args.sglang:  # starts in a thread: the server loads while this process works
        from _logp_variants import SGLangScorer

        scorer = SGLangScorer(path, mem_fraction=args.mem_fraction)
    res: dict[str, torch.Tensor] = {}
    extra: dict = {}
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
        eos = set([tok.eos_token_id] if tok.eos_token_id is not None else [])
        gen_eos = hf.generation_config.eos_token_id
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        seqs: list[torch.Tensor] = []
        plens: list[int] = []
        on_dev: list[torch.Tensor] = []

        def score(fn) -> torch.Tensor:
            with torch.no_grad():
                return torch.cat([token_logps(fn(s), s, pl).cpu() for s, pl in zip(on_dev, plens)])

        # -- every variant is built first (while SGLang starts) and scored once the tokens exist ---------
        variants: dict = {}
        for attn, names in (("sdpa", ("hf_bf16", "hf_bf16_f32h")), ("eager", (None, "hf_bf16_eager_f32h"))):
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
            m = m.to(torch.bfloat16).to(dev).eval()
            w = m.lm_head.weight.float()
            if names[0]:
                variants[names[0]] = lambda m=m: score(lambda s: m(s[None]).logits[0].float())
            variants[names[1]] = lambda m=m, w=w: score(lambda s: hf_f32_head(m, w, s))
        del m, w

        from stages.trainer.model import build_policy, init_distributed

        init_distributed(1, 1)
        for name, kw in (
            ("mg_bf16_f32h", dict(bf16=True, fp32_lm_head=True, attention="sdpa")),
            ("mg_bf16", dict(bf16=True, fp32_lm_head=False, attention="unfused")),
            ("mg_fp32", dict(bf16=False, attention="sdpa")),
        ):
            model = build_policy(path, ddp=False, **kw).model.eval()
            variants[name] = lambda model=model: score(lambda s: mg_logits(model, s))
        del model
        if cuda:  # the trainer's own GPU path (packed rows, varlen attention, fused fp32 head)
            from _logp_variants import TrainerScorer

            trainer_scorer = TrainerScorer(path)
            extra["trainer_layout"] = trainer_scorer.layout
            variants["mg_trainer"] = lambda: trainer_scorer(seqs, plens)
        t_build = time.time() - t0

        # -- responses: sampled by the fp32 HF model (or by SGLang) ---------------------------------------
        if sample_with == "hf":
            torch.manual_seed(args.seed)
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor([p], device=dev)
                    out = hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=True,
                        temperature=1.0,
                        top_k=0,
                        top_p=1.0,
                        max_new_tokens=max_new,
                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                    )[0]
                    resp = out[len(p) :].tolist()
                    for i, t in enumerate(resp):  # keep up to and including the first EOS
                        if t in eos:
                            resp = resp[: i + 1]
                            break
                    seqs.append(torch.tensor(p + resp))
                    plens.append(len(p))
        else:
            scorer.wait()
            resps, lps = scorer.sample(prompts, max_new, eos)
            seqs += [torch.tensor(p + r) for p, r in zip(prompts, resps)]
            plens += [len(p) for p in prompts]
            res["sglang"] = torch.tensor([x for lp in lps for x in lp], dtype=torch.float32)
        t_gen = time.time() - t0
        on_dev += [s.to(dev) for s in seqs]

        # -- SGLang teacher-forcing the same tokens; then its GPU memory is free for the others -------------
        if scorer is not None:
            scorer.wait()
            extra["sglang_start_s"] = round(scorer.start_s, 1)
            try:
                tf = [scorer.teacher_forced(s.tolist(), pl) for s, pl in zip(seqs, plens)]
                res["sglang_tf"] = torch.tensor([x for lp in tf for x in lp], dtype=torch.float32)
            except Exception as e:
                if sample_with == "hf":  # the gap needs it
                    raise
                extra["sglang_tf_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"SGLang teacher forcing failed (the gap uses sampling-time logprobs): {e}", flush=True)
            from importlib.metadata import version

            extra["sglang_version"] = version("sglang")
            scorer.close()
            scorer = None

        # -- score: the fp32 reference, then every variant ----------------------------------------------------
        res["ref"] = score(lambda s, m=hf: m(s[None]).logits[0])
        # check: in fp32 the last hidden state times the head reproduces the logits (so b is well-formed)
        with torch.no_grad():
            o = hf(on_dev[0][None], output_hidden_states=True)
            head_check = (o.hidden_states[-1][0] @ hf.lm_head.weight.T - o.logits[0]).abs().max().item()
        del hf, o
        for name in list(variants):
            res[name] = variants.pop(name)()  # and the model goes with its entry
    finally:
        if scorer is not None:
            scorer.close()

    # -- report -----------------------------------------------------------------------------------------
    ref = res["ref"]
    n_tok = ref.numel()
    for k, v in res.items():
        if v.numel() != n_tok:
            raise RuntimeError(f"variant {k} scored {v.numel()} tokens, the reference {n_tok}")
    trainer = "mg_trainer" if cuda else "mg_bf16_f32h"  # the trainer's configuration on this device
    vs_ref = {k: stats(v, ref) for k, v in res.items() if k != "ref"}
    pairs = [
        ("hf_bf16_f32h", "mg_bf16_f32h"),  # ~ SGLang (fp32 head) vs megatron trainer (fp32 head, sdpa)
        ("hf_bf16", "mg_bf16"),
        ("hf_bf16", "hf_bf16_f32h"),
        ("mg_bf16", "mg_bf16_f32h"),
        ("hf_bf16_f32h", "mg_bf16"),
        ("hf_bf16", "mg_bf16_f32h"),
        ("hf_bf16_f32h", "hf_bf16_eager_f32h"),
        ("hf_bf16_eager_f32h", "mg_bf16_f32h"),
        ("hf_bf16_f32h", "mg_trainer"),
        ("mg_bf16_f32h", "mg_trainer"),
        ("sglang", "mg_trainer"),
        ("sglang_tf", "mg_trainer"),
        ("sglang", "sglang_tf"),
        ("sglang", "hf_bf16_f32h"),
        ("sglang_tf", "hf_bf16_f32h"),
    ]
    pairwise = {f"{a}__vs__{b}": stats(res[a], res[b]) for a, b in pairs if a in res and b in res}

    r5 = lambda v: round(v, 5)  # noqa: E731
    floor_hf = mean_abs(res["hf_bf16_f32h"], ref)
    floor_mg = mean_abs(res[trainer], ref)
    bf16_floor = (floor_hf + floor_mg) / 2
    pair_floor = mean_abs(res["hf_bf16_f32h"], res[trainer])
    floor = {
        "bf16_floor": r5(bf16_floor),
        "floor_definition": f"mean(|hf_bf16_f32h - ref|, |{trainer} - ref|)",
        "floor_hf_bf16_vs_ref": r5(floor_hf),
        "floor_mg_bf16_vs_ref": r5(floor_mg),
        "floor_pair_hf_vs_mg": r5(pair_floor),
    }
    gap = {}
    if args.sglang:
        sg = "sglang" if "sglang" in res else "sglang_tf"  # sampling-time logprobs when SGLang sampled
        g = mean_abs(res[sg], res[trainer])
        gap = {
            "gap": r5(g),
            "bf16_floor": r5(bf16_floor),
            "gap_vs_floor": round(g / bf16_floor, 3),
            "goal": 1.2,
            "ok": g / bf16_floor <= 1.2,
            "gap_sglang_vs_ref": r5(mean_abs(res[sg], ref)),
            "gap_variant": f"|{sg} - {trainer}|",
            "gap_vs_pair_floor": round(g / pair_floor, 3),
        }
        if "sglang_tf" in res:
            gap["gap_teacher_forced"] = r5(mean_abs(res["sglang_tf"], res[trainer]))
            gap["gap_teacher_forced_vs_floor"] = round(gap["gap_teacher_forced"] / bf16_floor, 3)
        if "sglang" in res and "sglang_tf" in res:
            gap["sglang_sampling_vs_teacher_forced"] = r5(mean_abs(res["sglang"], res["sglang_tf"]))

    where = f"GPU ({torch.cuda.get_device_name(0)})" if cuda else "CPU"
    print(f"model: {path}  (SmolLM2-135M-Instruct, 30 layers), {where}, torch {torch.__version__}")
    print(
        f"{len(seqs)} responses, {n_tok} response tokens (sampled T=1 from "
        f"{'SGLang bf16' if sample_with == 'sglang' else 'HF fp32'}), mean ref logp {ref.mean().item():.3f}; "
        f"head check (fp32 hidden@W vs logits) {head_check:.1e}"
    )
    if not cuda:
        print("NOTE: CPU bf16 kernels differ from GPU kernels (cuBLAS / flash attention / fused norms);")
        print(
            "      these numbers measure bf16 implementation noise for this model on CPU, not the GPU pair."
        )
    print(f"\n{'vs fp32 ref':<34}{'mean|d|':>10}{'p90|d|':>10}{'max|d|':>10}{'mean d':>10}")
    for k, s in vs_ref.items():
        print(
            f"{k:<34}{s['mean_abs']:>10.2e}{s['p90_abs']:>10.2e}{s['max_abs']:>10.2e}{s['mean_signed']:>10.2e}"
        )
    print(f"\n{'pairwise':<46}{'mean|d|':>10}{'p90|d|':>10}{'max|d|':>10}{'mean d':>10}")
    for k, s in pairwise.items():
        print(
            f"{k:<46}{s['mean_abs']:>10.2e}{s['p90_abs']:>10.2e}{s['max_abs']:>10.2e}{s['mean_signed']:>10.2e}"
        )
    print(f"\nbf16 floor {floor['floor_definition']} = {bf16_floor:.4f}")
    if gap:
        print(
            f"gap {gap['gap_variant']} = {gap['gap']:.4f}: {gap['gap_vs_floor']:.2f}x the floor "
            f"(goal <= 1.2: {'ok' if gap['ok'] else 'MISSED'})"
        )
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        from megatron.core import package_info

        versions["megatron_core"] = package_info.__version__
    except ImportError:
        pass
    if "sglang_version" in extra:
        versions["sglang"] = extra.pop("sglang_version")
    out = {
        "bench": "gpu_logprobs" if args.sglang else "logp_precision",
        "model": "smollm2-135m-instruct",
        "prompts": len(seqs),
        "tokens": n_tok,
        "response_tokens": n_tok,
        "max_new_tokens": max_new,
        "seed": args.seed,
        "sampled_by": "sglang_bf16" if sample_with == "sglang" else "hf_fp32",
        **gap,
        **floor,
        "trainer_variant": trainer,
        "mean_ref_logp": round(ref.mean().item(), 4),
        "vs_fp32_ref": vs_ref,
        "pairwise": pairwise,
        **extra,
        "versions": versions,
        "build_s": round(t_build, 1),
        "gen_s": round(t_gen, 1),
        "wall_s": round(time.time() - t0, 1),
        "device": f"1x {torch.cuda.get_device_name(0)}" if cuda else "cpu",
        "date": utc_now(),
    }
    if not args.sglang:
        out["gpu_measured_mg_vs_sglang_bf16"] = 0.033
    from _results import record  # bench/ is on sys.path when a bench runs

    record(out, args.results or None)


if __name__ == "__main__":
    main()
