"""HF Llama / Qwen2 / Qwen3 <-> megatron-core GPTModel (local or TE spec) weight mapping.

megatron-core ships no HF converter, so this is ours. Layouts (checked against transformers' logits):
  * `linear_qkv` rows are grouped per KV group: [q heads of the group; k; v], groups one after the
    other; TP gives each rank whole groups. Qwen2's q/k/v biases follow the same grouping.
  * `linear_fc1` is cat(gate, up); under TP each rank holds cat(gate_r, up_r).
  * local-spec norms: `input_layernorm`, `pre_mlp_layernorm`; the TE spec fuses them into the next
    linear as `layer_norm_weight` (handled by `_norm_keys`).
  * tied embeddings: no HF `lm_head.weight`; with PP > 1 the last stage still owns an
    `output_layer.weight` copy that megatron keeps equal to the embedding (shared-embedding group).
  * Qwen3 qk-norm: `q_layernorm` / `k_layernorm` (per head dim).

Functions here take/return plain tensors for one rank (`tp`, `tp_rank`); gathering lives in model.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def rope_theta(hc) -> float:
    params = getattr(hc, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(hc, "rope_theta", 10000.0))


def check_supported(hc) -> None:
    if hc.model_type not in SUPPORTED:
        raise ValueError(
            f"model_type {hc.model_type!r} is not supported by the megatron trainer "
            f"(supported: {', '.join(SUPPORTED)}); use a Llama/Qwen2/Qwen3-style checkpoint"
        )
    params = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    rope_type = (
        params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    )
    if rope_type not in ("default", None):
        raise ValueError(
            f"rope type {rope_type!r} is not mapped to megatron yet; only plain RoPE is supported"
        )
    if getattr(hc, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hc.hidden_act!r}: only SwiGLU (silu) MLPs are mapped")


def head_dim(hc) -> int:
    return getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads


def qkv_bias(hc) -> bool:
    return hc.model_type == "qwen2" or bool(getattr(hc, "attention_bias", False))


def qk_norm(hc) -> bool:
    return hc.model_type == "qwen3"


def _norm_keys(te: bool) -> dict[str, str]:
    if te:
        return {
            "input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_weight",
        }
    return {"input_layernorm": "input_layernorm.weight", "pre_mlp_layernorm": "pre_mlp_layernorm.weight"}


def _group_qkv(q, k, v, hc, tp, r):
    nq, nkv, d = hc.num_attention_heads, hc.num_key_value_heads, head_dim(hc)
    rest = q.shape[1:]
    g = torch.cat(
        [q.reshape(nkv, nq // nkv * d, *rest), k.reshape(nkv, d, *rest), v.reshape(nkv, d, *rest)], 1
    )
    return g.chunk(tp, 0)[r].reshape(-1, *rest).contiguous()


def _ungroup_qkv(w, hc):
    """Full (TP-gathered) linear_qkv weight/bias -> (q, k, v) in HF layout."""
    nq, nkv, d = hc.num_attention_heads, hc.num_key_value_heads, head_dim(hc)
    rest = w.shape[1:]
    g = w.reshape(nkv, (nq // nkv + 2) * d, *rest)
    q, k, v = g.split([nq // nkv * d, d, d], 1)
    return q.reshape(nq * d, *rest), k.reshape(nkv * d, *rest), v.reshape(nkv * d, *rest)


def hf_to_mcore_layer(get: Callable[[str], torch.Tensor], hc, hf_i: int, tp: int, r: int, te: bool) -> dict:
    """One decoder layer: HF layer `hf_i` -> megatron keys (relative to `decoder.layers.{i}.`)."""
    p = f"model.layers.{hf_i}."

    def col(w):
        return w.chunk(tp, 0)[r].contiguous()

    def row(w):
        return w.chunk(tp, 1)[r].contiguous()

    norms = _norm_keys(te)
    out = {
        "self_attention.linear_qkv.weight": _group_qkv(
            *(get(p + f"self_attn.{n}_proj.weight") for n in "qkv"), hc, tp, r
        ),
        "self_attention.linear_proj.weight": row(get(p + "self_attn.o_proj.weight")),
        norms["input_layernorm"]: get(p + "input_layernorm.weight"),
        norms["pre_mlp_layernorm"]: get(p + "post_attention_layernorm.weight"),
        "mlp.linear_fc1.weight": torch.cat(
            [col(get(p + "mlp.gate_proj.weight")), col(get(p + "mlp.up_proj.weight"))]
        ),
        "mlp.linear_fc2.weight": row(get(p + "mlp.down_proj.weight")),
    }
    if qkv_bias(hc):
        out["self_attention.linear_qkv.bias"] = _group_qkv(
            *(get(p + f"self_attn.{n}_proj.bias") for n in "qkv"), hc, tp, r
        )
    if qk_norm(hc):
        out["self_attention.q_layernorm.weight"] = get(p + "self_attn.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = get(p + "self_attn.k_norm.weight")
    return out


def padded_vocab(hc, tp: int) -> int:
    """The vocabulary megatron is built with: HF's, rounded up to a multiple of TP so every rank holds
    an equal shard (Qwen2.5's 151936 divides; a byte-level 259 does not). The padded rows are zero,
    masked out of every softmax (lm_head.head_logprobs) and trimmed on export."""
    return -(-hc.vocab_size // tp) * tp


def _vocab_rows(w: torch.Tensor, hc, tp: int, r: int) -> torch.Tensor:
    """Rank r's shard of an embedding / LM-head matrix [V, h], zero-padded to padded_vocab rows."""
    pad = padded_vocab(hc, tp) - w.shape[0]
    if pad:
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
    return w.chunk(tp, 0)[r].contiguous()


def hf_to_mcore(get, hc, *, tp, r, layers: list[int], pre: bool, post: bool, te: bool = False) -> dict:
    """HF tensors (by name, via `get`) -> local megatron state dict for one TP rank of one PP stage.

    `layers` are the global (0-based) HF layer indices of this stage's local layers, in order.
    """
    out: dict[str, torch.Tensor] = {}
    tied = hc.tie_word_embeddings
    if pre:
        out["embedding.word_embeddings.weight"] = _vocab_rows(get("model.embed_tokens.weight"), hc, tp, r)
    if post:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        # tied + PP>1: the last stage's output_layer is a copy of the embedding; tied + PP=1: no key
        if not tied or not pre:
            src = "model.embed_tokens.weight" if tied else "lm_head.weight"
            out["output_layer.weight"] = _vocab_rows(get(src), hc, tp, r)
    for local_i, hf_i in enumerate(layers):
        for k, v in hf_to_mcore_layer(get, hc, hf_i, tp, r, te).items():
            out[f"decoder.layers.{local_i}.{k}"] = v
    return out


# -- export -------------------------------------------------------------------------------------------
# How each megatron parameter is split across TP ranks: dim to concatenate along, or a special layout.
def tp_layout(key: str) -> str:
    if key.endswith("linear_qkv.weight") or key.endswith("linear_qkv.bias"):
        return "qkv"
    if key.endswith("linear_fc1.weight"):
        return "fc1"
    if key.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "col"
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"  # norms (and qk-norms) are full on every rank


def merge_tp(key: str, shards: list[torch.Tensor], hc) -> torch.Tensor:
    """TP shards of one megatron parameter -> the full tensor."""
    layout = tp_layout(key)
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout in ("col", "qkv"):  # qkv: each rank holds whole KV groups, so rows concatenate
        return torch.cat(shards, 0)
    if layout == "row":
        return torch.cat(shards, 1)
    gates, ups = zip(*(s.chunk(2, 0) for s in shards))  # fc1: rank r holds [gate_r; up_r]
    return torch.cat([torch.cat(gates, 0), torch.cat(ups, 0)], 0)


def mcore_to_hf(
    key: str, full: torch.Tensor, hc, hf_layer: int | None, te: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """One full (TP-merged) megatron parameter -> HF (name, tensor) pairs. [] for keys HF does not have."""
    if key == "embedding.word_embeddings.weight":  # TP padding rows trimmed (padded_vocab)
        return [("model.embed_tokens.weight", full[: hc.vocab_size])]
    if key == "decoder.final_layernorm.weight":
        return [("model.norm.weight", full)]
    if key == "output_layer.weight":
        return [] if hc.tie_word_embeddings else [("lm_head.weight", full[: hc.vocab_size])]
    if hf_layer is None:
        raise KeyError(f"megatron parameter {key!r} has no HF counterpart in the mapping")
    p = f"model.layers.{hf_layer}."
    sub = key.split(".", 3)[3]  # strip decoder.layers.{i}.
    inv_norms = {v: k for k, v in _norm_keys(te).items()}
    if sub in inv_norms:
        hf = "input_layernorm" if inv_norms[sub] == "input_layernorm" else "post_attention_layernorm"
        return [(p + hf + ".weight", full)]
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        return [(p + f"self_attn.{n}_proj.{kind}", t) for n, t in zip("qkv", _ungroup_qkv(full, hc))]
    if sub == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, 0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    simple = {
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    }
    if sub in simple:
        return [(p + simple[sub], full)]
    raise KeyError(f"megatron parameter {key!r} has no HF counterpart in the mapping")
