"""Core attention for megatron's local layer spec through torch's scaled_dot_product_attention.

Megatron's local `DotProductAttention` materialises the scores Q·K^T in the activation dtype: in bf16
every score is rounded to 8 bits of mantissa before the (fp32) softmax. SGLang's attention kernels
keep the scores in fp32, so the two disagree on every token's logprob; fused SDPA kernels keep them in
fp32 too. Same inputs, outputs and mask convention as DotProductAttention (its constructor is reused),
so it drops into the local spec as `core_attention`. The transformer-engine spec has its own fused
attention and does not use this.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
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
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if rep > 1:  # grouped-query attention: every query head gets its group's key/value
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:  # the parent folds 1/layer into the scale
            scale *= self.layer_number
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
