"""The policy as a megatron-core GPTModel: distributed setup, build from an HF folder, the attention
layout, and the LM head weight that stages/trainer/lm_head.py turns into per-token logprobs.

Build order matters: GPTModel (fp32) -> load HF weights -> Float16Module (bf16 only) -> megatron DDP
-> optimizer, because the optimizer takes its fp32 master copies from the parameters as they are
when it is created.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.models import moe_layer_flags
from stages.trainer import cpu_shim, hf_mapping, moe
from stages.trainer.config import LoraConfig
from stages.trainer.world import join_world


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    seed: int = 0,
    timeout_s: float = 600.0,
    cp: int = 1,
    ep: int | None = None,
    etp: int | None = None,
) -> None:
    """Join (or create) the process group and megatron's model-parallel groups (TP, PP, CP; DP is what
    is left of the world; for MoE models EP and ETP, which split the experts over tp*cp*dp ranks).

    Under torchrun the world comes from the environment. Without RANK in the environment (a plain
    process or a Ray actor) a world of size 1 is created on a free loopback port, so callers never
    have to set MASTER_ADDR/PORT themselves. `ep` / `etp` None: as the existing groups have them, or
    1 and tp when creating them (megatron's default: experts split over TP like a dense MLP).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    join_world(timeout_s)
    cpu_shim.activate()
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; launch tp*pp*cp*dp processes"
        )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size() if ep is not None else None,
            ps.get_expert_tensor_parallel_world_size() if etp is not None else None,
        )
        if have != (tp, pp, cp, ep, etp):
            raise RuntimeError(
                f"model parallel groups already exist with (tp, pp, cp, ep, etp) = {have}, "
                f"asked for {(tp, pp, cp, ep, etp)}"
            )
    else:
        ep, etp = ep or 1, etp or tp
        if (world // pp) % (ep * etp):
            raise ValueError(
                f"trainer.ep * trainer.etp = {ep}*{etp} must divide the {world // pp} ranks of a pipeline "
                f"stage (tp*cp*dp): experts are split over those ranks"
            )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


@dataclass
class Policy:
    """The built model and what is needed to map it back to HF."""

    model: torch.nn.Module  # megatron DDP(Float16Module?(GPTModel))
    hf_config: object
    config: object  # megatron TransformerConfig
    te: bool  # transformer-engine layer spec in use
    model_path: str
    layout: str = "sdpa"  # how micro-batches are fed: "varlen" / "te" (packed row) or block-mask rows
    router_stats: object = None  # moe.RouterStats of an MoE model (collective .metrics() per step)
    lora: object = None  # lora.Lora when trainer.lora is on: the adapters, by the weight they adapt


def head_weight(model) -> torch.Tensor | None:
    """This rank's LM head weight [V/tp, h] as the forward uses it (the embedding when tied);
    None on a pipeline stage that has no head."""
    m = unwrap(model)
    if not m.post_process:
        return None
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


def bypass_output_layer(model) -> None:
    """Make GPTModel return its final hidden states: the LM head runs in lm_head.head_logprobs,
    only at response positions and in chunks, instead of as logits for every position."""
    layer = getattr(model, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return

    def forward(input_, weight=None, runtime_gather_output=None):
        return input_, None

    layer.forward = forward


def use_te(spec: str) -> bool:
    have = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if spec == "te" and not have:
        raise ValueError("trainer.layer_spec=te needs CUDA and transformer-engine; use 'local' or 'auto'")
    return have if spec == "auto" else spec == "te"


def transformer_config(
    hc,
    *,
    tp: int,
    pp: int,
    bf16: bool,
    recompute: bool | dict = False,
    cp: int = 1,
    sequence_parallel: bool = False,
    te: bool = False,
    moe_aux_loss_coef: float = 0.0,
    moe_capacity_factor: float | None = None,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf_mapping.check_supported(hc)
    cpu = not torch.cuda.is_available()
    kw = dict(
        num_layers=hc.num_hidden_layers,
        hidden_size=hc.hidden_size,
        num_attention_heads=hc.num_attention_heads,
        num_query_groups=hc.num_key_value_heads,
        kv_channels=hf_mapping.head_dim(hc),
        ffn_hidden_size=hc.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hc.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_mapping.qkv_bias(hc),
        qk_layernorm=hf_mapping.qk_norm(hc),
        rotary_interleaved=hf_mapping.rotary_interleaved(hc),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,  # weights are loaded in fp32; Float16Module casts for bf16
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=True,  # our loss returns (sum, count); megatron divides by the global count
        batch_p2p_sync=not cpu,  # W6
    )
    if (
        pp > 1 or sequence_parallel or cp > 1
    ):  # micro-batches have different packed lengths; this validator wants alltoall even when dense
        kw.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if moe.is_moe(hc):
        if tp > 1 and not sequence_parallel:  # megatron refuses it only once training starts
            raise ValueError(
                f"{hc.model_type} with trainer.tp={tp}: megatron's MoE layers under tensor parallelism "
                "take sequence-parallel input; set trainer.sequence_parallel=true"
            )
        kw.update(
            moe.config_kwargs(hc, te=te, aux_loss_coef=moe_aux_loss_coef, capacity_factor=moe_capacity_factor)
        )
    if not cpu:  # megatron's jit-fused SwiGLU (no bias): one kernel instead of silu, mul and their grads
        kw.update(bias_activation_fusion=True)
    if recompute is True:  # full recompute: every layer's activations recomputed in the backward
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute:  # trainer.recompute_* (TrainerConfig.megatron_recompute)
        kw.update(recompute)
    return TransformerConfig(**kw)


def resolve_attention(attention: str, te: bool, bf16: bool) -> str:
    """trainer.attention -> the layout the trainer feeds the model:
    "varlen" (one packed row, FlashAttention varlen, no mask: CUDA + bf16), "te" (transformer-engine's
    fused attention over the same packed row, as 'thd'), or the block-mask rows of "sdpa" / "unfused"
    (CPU, fp32, or a torch without varlen kernels)."""
    from stages.trainer.varlen import varlen_available

    if te:
        return "te"
    if attention == "auto":
        return "varlen" if (varlen_available() and bf16) else "sdpa"
    if attention == "varlen" and not (varlen_available() and bf16):
        raise ValueError(
            "trainer.attention=varlen needs CUDA, torch >= 2.10 (torch.nn.attention.varlen) and "
            "trainer.precision=bf16; use 'auto' or 'sdpa'"
        )
    return attention


def resolve_moe_experts(choice: str, te: bool, bf16: bool) -> str:
    """trainer.moe_experts -> how MoE layers run their experts: "te" (transformer-engine's grouped MLP,
    with the TE spec), "grouped" (stages/trainer/grouped_experts.py: torch._grouped_mm, all local
    experts in one GEMM per projection) or "sequential" (megatron's SequentialMLP, a loop over experts).
    "auto": TE's with the TE spec, else grouped wherever torch._grouped_mm runs (CPU; CUDA in bf16)."""
    from stages.trainer.grouped_experts import grouped_mm_supported

    if te:
        return "te"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    supported = grouped_mm_supported(device, torch.bfloat16 if bf16 else torch.float32)
    if choice == "grouped" and not supported:
        raise ValueError(
            "trainer.moe_experts=grouped needs torch._grouped_mm for this device and precision (CPU, or "
            "a CUDA GPU in trainer.precision=bf16); use 'auto' or 'sequential'"
        )
    if choice == "auto":
        return "grouped" if supported else "sequential"
    return choice


def _safetensors_getter(model_path: str):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"{model_path} has no *.safetensors files; save the HF model with safe_serialization"
        )
    where = {}
    for f in files:
        with safe_open(f, "pt") as h:
            where.update({k: f for k in h.keys()})

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{model_path} has no tensor {name!r} (is this a Llama/Qwen2/Qwen3 checkpoint?)")
        with safe_open(where[name], "pt") as h:
            return h.get_tensor(name).float()

    return get


def build_policy(
    model_path: str,
    *,
    tp: int = 1,
    pp: int = 1,
    bf16: bool = False,
    layer_spec: str = "auto",
    recompute: bool | dict = False,
    ddp: bool = True,
    distributed_optimizer: bool = False,
    fp32_lm_head: bool = False,
    attention: str = "sdpa",
    output_hidden: bool = False,
    cp: int = 1,
    sequence_parallel: bool = False,
    moe_aux_loss_coef: float = 0.0,
    moe_capacity_factor: float | None = None,
    moe_experts: str = "auto",
    lora: LoraConfig | None = None,
    seed: int = 0,
) -> Policy:
    """GPTModel with HF weights, wrapped for training. Call init_distributed first.

    `attention` (see resolve_attention) picks the local spec's core attention: "varlen" (packed rows,
    stages/trainer/attention.py), "sdpa" (block mask; fp32 scores, as inference engines compute them)
    or "unfused" (megatron's DotProductAttention). `output_hidden`: the model returns the final
    hidden states [b, s, h] instead of logits, for lm_head.head_logprobs (the trainer's path); the
    logits path (tests, benches) keeps megatron's output layer, with `fp32_lm_head` as before.
    MoE models (stages/trainer/moe.py) take EP/ETP from init_distributed's groups;
    `moe_aux_loss_coef` > 0 adds megatron's load-balancing loss (trainer.moe_aux_loss_coef), and
    `moe_capacity_factor` makes routing drop tokens past that capacity (None: dropless);
    `moe_experts` (trainer.moe_experts) picks how the local spec runs experts (resolve_moe_experts).
    `lora` (trainer.lora, rank > 0) freezes the base and attaches adapters (stages/trainer/lora.py),
    initialised from `seed` or from lora.init_from; they need the local layer spec.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoConfig

    from stages.trainer import specs  # imports megatron: not at module import

    hc = AutoConfig.from_pretrained(model_path)
    with_lora = lora is not None and lora.rank > 0
    te = use_te(layer_spec) and not with_lora  # LoRA adapts the local spec's linears (config refuses "te")
    cfg = transformer_config(
        hc,
        tp=tp,
        pp=pp,
        bf16=bf16,
        recompute=recompute,
        cp=cp,
        sequence_parallel=sequence_parallel,
        te=te,
        moe_aux_loss_coef=moe_aux_loss_coef,
        moe_capacity_factor=moe_capacity_factor,
    )
    if te and cp > 1:
        raise ValueError(
            "trainer.cp > 1 runs in this trainer's own attention (local spec); set trainer.layer_spec=local"
        )
    layout = resolve_attention(attention, te, bf16)
    core = None
    if not te:
        from stages.trainer.attention import SDPAttention, VarlenAttention

        core = {"sdpa": SDPAttention, "varlen": VarlenAttention}.get(layout)
        if core is None and cp > 1:
            raise ValueError("trainer.cp > 1 needs trainer.attention varlen, sdpa or auto (not unfused)")
    layers = moe_layer_flags(hc) if moe.is_moe(hc) else None
    grouped = bool(layers) and resolve_moe_experts(moe_experts, te, bf16) == "grouped"
    spec = specs.decoder_block_spec(
        hc, cfg, te=te, core_attention=core, moe_layers=layers, grouped_experts=grouped
    )
    if layers:
        moe.prepare_megatron()
    # tied embeddings under PP move the shared weight with .cuda()
    with cpu_shim.device_mode(), specs.quiet_unknown_mlp():
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=hf_mapping.padded_vocab(hc, tp),
            max_sequence_length=hc.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=hc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(hf_mapping.rope_theta(hc)),
            rotary_percent=hf_mapping.rotary_percent(hc),
        )
    if grouped:  # one rank's tokens: dispatch without host syncs (stages/trainer/local_dispatch.py)
        from stages.trainer.local_dispatch import use_local_dispatch

        use_local_dispatch(model)
    inv_freq = hf_mapping.rope_inv_freq(hc)
    if inv_freq is not None:  # set before the first forward: megatron caches the rotary table per length
        rope = model.rotary_pos_emb
        rope.inv_freq = inv_freq.to(rope.inv_freq.device, rope.inv_freq.dtype)
    if layers:  # GLM: its expert bias exported as a parameter, n_routed_experts read as num_experts
        moe.adapt_built_model(model, hc)
    load_hf_weights(model, model_path, hc, te)
    adapters = None
    if with_lora:  # before any wrapper: DDP then holds gradient buffers for the adapters only
        from stages.trainer.lora import apply_lora, load_peft_into

        adapters = apply_lora(model, hc, lora, tp=tp, sp=sequence_parallel, seed=seed)
        if lora.init_from:
            load_peft_into(adapters, lora.init_from)
    stats = None
    if layers:  # hooks on the routers, before any wrapper
        stats = moe.RouterStats(model, hc, moe_capacity_factor, aux_loss=moe_aux_loss_coef > 0)
    if output_hidden:
        bypass_output_layer(model)
    elif bf16 and fp32_lm_head:
        use_fp32_lm_head(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if bf16:
        biases = moe.expert_biases(model)  # routing biases stay fp32 (moe.expert_biases says why)
        model = Float16Module(cfg, model)
        moe.restore_expert_biases(biases)
    if ddp:
        # the distributed optimizer needs DDP's contiguous param buffers (it shards them over DP)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
        )
        model = DistributedDataParallel(cfg, ddp_cfg, model)
        cfg.no_sync_func = model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        if adapters is not None and tp > 1:
            cfg.finalize_model_grads_func = adapters.after(finalize_model_grads)
    return Policy(
        model=model,
        hf_config=hc,
        config=cfg,
        te=te,
        model_path=model_path,
        layout=layout,
        router_stats=stats,
        lora=adapters,
    )


def use_fp32_lm_head(model) -> None:
    """Make the output layer compute its logits in fp32 from bf16 hidden states and weights.

    The same matmul SGLang does with --enable-fp32-lm-head: both sides then differ only by their
    (bf16) trunks, not by rounding logits of size ~20 to steps of 1/8. Gradients reach the bf16
    weight through the cast, as megatron's DDP hooks expect (no gradient-accumulation fusion here).
    """
    layer = getattr(model, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return
    inner = layer.forward

    def forward(input_, weight=None, runtime_gather_output=None):
        w = layer.weight if weight is None else weight
        return inner(input_.float(), weight=w.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = forward


def load_hf_weights(model, model_path: str, hc, te: bool) -> None:
    from megatron.core import parallel_state as ps

    m = unwrap(model)
    get = _safetensors_getter(model_path)
    sd = hf_mapping.hf_to_mcore(
        get,
        hc,
        tp=ps.get_tensor_model_parallel_world_size(),
        r=ps.get_tensor_model_parallel_rank(),
        layers=[layer.layer_number - 1 for layer in m.decoder.layers],
        pre=m.pre_process,
        post=m.post_process,
        te=te,
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )
    sd = moe.group_expert_weights(sd, m)  # per-expert tensors -> GroupedExperts' weight1/weight2
    res = m.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
    if missing or res.unexpected_keys:
        raise RuntimeError(
            f"HF->megatron mapping mismatch: missing {missing[:8]}, unexpected {res.unexpected_keys[:8]}"
        )


# re-exported: the feeding layouts live in row_layout.py (callers import them from here too)
from stages.trainer.row_layout import causal_block_mask, packed_row_params  # noqa: E402, F401
