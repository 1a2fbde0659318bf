"""Tiny random HF checkpoints of the families that `testing.make_tiny_hf` does not build: Llama with
Llama-3.1 RoPE scaling, GLM4 (dense), Qwen3-MoE, Qwen2-MoE and GLM4-MoE, for the mapping tests and
parallel checks.

HF initialises norm weights to 1 and biases to 0, so a norm or bias mapped to the wrong place would
not change the logits; here they are random (GLM's routing bias too, large enough to change choices).
"""

from __future__ import annotations

from stages.trainer.testing import TINY

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # 64 (not Llama-3.1's 8192): the 8 frequencies of a 16-dim head then fall in all three bands
    # (kept, interpolated, divided by the factor), and megatron's own llama3 scaling, which hard-codes
    # 8192, would give other frequencies
    "original_max_position_embeddings": 64,
}

TINY_MOE = dict(
    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
# Qwen2-MoE: a shared expert of its own width behind a sigmoid gate; softmax top-k not renormalised
TINY_QWEN2_MOE = dict(TINY_MOE, norm_topk_prob=False, shared_expert_intermediate_size=48)
# GLM4-MoE: 8 experts in 4 groups, 2 groups kept per token, top-4 (= 2 * topk_group, which megatron's
# group scores need), a dense first layer, one shared expert, qk-norm, q/k/v biases, half-rotary RoPE
TINY_GLM4_MOE = dict(
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=4,
    moe_intermediate_size=16,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    n_shared_experts=1,
    use_qk_norm=True,
    attention_bias=True,
    pad_token_id=0,
    eos_token_id=1,
)


def _save_random(model, path: str) -> str:
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif n.endswith("mlp.gate.weight"):  # HF starts the router at zero: every expert tied
                p.normal_(0.0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # a buffer, zero in HF: no choice would change
                b.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def make_tiny(path: str, kind: str, seed: int = 1, **overrides) -> str:
    """kind: "llama3.1", "glm4", "qwen3_moe" (4 experts, top-2, 2 layers), "qwen2_moe" (the same plus
    a gated shared expert) or "glm4_moe" (TINY_GLM4_MOE); `overrides` go to the HF config, e.g.
    norm_topk_prob=False, mlp_only_layers=[0]."""
    import torch
    import transformers as tf

    kw = dict(TINY, tie_word_embeddings=False)
    if kind == "llama3.1":
        cls, kw["rope_parameters"] = (tf.LlamaConfig, tf.LlamaForCausalLM), dict(LLAMA3_ROPE)
    elif kind == "glm4":  # its defaults: qkv biases, half-rotary interleaved RoPE, post-norms
        cls = (tf.Glm4Config, tf.Glm4ForCausalLM)
        kw.update(head_dim=16, pad_token_id=0, eos_token_id=1)
    elif kind == "qwen3_moe":
        cls = (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)
        kw.update(TINY_MOE)
    elif kind == "qwen2_moe":
        cls = (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM)
        kw.update(TINY_QWEN2_MOE)
    elif kind == "glm4_moe":
        cls = (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM)
        kw.update(TINY_GLM4_MOE)
    else:
        raise ValueError(f"unknown tiny family {kind!r}: llama3.1, glm4, qwen3_moe, qwen2_moe or glm4_moe")
    kw.update(overrides)
    torch.manual_seed(seed)
    return _save_random(cls[1](cls[0](**kw)), path)
