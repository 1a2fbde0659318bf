"""The policy of the fsdp backend (fsdp_backend.py): any transformers causal LM, built from its HF folder
with AutoModelForCausalLM and sharded over the trainer's ranks with torch's FSDP2 (`fully_shard`).

What is fed: packed rows as packing.pack lays them out, with position_ids restarting at every segment
and no attention mask. transformers reads the segment boundaries from the position ids
(masking_utils.find_packed_sequence_indices): flash_attention_2 turns them into cu_seqlens (varlen, no
s x s mask), sdpa and eager into a block-diagonal causal mask it builds itself, flex_attention into a
block mask. Sliding windows and the other per-family masks stay transformers' own.

What comes out: the decoder's final hidden states at the response positions go through
lm_head.head_logprobs (the fused chunked logprob / entropy head the megatron backend uses) with the
model's output-embedding weight, inside the FSDP root's forward, so FSDP has that weight unsharded
while the head uses it and its gradient flows back through FSDP's hooks.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.trainer.hf_varlen import VARLEN, packed_kwargs, register, uses_window_or_softcap
from stages.trainer.lm_head import head_logprobs
from stages.trainer.varlen import HAVE_VARLEN

log = logging.getLogger(__name__)

# trainer.attention -> transformers' attn_implementation ("auto" is resolved by `attention_impl`)
ATTENTION = {"sdpa": "sdpa", "unfused": "eager"}  # varlen: attention_impl


def attention_impl(setting: str, cuda: bool, bf16: bool) -> str:
    """transformers' attention implementation for trainer.attention. auto: FlashAttention's varlen
    kernels on CUDA in bf16 (the flash-attn package's where it is installed, else torch's through
    hf_varlen.VARLEN), else sdpa (on CPU with the block mask transformers builds from the position ids).
    varlen: the same kernels; without CUDA, hf_varlen's per-sequence SDPA (same numbers, for tests)."""
    if setting == "varlen":
        return "flash_attention_2" if _have_flash_attn() else VARLEN
    if setting != "auto":
        return ATTENTION[setting]
    if cuda and bf16:
        if _have_flash_attn():
            return "flash_attention_2"
        if HAVE_VARLEN:
            return VARLEN
    return "sdpa"


def _have_flash_attn() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """Segment ids [b, s] -> positions [b, s] restarting at 0 where each segment (and each row's padding
    tail) begins: how transformers recognises packed sequences."""
    s = segments.shape[1]
    idx = torch.arange(s, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


@dataclass
class HeadSpec:
    """How this family turns final hidden states into logits, beyond `hidden @ lm_head.weight.T`:
    `scale` multiplies the logits (granite's 1 / logits_scaling, cohere's logit_scale: folded into the
    fused head's temperature), `softcap` is gemma2's tanh soft-capping (the fused head has none, so
    such a model computes its logits unfused, t x V at once)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, hc) -> HeadSpec:
        scale = 1.0 / float(getattr(hc, "logits_scaling", None) or 1.0)
        scale *= float(getattr(hc, "logit_scale", None) or 1.0)
        return cls(scale=scale, softcap=getattr(hc, "final_logit_softcapping", None) or None)


def _plain_head(h, w, targets, temperature, spec: HeadSpec, entropy: bool):
    """logprob (and entropy) through ordinary autograd, for heads the fused one does not compute."""
    z = (h.float() @ w.float().t()) * spec.scale
    if spec.softcap:
        z = torch.tanh(z / spec.softcap) * spec.softcap
    logp_all = F.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    return logp, ent


class HeadedLM(nn.Module):
    """The HF causal LM with the fused logprob head in its forward: the module FSDP shards as its root.
    `lm` keeps HF's parameter names (state dicts strip the `lm.` prefix)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.head = HeadSpec.of(lm.config)

    def hidden(
        self,
        tokens: torch.Tensor,
        segments: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_segment_len: int = 0,
    ) -> torch.Tensor:
        varlen = self.lm.config._attn_implementation == VARLEN
        packed = packed_kwargs(cu_seqlens, max_segment_len) if varlen else {}
        out = self.lm.base_model(
            input_ids=tokens, position_ids=segment_positions(segments), use_cache=False, **packed
        )
        return out.last_hidden_state

    def forward(
        self,
        tokens: torch.Tensor,
        segments: torch.Tensor,
        pick: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        entropy_grad: bool = False,
        chunk: int = 2048,
        fp32_logits: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        max_segment_len: int = 0,
    ):
        """Final hidden states [b, s, h] (`pick` None), or (logp [t], entropy [t] or None) of `targets`
        predicted at the flat positions `pick` of the b*s ones. `cu_seqlens`, `max_segment_len`: the
        micro-batch's segment boundaries, which a packed row's varlen attention needs."""
        hidden = self.hidden(tokens, segments, cu_seqlens, max_segment_len)
        if pick is None:
            return hidden
        h = hidden.reshape(-1, hidden.shape[-1])[pick]
        w = self.lm.get_output_embeddings().weight
        if self.head.softcap:
            logp, ent = _plain_head(h, w, targets, temperature, self.head, entropy)
            return logp, (ent if entropy_grad or ent is None else ent.detach())
        return head_logprobs(
            h,
            w,
            targets,
            temperature=temperature / self.head.scale,
            entropy=entropy,
            entropy_grad=entropy_grad,
            chunk=chunk,
            fp32_logits=fp32_logits,
            vocab_size=w.shape[0],
        )


def load_lm(path: str, attn: str, fallback: bool = False) -> nn.Module:
    """AutoModelForCausalLM of the HF folder in fp32 (FSDP keeps fp32 master weights; bf16 compute is
    its mixed-precision policy's), dropout off everywhere as the megatron build has it: RL's logprobs
    must be those of the deterministic policy the engines sample. `fallback` (trainer.attention=auto):
    eager attention for a family that has no `attn` implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hc = AutoConfig.from_pretrained(path)
    if attn == VARLEN:
        register()
        if uses_window_or_softcap(hc):
            if not fallback:
                raise ValueError(
                    f"{path}: {hc.model_type} has sliding-window or soft-capped attention, which "
                    f"trainer.attention=varlen ({VARLEN}) does not cover; use trainer.attention=sdpa"
                )
            log.warning("%s: %s has sliding-window or soft-capped attention; using sdpa", path, hc.model_type)
            attn = "sdpa"
    text = getattr(hc, "text_config", None)
    for cfg in (hc, text) if text is not None else (hc,):
        for k, v in list(vars(cfg).items()):
            if "dropout" in k and isinstance(v, float):
                setattr(cfg, k, 0.0)
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            path, config=hc, dtype=torch.float32, attn_implementation=attn
        )
    except ValueError as e:  # a family without sdpa support (gemma2: attention soft-capping)
        if not fallback or "does not support" not in str(e):
            raise
        log.warning("%s: %s has no %s attention; using eager", path, hc.model_type, attn)
        lm = AutoModelForCausalLM.from_pretrained(
            path, config=hc, dtype=torch.float32, attn_implementation="eager"
        )
    for m in lm.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return lm


# torch._dynamo's graphs per code object while a compiled decoder layer runs (its default is 8). All layers
# run their class's code, so the limit counts the graphs of every layer. A tiny Qwen2 on the CPU needs 3
# (tests/test_fsdp_compile.py): the training pass and the no-grad pass twice, as transformers'
# gradient_checkpointing_enable makes the embeddings' output require grad even there (the first layer's
# input differs from the others'); 6 with sdpa, whose rows of one sequence come without a mask. Families
# with several layer classes or per-layer settings (sliding and full attention) multiply these, and the
# CPU's per-segment varlen attention (varlen.per_segment_sdpa, a graph break) compiles its loop once per
# segment count. Lengths add none (dynamic=True, no duck sizing). 32 covers those; a storm past it (a
# graph per layer of a 28-layer model, say) stops the step (compile_layer).
LAYER_RECOMPILE_LIMIT = 32


class LayerRecompileLimit(RuntimeError):
    """A compiled decoder layer needed more graphs than LAYER_RECOMPILE_LIMIT (trainer.fsdp_compile)."""


def compile_layer(layer: nn.Module) -> None:
    """trainer.fsdp_compile for one decoder layer, before fully_shard: `nn.Module.compile` of its call, with

    - dynamic=True. A packed micro-batch's row length, cu_seqlens and max_segment_len change from one
      micro-batch to the next; compiled static, each change recompiles (once a size, then dynamo makes
      it dynamic), on top of the graphs of each mode, and 7B over 2 ranks ran out of graphs in its first
      step (bench/RESULTS.md, GPU session of 2026-11-28, 18:00).
    - activation checkpointing (trainer.recompute) inside the compiled call, around the layer's forward:
      dynamo traces the checkpoint into the layer's graph and the recompute is part of the compiled
      backward (torchtitan's order). transformers placed it by release: older ones around the module
      call, so FSDP's pre-forward hook ran inside it and the compiled forward saw its inputs as views
      (FSDP's backward-hook function returns them so) while the recompute, where the hook does nothing,
      saw plain tensors: another guard ("'NoneType' object has no attribute 'size'", on the view's
      base), another graph for every recompute. A body that breaks the graph (the CPU's per-segment
      attention) makes dynamo run the checkpoint eagerly, body included: slower, the same values.
    - dynamo's recompile limit raised to LAYER_RECOMPILE_LIMIT and fatal while the layer runs. Past the
      limit dynamo would run new variants eagerly, silently; under a checkpoint around the compiled call
      that left a forward compiled and its recompute eager (CheckpointError in the backward: float32
      norms where the forward saved bf16). Here it raises LayerRecompileLimit, which names the setting."""
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.fx.experimental import _config as shape_config

    if getattr(layer, "gradient_checkpointing", False):
        layer.gradient_checkpointing = False  # transformers' own off: _checkpointed_forward's instead
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    layer.compile(dynamic=True)
    compiled = layer._compiled_call_impl

    def call(*args, **kwargs):
        # dynamo reads these when it compiles a frame, inside this call; set and restored by hand (the
        # config's patch() costs ~0.1 ms, a layer call ~10 us this way)
        dyn = torch._dynamo.config
        saved = dyn.recompile_limit, dyn.fail_on_recompile_limit_hit, shape_config.use_duck_shape
        # duck sizing off: two sizes equal at the first call (a row of 128 tokens, a head of 128) would
        # share one symbol, and the first call where they differ would recompile both passes' graphs
        dyn.recompile_limit, dyn.fail_on_recompile_limit_hit, shape_config.use_duck_shape = (
            LAYER_RECOMPILE_LIMIT,
            True,
            False,
        )
        try:
            return compiled(*args, **kwargs)
        except FailOnRecompileLimitHit as e:
            raise LayerRecompileLimit(
                f"trainer.fsdp_compile: torch.compile made more than {LAYER_RECOMPILE_LIMIT} graphs of "
                f"{type(layer).__name__}'s code (TORCH_LOGS=recompiles lists why). Rather than run it "
                "eagerly from here on, the step stops: set trainer.fsdp_compile=false, or find the input "
                "or attribute that changes from call to call"
            ) from e
        finally:
            dyn.recompile_limit, dyn.fail_on_recompile_limit_hit, shape_config.use_duck_shape = saved

    layer._compiled_call_impl = call  # what nn.Module.__call__ runs for a compiled module


def _checkpointed_forward(self, *args, **kwargs):
    """A checkpointed decoder layer's forward (compile_layer): its class's, under the checkpoint function
    transformers set (trainer.recompute's use_reentrant=False) in a training pass."""
    forward = type(self).forward
    if self.training and torch.is_grad_enabled():
        return self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)
    return forward(self, *args, **kwargs)


def shard(
    model: HeadedLM, mesh, *, bf16: bool, offload: bool, reshard: bool = True, compile_layers: bool = False
) -> HeadedLM:
    """FSDP2 over `mesh`: one unit per decoder layer (the classes the model lists in _no_split_modules,
    transformers' own wrap policy), the rest (embeddings, final norm, LM head: tied weights stay in
    one unit) in the root. bf16: bf16 compute, fp32 gradient reduction and master weights.
    compile_layers: torch.compile each decoder layer first (trainer.fsdp_compile).
    reshard=False keeps each layer unsharded after its forward (for its backward and the next micro-batch)
    until reshard_all: one all-gather and bf16 cast per layer a pass instead of two per micro-batch."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw["offload_policy"] = CPUOffloadPolicy() if offload else OffloadPolicy()
    names = set(getattr(model.lm, "_no_split_modules", None) or ())
    layers = [m for m in model.lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model.lm).__name__} names no decoder-layer classes (_no_split_modules): the fsdp "
            "backend shards one unit per layer and cannot find them"
        )
    for layer in layers:
        if compile_layers:  # each block on its own (the graphs shared by every layer), then sharded
            compile_layer(layer)
        fully_shard(layer, reshard_after_forward=reshard, **kw)
    fully_shard(model, **kw)
    return model


def reshard_all(model: HeadedLM) -> None:
    """Every FSDP unit of `model` back to its shards: the unsharded bf16 copies of a pass that kept them
    (reshard=False) are let go, and the module's parameters are the sharded fp32 masters again, the ones
    the optimizer, the exports and the checkpoints read."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def hf_named(model: HeadedLM) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors as HF names them in a save_pretrained file: parameters (a tied LM head once,
    under the embedding's name, as HF saves it) and persistent buffers. Values are FSDP's shards
    (DTensors) or plain tensors."""
    lm = model.lm
    params = dict(lm.named_parameters())  # deduplicated: a tied weight under its first name
    every = {n for n, _ in lm.named_parameters(remove_duplicate=False)}
    sd = lm.state_dict(keep_vars=True)
    return [(k, params[k] if k in params else v) for k, v in sd.items() if k in params or k not in every]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (collective over its mesh), or `t` itself."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP DTensor (a view), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def build_optimizer(model: nn.Module, tc) -> torch.optim.Optimizer:
    """torch's AdamW / SGD as megatron-core builds them (its torch fallback): weight decay on matrices
    only (no decay for biases and 1-D parameters), decoupled for Adam, SGD with megatron's default
    momentum 0.9, Adam's eps 1e-8."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if tc.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=tc.lr, momentum=0.9)
    fused = {"fused": True} if torch.cuda.is_available() and not tc.fsdp_cpu_offload else {}
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), eps=1e-8, **fused)
