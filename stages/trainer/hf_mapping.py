"""HF Llama / Qwen2 / Qwen3 / Mistral / GLM4 / Qwen3-MoE / Qwen2-MoE / GLM4-MoE <-> megatron-core GPTModel
(local or TE spec)
weight mapping.

megatron-core ships no HF converter, so this is ours. Layouts (checked against transformers' logits):
  * `linear_qkv` rows are grouped per KV group: [q heads of the group; k; v], groups one after the
    other; TP gives each rank whole groups. Qwen2's q/k/v biases follow the same grouping.
  * `linear_fc1` is cat(gate, up); under TP each rank holds cat(gate_r, up_r). GLM4's fused
    `gate_up_proj` is that same cat(gate, up).
  * local-spec norms: `input_layernorm`, `pre_mlp_layernorm`; the TE spec fuses them into the next
    linear as `layer_norm_weight` (handled by `_norm_keys`).
  * tied embeddings: no HF `lm_head.weight`; with PP > 1 the last stage still owns an
    `output_layer.weight` copy that megatron keeps equal to the embedding (shared-embedding group).
  * Qwen3 qk-norm: `q_layernorm` / `k_layernorm` (per head dim).
  * GLM4's norms after attention and after the MLP: `self_attention.post_layernorm`,
    `mlp.post_layernorm` (stages/trainer/specs.py adds them); its RoPE is interleaved and covers half
    of each head (`rotary_percent`).
  * Llama-3.1 RoPE scaling (`rope_type: llama3`): the inverse frequencies are computed here
    (`rope_inv_freq`), because megatron's own llama3 scaling hard-codes low/high frequency factors
    1 / 4 and an original context of 8192 and takes only the factor.
  * GLM4-MoE (GLM-4.5/4.6/Air): plain (not interleaved) RoPE over `partial_rotary_factor` of each
    head, q/k/v biases with `attention_bias`, qk-norm with `use_qk_norm`, no post-norms; its first
    `first_k_dense_replace` layers are dense MLPs with separate gate/up projections.
  * MoE routers, shared experts and experts, under expert parallelism too: stages/trainer/moe.py
    (routing and what is refused: stages/trainer/moe_config.py).

Functions here take/return plain tensors for one rank (`tp`, `tp_rank`); gathering lives in export.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from stages.models import moe_layer_flags
from stages.trainer import moe

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "glm4", "qwen3_moe", "qwen2_moe", "glm4_moe")
PARTIAL_ROTARY = ("glm4", "glm4_moe")  # the families whose transformers code rotates part of a head
ROPE_TYPES = ("default", "llama3")


def rope_parameters(hc) -> dict:
    """The RoPE settings of an HF config as one dict (transformers 5 `rope_parameters`, or 4.x
    `rope_scaling` + `rope_theta` + `partial_rotary_factor` attributes)."""
    out: dict = {}
    for name in ("rope_scaling", "rope_parameters"):
        d = getattr(hc, name, None)
        if isinstance(d, dict):
            out.update(d)
    out.setdefault("rope_theta", getattr(hc, "rope_theta", None) or 10000.0)
    if getattr(hc, "partial_rotary_factor", None) is not None:
        out.setdefault("partial_rotary_factor", hc.partial_rotary_factor)
    out["rope_type"] = out.get("rope_type", out.get("type")) or "default"
    return out


def rope_theta(hc) -> float:
    return float(rope_parameters(hc)["rope_theta"])


def rotary_percent(hc) -> float:
    """Fraction of each head's dims that RoPE rotates (megatron's rotary_percent)."""
    return float(rope_parameters(hc).get("partial_rotary_factor") or 1.0)


def rotary_interleaved(hc) -> bool:
    """GLM4 rotates pairs (x0, x1), (x2, x3), ... (GPT-J style); the others rotate (x_i, x_i+d/2)."""
    return hc.model_type == "glm4"


def post_norms(hc) -> bool:
    """GLM4: an RMSNorm on the attention output and one on the MLP output, before each residual add."""
    return hc.model_type == "glm4"


def rope_inv_freq(hc) -> torch.Tensor | None:
    """The inverse frequencies RoPE must use when they are not megatron's plain ones; None otherwise.

    llama3: the formula of transformers' `_compute_llama3_parameters`: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, shorter than
    .. / high_freq_factor kept, the band between interpolated smoothly.
    """
    p = rope_parameters(hc)
    if p["rope_type"] != "llama3":
        return None
    dim = int(head_dim(hc) * rotary_percent(hc))
    base = float(p["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = p.get("original_max_position_embeddings") or hc.max_position_embeddings
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def check_supported(hc) -> None:
    """Refuse, at load time and naming the fix, what the mapping cannot express."""
    if hc.model_type not in SUPPORTED:
        raise ValueError(
            f"model_type {hc.model_type!r} is not supported by the megatron trainer "
            f"(supported: {', '.join(SUPPORTED)}); use a checkpoint of one of these families"
        )
    p = rope_parameters(hc)
    if p["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"{hc.model_type}: rope type {p['rope_type']!r} is not mapped to megatron (mapped: "
            f"{', '.join(ROPE_TYPES)}); a checkpoint with plain or Llama-3.1-style RoPE is needed"
        )
    if p["rope_type"] == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in p]
        if missing:
            raise ValueError(f"{hc.model_type}: rope_type llama3 without {missing} in its rope parameters")
    if rotary_percent(hc) != 1.0 and hc.model_type not in PARTIAL_ROTARY:
        raise ValueError(
            f"{hc.model_type}: partial_rotary_factor={rotary_percent(hc)} is mapped for glm4 only (dense "
            "or glm4_moe); transformers rotates the whole head for this family"
        )
    if getattr(hc, "use_sliding_window", False):
        raise ValueError(
            f"{hc.model_type}: use_sliding_window=true is not mapped (the trainer attends over whole "
            "sequences); set it false only if the checkpoint was trained without a window"
        )
    if getattr(hc, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hc.hidden_act!r}: only SwiGLU (silu) MLPs are mapped")
    moe.check_supported(hc)


def head_dim(hc) -> int:
    return getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads


def qkv_bias(hc) -> bool:
    if hc.model_type == "qwen2_moe":  # its own field, on by default
        return bool(getattr(hc, "qkv_bias", True))
    return hc.model_type == "qwen2" or bool(getattr(hc, "attention_bias", False))


def qk_norm(hc) -> bool:
    return hc.model_type in ("qwen3", "qwen3_moe") or (hc.model_type == "glm4_moe" and bool(hc.use_qk_norm))


def _norm_keys(te: bool, moe_layer: bool = False) -> dict[str, str]:
    if te and moe_layer:  # the TE spec's MoE layers keep a separate pre-MLP norm
        return {
            "input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm": "pre_mlp_layernorm.weight",
        }
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


def fuse_rows(layout: str, parts: list[torch.Tensor], hc, tp: int, r: int) -> torch.Tensor:
    """HF row blocks of one fused megatron linear -> TP rank r's rows of it: (q, k, v) -> linear_qkv's
    group-interleaved rows ("qkv"), (gate, up) -> linear_fc1's [gate_r; up_r] ("fc1"). Any tensor with
    those rows fits (a weight, or a LoRA B matrix of another width)."""
    if layout == "qkv":
        return _group_qkv(*parts, hc, tp, r)
    if layout == "fc1":
        return torch.cat([w.chunk(tp, 0)[r] for w in parts]).contiguous()
    raise ValueError(f"fuse_rows: layout {layout!r} is not a fused one (qkv, fc1)")


def split_rows(layout: str, full: torch.Tensor, hc) -> list[torch.Tensor]:
    """The inverse of fuse_rows on the TP-merged tensor (merge_tp): its HF row blocks."""
    if layout == "qkv":
        return list(_ungroup_qkv(full, hc))
    if layout == "fc1":
        return list(full.chunk(2, 0))
    raise ValueError(f"split_rows: layout {layout!r} is not a fused one (qkv, fc1)")


def _gate_up(get, hc, p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a dense MLP; GLM4 stores them fused as gate_up_proj = cat(gate, up)."""
    if hc.model_type == "glm4":
        return tuple(get(p + "mlp.gate_up_proj.weight").chunk(2, 0))
    return get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")


def hf_to_mcore_layer(
    get: Callable[[str], torch.Tensor], hc, hf_i: int, tp: int, r: int, te: bool, **ep
) -> dict:
    """One decoder layer: HF layer `hf_i` -> megatron keys (relative to `decoder.layers.{i}.`).
    `ep`: for MoE layers, ep / ep_rank / etp / etp_rank (moe.hf_to_mcore_moe)."""
    p = f"model.layers.{hf_i}."

    def col(w):
        return w.chunk(tp, 0)[r].contiguous()

    def row(w):
        return w.chunk(tp, 1)[r].contiguous()

    moe_layer = moe.is_moe(hc) and moe_layer_flags(hc)[hf_i]
    norms = _norm_keys(te, moe_layer)
    out = {
        "self_attention.linear_qkv.weight": _group_qkv(
            *(get(p + f"self_attn.{n}_proj.weight") for n in "qkv"), hc, tp, r
        ),
        "self_attention.linear_proj.weight": row(get(p + "self_attn.o_proj.weight")),
        norms["input_layernorm"]: get(p + "input_layernorm.weight"),
        norms["pre_mlp_layernorm"]: get(p + "post_attention_layernorm.weight"),
    }
    if moe_layer:
        ep = {"ep": 1, "ep_rank": 0, "etp": tp, "etp_rank": r, **ep}
        out.update(moe.hf_to_mcore_moe(get, hc, p, te=te, tp=tp, tp_rank=r, **ep))
    else:
        out["mlp.linear_fc1.weight"] = torch.cat([col(w) for w in _gate_up(get, hc, p)])
        out["mlp.linear_fc2.weight"] = row(get(p + "mlp.down_proj.weight"))
    if post_norms(hc):
        out["self_attention.post_layernorm.weight"] = get(p + "post_self_attn_layernorm.weight")
        out["mlp.post_layernorm.weight"] = get(p + "post_mlp_layernorm.weight")
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


def hf_to_mcore(get, hc, *, tp, r, layers: list[int], pre: bool, post: bool, te: bool = False, **ep) -> dict:
    """HF tensors (by name, via `get`) -> local megatron state dict for one TP rank of one PP stage.

    `layers` are the global (0-based) HF layer indices of this stage's local layers, in order;
    `ep` (MoE): ep, ep_rank, etp, etp_rank of this rank (default: no EP, experts split like TP).
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
        for k, v in hf_to_mcore_layer(get, hc, hf_i, tp, r, te, **ep).items():
            out[f"decoder.layers.{local_i}.{k}"] = v
    return out


# -- export -------------------------------------------------------------------------------------------
_GROUPED_EXPERT = re.compile(r"(linear_fc[12]\.weight)\d+$")


# How each megatron parameter is split across TP ranks: dim to concatenate along, or a special layout.
def tp_layout(key: str) -> str:
    key = _GROUPED_EXPERT.sub(r"\1", key)  # TE grouped experts: linear_fc1.weight{i} is split as fc1
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
    """One full (TP-merged) megatron parameter -> HF (name, tensor) pairs. [] for keys HF does not have.
    Expert parameters come with their global expert index (moe.gather_experts)."""
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
    inv_norms = {v: k for keys in (_norm_keys(te), _norm_keys(te, moe_layer=True)) for k, v in keys.items()}
    if sub in inv_norms:
        hf = "input_layernorm" if inv_norms[sub] == "input_layernorm" else "post_attention_layernorm"
        return [(p + hf + ".weight", full)]
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        return [(p + f"self_attn.{n}_proj.{kind}", t) for n, t in zip("qkv", _ungroup_qkv(full, hc))]
    if sub == "mlp.linear_fc1.weight":
        if hc.model_type == "glm4":  # fused in HF too, in the same [gate; up] order
            return [(p + "mlp.gate_up_proj.weight", full)]
        gate, up = full.chunk(2, 0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    simple = {
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.post_layernorm.weight": "post_self_attn_layernorm.weight",
        "mlp.post_layernorm.weight": "post_mlp_layernorm.weight",
    }
    if sub in simple:
        return [(p + simple[sub], full)]
    pairs = moe.mcore_to_hf_moe(sub, full, p, hc) if moe.is_moe(hc) else None
    if pairs is not None:
        return pairs
    raise KeyError(f"megatron parameter {key!r} has no HF counterpart in the mapping")
