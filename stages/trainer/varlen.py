"""Causal attention over packed sequences, torch only (no megatron, no transformers): FlashAttention's
varlen kernel where torch has it, SDPA one sequence at a time elsewhere. Both trainer backends use it:
megatron's core attention (attention.VarlenAttention) and the fsdp backend's transformers models
(hf_varlen.py). q, k, v are [t, heads, head_dim] with the sequences' boundaries in `cu` (cumulative
lengths, int32, [k + 1])."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn

    HAVE_VARLEN = True
    # the signature moved between torch releases: 2.10/2.11 take is_causal, later ones window_size
    # and enable_gqa
    _VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch < 2.10
    HAVE_VARLEN = False
    _VARLEN_ARGS = set()


def varlen_available() -> bool:
    """FlashAttention varlen kernels: torch >= 2.10 on a CUDA device."""
    return HAVE_VARLEN and torch.cuda.is_available()


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """FlashAttention varlen, causal; for a sequence with fewer queries than keys the mask is aligned
    bottom-right (the last query sees every key), FlashAttention 2's convention."""
    kw = {"scale": scale}
    kw.update({"window_size": (-1, 0)} if "window_size" in _VARLEN_ARGS else {"is_causal": True})
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        if "enable_gqa" in _VARLEN_ARGS:
            kw["enable_gqa"] = True
        else:  # FlashAttention takes fewer KV heads natively; this API version does not say so
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def per_segment_sdpa(q, k, v, cu, scale):
    """The same attention by SDPA with a plain causal mask per sequence (CPU, fp32, old torch)."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [heads, s, hn]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def packed_attention(q, k, v, cu, max_len: int, scale: float):
    """flash_varlen where it runs (CUDA, bf16/fp16, torch >= 2.10), else per_segment_sdpa."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and HAVE_VARLEN:
        return flash_varlen(q, k, v, cu, cu, max_len, max_len, scale=scale)
    return per_segment_sdpa(q, k, v, cu, scale)
