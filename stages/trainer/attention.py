"""Core attention for megatron's local layer spec through torch's scaled_dot_product_attention.

Megatron's local `DotProductAttention` materialises the scores Q·K^T in the activation dtype: in bf16
every score is rounded to 8 bits of mantissa before the (fp32) softmax. SGLang's attention kernels
keep the scores in fp32, so the two disagree on every token's logprob; fused SDPA kernels keep them in
fp32 too. Same inputs, outputs and mask convention as DotProductAttention (its constructor is reused),
so it drops into the local spec as `core_attention`. The transformer-engine spec has its own fused
attention and does not use this. VarlenAttention (below) is the GPU path: packed rows, no mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from stages.trainer.context_parallel import attend_local_queries, cp_info, gather_row, local_positions
from stages.trainer.varlen import HAVE_VARLEN, flash_varlen, per_segment_sdpa


class _ContextParallelOK(DotProductAttention):
    """DotProductAttention's constructor refuses context parallelism (megatron has it only in
    transformer-engine's attention). These subclasses do their own (stages/trainer/context_parallel.py),
    so they build with the check satisfied and keep the config as it is."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        cp = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp


def _scale(attn: DotProductAttention) -> float:
    """The softmax scale megatron's attention applies (it folds 1/layer into query-key layer scaling)."""
    scale = attn.softmax_scale
    if attn.config.apply_query_key_layer_scaling:
        scale *= attn.layer_number
    return scale


class SDPAttention(_ContextParallelOK):
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """[sq, b, np, hn] query, [sk, b, ng, hn] key/value, mask [b, 1, sq, sk] (True = masked) ->
        context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention takes a block mask, not packed_seq_params or a bias")
        if self.softmax_offset is not None or self.config.window_size is not None:
            raise NotImplementedError(
                "SDPAttention has no softmax offset or sliding window: use trainer.attention=unfused"
            )
        if attention_mask is None and (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            raise NotImplementedError("SDPAttention needs a mask unless the attention is causal")
        group, cp, cp_rank = cp_info()
        if cp > 1:  # local queries over the whole row's keys: the mask rows of this rank's positions
            if attention_mask is None:
                raise NotImplementedError("SDPAttention under context parallelism needs the block mask")
            key, value = gather_row(key, group, cp), gather_row(value, group, cp)
            mine = local_positions(key.shape[0], cp, cp_rank, query.device)
            attention_mask = attention_mask.index_select(2, mine)
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if rep > 1:  # grouped-query attention: every query head gets its group's key/value
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = _scale(self)
        ctx = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,  # SDPA: True = attend
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=attention_mask is None,
            scale=scale,
        )
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class VarlenAttention(_ContextParallelOK):
    """Causal attention over packed sequences without an s x s mask: one row [t, 1, heads, hn] holds
    several sequences whose boundaries come in `packed_seq_params.cu_seqlens_q` (flash attention's
    cumulative lengths). On CUDA with bf16/fp16 this is `torch.nn.attention.varlen.varlen_attn`
    (FlashAttention: O(t) memory, no masked-out work); elsewhere each sequence goes through SDPA
    with a plain causal mask, which gives the same numbers as the block-mask path on CPU.

    The row keeps continuous positions (megatron's 'sbhd' layout with a batch of one), which is
    exact under RoPE, whose scores depend only on relative positions within a sequence; see
    model.packed_row_params for why `max_seqlen_q` carries the row length.
    """

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None or getattr(packed_seq_params, "cu_seqlens_q", None) is None:
            raise ValueError(
                "VarlenAttention needs packed_seq_params with cu_seqlens (trainer.attention=varlen)"
            )
        if (
            attention_bias is not None
            or self.softmax_offset is not None
            or self.config.window_size is not None
        ):
            raise NotImplementedError("VarlenAttention has no bias, softmax offset or window: use 'sdpa'")
        if query.shape[1] != 1:
            raise ValueError(f"VarlenAttention takes one packed row (batch 1), got batch {query.shape[1]}")
        t = query.shape[0]
        q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [t, heads, hn]
        cu = packed_seq_params.cu_seqlens_q
        scale = _scale(self)
        flash = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and HAVE_VARLEN
        group, cp, cp_rank = cp_info()
        if cp > 1:  # this rank's positions of the row attend to the whole row's keys and values
            k, v = gather_row(k, group, cp), gather_row(v, group, cp)
            mine = local_positions(k.shape[0], cp, cp_rank, q.device)
            run = (lambda *a: flash_varlen(*a, scale=scale)) if flash else None
            ctx = attend_local_queries(q, k, v, cu, mine, scale, flash=run)
        elif flash:
            n = packed_seq_params.max_segment_len
            ctx = flash_varlen(q, k, v, cu, cu, n, n, scale=scale)
        else:
            ctx = per_segment_sdpa(q, k, v, cu, scale)
        return ctx.reshape(t, 1, self.hidden_size_per_partition)
