"""Megatron layer specs for the mapped HF families: megatron's local or transformer-engine layer spec
with this trainer's core attention, plus what a family adds (GLM4's post-norms, MoE layers) and the
norms sequence parallelism needs.

The result is always one TransformerBlockSubmodules for this pipeline stage's layers, so layers may
differ within a model (dense and MoE layers of a Qwen3-MoE with `mlp_only_layers`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, as megatron's local spec builds it, for sequence parallelism, which megatron's
    wrapper of it refuses. Under SP a norm sees only this rank's positions, so its weight's gradient is
    partial: marked `sequence_parallel`, megatron's finalize_model_grads sums it over the TP group (the
    q/k norms, which see this rank's heads, are summed by their names already)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


class PostNorm(torch.nn.RMSNorm):
    """An RMSNorm over the hidden size on a block's output. That output is whole along the hidden dim
    after linear_proj / linear_fc2 (all-reduced over TP, or reduce-scattered along the sequence under
    SP, where the weight's gradient is partial and so marked for the TP sum, as above)."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)
        self.weight.sequence_parallel = config.sequence_parallel

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Checkpoint entries (replicated over TP): megatron's MLP asks each child for them."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(  # the TP group makes TP ranks replicas
            state,
            prefix,
            {},
            sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


class PostNormSelfAttention(SelfAttention):
    """Self-attention whose output goes through an RMSNorm before the residual add (GLM4's
    `post_self_attn_layernorm`), which megatron's TransformerLayer has no slot for."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = PostNorm(config)

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:  # a bias would be added after the norm by the bias-dropout-add
            raise NotImplementedError("post-norm attention with a linear_proj bias is not mapped")
        return self.post_layernorm(out), None


class PostNormMLP(MLP):
    """The MLP with an RMSNorm on its output (GLM4's `post_mlp_layernorm`).

    megatron's TransformerLayer passes the TP group only to an MLP of exactly class MLP and warns
    "Unknown MLP type" for a subclass; it gets the global TP group here, the same group
    (`quiet_unknown_mlp` drops that warning)."""

    def __init__(self, config: TransformerConfig, *args, tp_group=None, **kwargs):
        from megatron.core import parallel_state as ps

        tp_group = tp_group or ps.get_tensor_model_parallel_group()
        super().__init__(config, *args, tp_group=tp_group, **kwargs)
        self.post_layernorm = PostNorm(config)

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:
            raise NotImplementedError("post-norm MLP with a linear_fc2 bias is not mapped")
        return self.post_layernorm(out), None


class _DropUnknownMLP(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def quiet_unknown_mlp():
    """Around building a model with PostNormMLP layers: megatron's warning about them is expected."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")
    f = _DropUnknownMLP()
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


def _layer_spec(cfg: TransformerConfig, *, te: bool, core_attention, moe: bool, grouped_experts: bool):
    """One layer: megatron's spec with the trainer's core attention (local spec only); an MoE layer's
    experts as GroupedExperts (`grouped_experts`) or megatron's SequentialMLP, a loop over them."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = cfg.num_moe_experts if moe else None
    if te:  # TE's grouped GEMM runs all local experts in one kernel
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=moe, qk_layernorm=cfg.qk_layernorm
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm
    )
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    if moe and grouped_experts:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from stages.trainer.grouped_experts import GroupedExperts

        spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    return spec


def _sequence_parallel_norms(spec) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for sub in (spec.submodules, spec.submodules.self_attention.submodules):
        for name, value in vars(sub).items():
            if value is WrappedTorchNorm:
                setattr(sub, name, SequenceParallelRMSNorm)


def decoder_block_spec(
    hc,
    cfg: TransformerConfig,
    *,
    te: bool,
    core_attention=None,
    moe_layers: list[bool] | None = None,
    grouped_experts: bool = False,
):
    """This stage's layers as TransformerBlockSubmodules.

    `core_attention`: the local spec's attention class (None keeps megatron's DotProductAttention);
    `moe_layers`: per global layer, whether it is an MoE layer (None: all dense); `grouped_experts`:
    the local spec's MoE layers run their experts as grouped GEMMs (stages/trainer/grouped_experts.py).
    """
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from stages.trainer import hf_mapping

    if cfg.sequence_parallel and te:
        raise ValueError("sequence parallelism here is built on the local spec; set trainer.layer_spec=local")
    if cfg.sequence_parallel and cfg.normalization != "RMSNorm":
        raise ValueError(f"sequence parallelism here supports RMSNorm models, not {cfg.normalization}")
    offset = get_transformer_layer_offset(cfg)
    layers = []
    for i in range(offset, offset + get_num_layers_to_build(cfg)):
        moe = bool(moe_layers and moe_layers[i])
        spec = _layer_spec(
            cfg, te=te, core_attention=core_attention, moe=moe, grouped_experts=grouped_experts
        )
        if hf_mapping.post_norms(hc):
            spec.submodules.self_attention.module = PostNormSelfAttention
            if moe:
                raise ValueError(f"{hc.model_type}: post-MLP norms on MoE layers are not mapped")
            spec.submodules.mlp.module = PostNormMLP
        if cfg.sequence_parallel:
            _sequence_parallel_norms(spec)
        layers.append(spec)
    final = SequenceParallelRMSNorm if cfg.sequence_parallel else LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final)
