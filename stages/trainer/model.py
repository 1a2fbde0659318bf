"""The policy as a megatron-core GPTModel: distributed setup, build from an HF folder, per-token
logprobs under TP, and export back to full HF-named tensors on rank 0.

Build order matters: GPTModel (fp32) -> load HF weights -> Float16Module (bf16 only) -> megatron DDP
-> optimizer, because the optimizer takes its fp32 master copies from the parameters as they are
when it is created.
"""

from __future__ import annotations

import datetime
import glob
import importlib.util
import json
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.trainer import cpu_shim, hf_mapping
from stages.weights.base import align_nccl_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 0, timeout_s: float = 600.0) -> None:
    """Join (or create) the process group and megatron's model-parallel groups.

    Under torchrun the world comes from the environment. Without RANK in the environment (a plain
    process or a Ray actor) a world of size 1 is created on a free loopback port, so callers never
    have to set MASTER_ADDR/PORT themselves.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            align_nccl_env()  # before the first communicator: the weight-push group must agree
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
    cpu_shim.activate()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp = {tp}*{pp}; launch tp*pp*dp processes"
        )
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(
                f"model parallel groups already exist with (tp, pp) = {have}, asked for {(tp, pp)}"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
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


def use_te(spec: str) -> bool:
    have = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if spec == "te" and not have:
        raise ValueError("trainer.layer_spec=te needs CUDA and transformer-engine; use 'local' or 'auto'")
    return have if spec == "auto" else spec == "te"


def transformer_config(hc, *, tp: int, pp: int, bf16: bool, recompute: bool = False):
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
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
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
    if pp > 1:  # micro-batches have different packed lengths; this validator wants alltoall even when dense
        kw.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kw)


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
    recompute: bool = False,
    ddp: bool = True,
    distributed_optimizer: bool = False,
    fp32_lm_head: bool = False,
    attention: str = "sdpa",
) -> Policy:
    """GPTModel with HF weights, wrapped for training. Call init_distributed first.

    `attention` picks the local spec's core attention: "sdpa" (stages/trainer/attention.py: fp32
    scores, as inference engines compute them) or "unfused" (megatron's DotProductAttention).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoConfig

    hc = AutoConfig.from_pretrained(model_path)
    cfg = transformer_config(hc, tp=tp, pp=pp, bf16=bf16, recompute=recompute)
    te = use_te(layer_spec)
    if te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm)
        if attention == "sdpa":
            from stages.trainer.attention import SDPAttention

            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    with cpu_shim.device_mode():  # tied embeddings under PP move the shared weight with .cuda()
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=hc.vocab_size,
            max_sequence_length=hc.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=hc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(hf_mapping.rope_theta(hc)),
        )
    load_hf_weights(model, model_path, hc, te)
    if bf16 and fp32_lm_head:
        use_fp32_lm_head(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(cfg, model)
    if ddp:
        # the distributed optimizer needs DDP's contiguous param buffers (it shards them over DP)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
        )
        model = DistributedDataParallel(cfg, ddp_cfg, model)
        cfg.no_sync_func = model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
    return Policy(model=model, hf_config=hc, config=cfg, te=te, model_path=model_path)


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
    )
    res = m.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
    if missing or res.unexpected_keys:
        raise RuntimeError(
            f"HF->megatron mapping mismatch: missing {missing[:8]}, unexpected {res.unexpected_keys[:8]}"
        )


# -- logprobs ------------------------------------------------------------------------------------------
def logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel logits [b, s, V/tp] -> (log p(target) [b, s], entropy [b, s] or None).

    The entropy carries gradient only with `entropy_grad` (an entropy bonus in the loss).
    Works for any TP size: the reductions over the vocabulary go through megatron's autograd-aware
    TP collectives (identity at TP=1), so gradients are exact.
    """
    from megatron.core import tensor_parallel as tpl

    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = -tpl.vocab_parallel_cross_entropy(
        z.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous()
    )
    logp = logp.transpose(0, 1)
    if not entropy:
        return logp, None
    from megatron.core import parallel_state as ps

    if not entropy_grad:  # a metric only: keep it out of the autograd graph
        z = z.detach()
    zmax = z.detach().max(-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(z - zmax)
    sum_e = tpl.reduce_from_tensor_model_parallel_region(e.sum(-1))
    sum_ez = tpl.reduce_from_tensor_model_parallel_region((e * (z - zmax)).sum(-1))
    # H = log Z - E_p[z], with z shifted by zmax on both sides
    ent = torch.log(sum_e) - sum_ez / sum_e
    return logp, ent


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


def read_hf_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)
