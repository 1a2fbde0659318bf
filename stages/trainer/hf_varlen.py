"""Packed-row attention for transformers models (the fsdp backend), without the flash-attn package:
registers `slipstream_varlen` as a transformers attention implementation that runs varlen.packed_attention
(torch's FlashAttention varlen kernel on CUDA in bf16, SDPA per sequence elsewhere) over one packed row.

Why: transformers' own varlen path is `flash_attention_2`, which needs the flash-attn package (no wheel
for torch 2.11 here); its sdpa path turns packed position ids into an s x s block mask, which at 16k-token
micro-batches costs memory and takes SDPA off its flash kernel. The segment boundaries come as
`cu_seq_lens_q` / `max_length_q`, the keyword arguments transformers forwards to every attention call
(FlashAttentionKwargs). Families with sliding windows or logit soft-capping are not covered (refused by
name); fsdp_model.load_lm keeps sdpa for them under trainer.attention=auto."""

from __future__ import annotations

import torch

from stages.trainer.varlen import packed_attention

VARLEN = "slipstream_varlen"


def _attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kw,
):
    """transformers' attention interface: query [1, heads, t, d], key/value [1, kv_heads, t, d] ->
    ([1, t, heads, d], None)."""
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            f"{type(module).__name__}: {VARLEN} has no sliding window or soft-capping; use trainer.attention=sdpa"
        )
    if dropout:
        raise NotImplementedError(f"{VARLEN} has no attention dropout (the trainer turns dropout off)")
    cu = kw.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN} takes one packed row (batch 1) with cu_seq_lens_q; got batch {query.shape[0]}"
        )
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [t, heads, d]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return packed_attention(q, k, v, cu, int(kw["max_length_q"]), scale).unsqueeze(0), None


def register() -> str:
    """Make `VARLEN` a valid attn_implementation (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(VARLEN, _attention)
    # no mask: the boundaries are in cu_seq_lens; flash_attention_2's mask function returns none for
    # unpadded input, as this path has
    AttentionMaskInterface.register(VARLEN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return VARLEN


def packed_kwargs(cu_seqlens: torch.Tensor | None, max_segment_len: int) -> dict:
    """The keyword arguments that carry one packed row's boundaries to `_attention`: the micro-batch's
    own (packing.MicroBatch.cu_seqlens and max_segment_len, the padding tail a segment of its own), as
    megatron's varlen attention takes them."""
    if cu_seqlens is None:
        raise ValueError(
            f"{VARLEN} attends one packed row by its boundaries: pass the micro-batch's cu_seqlens"
        )
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_segment_len,
        "max_length_k": max_segment_len,
    }


def uses_window_or_softcap(config) -> bool:
    """Whether an HF config's attention is anything but plain causal attention in some layer: a sliding
    window, chunked attention, another layer type, or logit soft-capping."""
    cfgs = [config] + ([config.text_config] if getattr(config, "text_config", None) is not None else [])
    for c in cfgs:
        if getattr(c, "attn_logit_softcapping", None):
            return True
        if any(t != "full_attention" for t in getattr(c, "layer_types", None) or ()):
            return True  # sliding, chunked or linear attention layers: plain causal is not theirs
        if getattr(c, "attention_chunk_size", None):
            return True
        if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
            return True
    return False
