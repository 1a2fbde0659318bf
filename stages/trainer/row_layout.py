"""How a packed micro-batch is fed to megatron's attention: a block-diagonal causal mask over segments
(sdpa / unfused layouts) or PackedSeqParams over cu_seqlens (varlen / te layouts)."""

from __future__ import annotations

import torch


def causal_block_mask(segments: torch.Tensor) -> torch.Tensor:
    """Segment ids [b, s] -> boolean mask [b, 1, s, s], True = masked (megatron's convention).

    Packed sequences see only earlier tokens of their own segment. Because RoPE scores depend only
    on the relative position, a sequence packed at any offset gets the same logits as alone (W3: the
    explicit mask also keeps megatron from building its default mask on "cuda").
    """
    s = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return ~(same & causal)[:, None]


def packed_row_params(mb, layout: str, device):
    """PackedSeqParams for a packed-row micro-batch (layout "varlen" or "te").

    te: megatron's 'thd' format, which TE's attention and RoPE understand (positions restart per
    sequence). varlen: the 'sbhd' layout with a batch of one, so megatron's RoPE runs over the row as
    one sequence; `max_seqlen_q` is therefore the row length (megatron sizes the rotary table from
    it), and the longest segment, which the kernel needs, travels as `max_segment_len`.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(device)
    if layout == "te":
        n = mb.max_segment_len
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n
        )
    t = mb.segments.numel()  # the whole row, also where a context-parallel rank holds part of it
    params = PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t, max_seqlen_kv=t
    )
    params.max_segment_len = mb.max_segment_len
    return params
