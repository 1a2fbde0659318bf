"""The mapped MoE families' routing and shared experts as megatron-core TransformerConfig keys, and
what of them megatron cannot express (refused at load, naming the field and the fix).

Routing, as transformers computes it and as megatron's `topk_routing_with_score_function` does:
  * qwen3_moe, qwen2_moe: softmax router, top-k. With `norm_topk_prob` the k weights are
    renormalised, which is megatron's softmax over the top-k logits (`moe_router_pre_softmax=False`);
    without it they are the full softmax's values (`pre_softmax=True`).
  * glm4_moe (GLM-4.5 / 4.6 / Air): sigmoid scores; the experts are chosen on score +
    `e_score_correction_bias` (megatron's `expert_bias`, which it would move toward balanced loads after
    every step: the update rate is 0 here, so the trainer routes with the checkpoint's bias, as the engine
    does), the weights are the plain scores at the chosen experts, renormalised, then times
    `routed_scaling_factor` (megatron: `moe_router_topk_scaling_factor`, applied after the
    renormalisation as in transformers). Group-limited top-k (`n_group` / `topk_group`): transformers
    ranks groups by the sum of each group's top-2 biased scores; megatron sums the top
    `topk // group_topk`, the same only where that is 2.
Shared experts: qwen2_moe's `shared_expert` (its own width) times sigmoid(`shared_expert_gate` . x)
(megatron's SharedExpertMLP with `moe_shared_expert_gate`); glm4_moe's `shared_experts`, no gate,
`n_shared_experts * moe_intermediate_size` wide. Dense layers: stages.models.moe_layer_flags.

No imports of hf_mapping, model or specs here (tests/test_layers.py keeps the layers acyclic).
"""

from __future__ import annotations

from stages.models import moe_layer_flags

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "glm4_moe")
SIGMOID_TYPES = ("glm4_moe",)


def is_moe(hc) -> bool:
    return hc.model_type in MOE_TYPES


def num_experts(hc) -> int:
    """Routed experts per MoE layer, from an HF config or its config.json dict: Qwen's `num_experts`
    (transformers 5 writes `num_local_experts`), GLM's `n_routed_experts`."""
    get = hc.get if isinstance(hc, dict) else lambda k, d=None: getattr(hc, k, d)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if get(name, None):
            return int(get(name))
    raise ValueError(f"{get('model_type', '?')}: the config names no number of experts")


def shared_expert_size(hc) -> int | None:
    """The shared expert MLP's width (None: the family has none)."""
    if hc.model_type == "qwen2_moe":
        return hc.shared_expert_intermediate_size
    if hc.model_type == "glm4_moe":
        return hc.n_shared_experts * hc.moe_intermediate_size
    return None


def sigmoid_router(hc) -> bool:
    return hc.model_type in SIGMOID_TYPES


def _group_limit(hc) -> tuple[int, int] | None:
    """(num_groups, group_topk) where group-limited routing restricts anything; None where all groups
    are always kept (one group, or as many picked as there are), which is plain top-k."""
    groups, picked = getattr(hc, "n_group", None) or 1, getattr(hc, "topk_group", None) or 1
    if groups <= 1 or picked >= groups:
        return None
    return groups, picked


def check_supported(hc) -> None:
    if not is_moe(hc):
        return
    t, k = hc.model_type, hc.num_experts_per_tok
    if t == "qwen3_moe" and getattr(hc, "shared_expert_intermediate_size", 0):
        raise ValueError(f"{t}: shared experts are not mapped (Qwen3-MoE has none)")
    size = shared_expert_size(hc)
    if size is not None and size <= 0:
        # transformers still builds a zero-width shared expert; megatron's SharedExpertMLP needs a width
        field = "shared_expert_intermediate_size" if t == "qwen2_moe" else "n_shared_experts"
        raise ValueError(f"{t}: {field}=0 (no shared expert) is not mapped; a checkpoint with one is needed")
    if not sigmoid_router(hc):
        if k == 1 and hc.norm_topk_prob:
            # one renormalised weight is always 1; megatron's softmax over one logit has no gradient
            raise ValueError(f"{t}: top-1 routing with norm_topk_prob=true is not mapped")
        return
    if not hc.norm_topk_prob and k > 1:
        raise ValueError(
            f"{t}: norm_topk_prob=false is not mapped: megatron's sigmoid router always renormalises "
            "the top-k scores; a checkpoint trained with norm_topk_prob=true is needed"
        )
    if k == 1:  # transformers' weight is s / (s + 1e-20) = 1, megatron's the score s
        raise ValueError(f"{t}: top-1 routing (num_experts_per_tok=1) with a sigmoid router is not mapped")
    limit = _group_limit(hc)
    if limit is not None:
        groups, picked = limit
        if num_experts(hc) % groups:
            raise ValueError(f"{t}: n_group={groups} does not divide the {num_experts(hc)} experts")
        if k != 2 * picked:
            raise ValueError(
                f"{t}: group-limited routing with n_group={groups}, topk_group={picked} and "
                f"num_experts_per_tok={k} is not mapped: transformers ranks groups by their top-2 scores, "
                f"megatron by their top num_experts_per_tok/topk_group = {k // picked}; "
                "it matches only where num_experts_per_tok = 2 * topk_group (or n_group=1)"
            )


def config_kwargs(hc, *, te: bool, aux_loss_coef: float = 0.0, capacity_factor: float | None = None) -> dict:
    """TransformerConfig keys of an MoE model; EP and ETP come from the initialised groups."""
    from megatron.core import parallel_state as ps

    if aux_loss_coef < 0:
        raise ValueError("trainer.moe_aux_loss_coef must be >= 0 (0: no load-balancing loss)")
    layers = moe_layer_flags(hc)  # dense ones are MLPs of `intermediate_size`
    experts, ep = num_experts(hc), ps.get_expert_model_parallel_world_size()
    if experts % ep:
        raise ValueError(f"trainer.ep={ep} does not divide the model's {experts} experts")
    kw = dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=hc.moe_intermediate_size,
        moe_layer_freq=[int(x) for x in layers],
        moe_router_topk=hc.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not hc.norm_topk_prob,
        # the router's logits, scores and top-k in fp32 whatever the model's precision: a bf16 router
        # flips near-tied experts, and a flipped expert is a different token path from the engine's
        moe_router_dtype="fp32",
        # RL keeps the router as the engine has it: no balancing loss unless asked for
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coef,
        # dropless by default: a dropped token's logprob is not the engine's
        moe_expert_capacity_factor=capacity_factor,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=te,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )
    if shared_expert_size(hc):
        kw.update(
            moe_shared_expert_intermediate_size=shared_expert_size(hc),
            moe_shared_expert_gate=hc.model_type == "qwen2_moe",
        )
    if sigmoid_router(hc):
        limit = _group_limit(hc)
        kw.update(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=True,
            # fixed: the engine routes with the checkpoint's bias, and so must the trainer's logprobs
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=float(hc.routed_scaling_factor),
            moe_router_num_groups=limit[0] if limit else None,
            moe_router_group_topk=limit[1] if limit else None,
        )
    return kw
