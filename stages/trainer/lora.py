"""LoRA on the megatron policy (trainer.lora, issue #37): low-rank adapters beside the local layer spec's
linear layers, the base frozen (no gradient, no optimizer state, no fp32 master copy).

Where: each decoder layer's fused megatron linears carry the HF modules PEFT names (`sites`):
linear_qkv = q_proj, k_proj, v_proj; linear_proj = o_proj; linear_fc1 = gate_proj, up_proj (GLM-4:
gate_up_proj); linear_fc2 = down_proj. The adapters are PEFT's, one per targeted module (so a PEFT folder
maps onto them exactly, both ways): a site's A matrices are stacked [P*r, in]; its B matrices are laid
out like the fused weight's rows, each module's B in its own r columns and zero elsewhere (a fixed mask
keeps those zero), so a site's update is one pair of GEMMs: x -> x A^T -> (.) (B*mask)^T, times alpha/r.

Tensor parallelism follows the base layer's: a column-parallel site (qkv, fc1) holds all of A and its
rows of B; a row-parallel one (proj, fc2) its columns of A and all of B, and its partial x A^T is summed
over TP (reduce-scattered under sequence parallelism) as the base layer's output is. The gradients that
come out partial on each TP rank (a column site's A; a row site's B under sequence parallelism) are
summed over TP after the data-parallel reduction (`Lora.finalize_grads`). Pipeline stages hold their own
layers' adapters; data and context parallelism need nothing (DDP reduces the adapters' gradients).

The adapters are the layer's `lora` child (LoraAdapters), not the linear's: megatron's linears checkpoint
every tensor they hold as sharded like their weight, and the adapters shard differently. A forward hook
on the linear adds the adapter's output to the linear's.

MoE layers: gate_proj / up_proj / down_proj name the routed experts' projections (one adapter per
expert: lora_experts.py) and a shared expert's linears (Qwen2-MoE's `mlp.shared_expert`, GLM's
`mlp.shared_experts`), which are sites like a dense MLP's; PEFT's target_modules match both alike.
PEFT folders: lora_peft.py.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stages.trainer import hf_mapping
from stages.trainer.config import LoraConfig
from stages.trainer.lora_experts import EXPERT_PARTS, ExpertAdapters, attach_expert_adapters
from stages.trainer.lora_peft import (  # noqa: F401  (callers use them as lora.*)
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    load_peft_into,
    read_peft,
    save_peft,
)
from stages.trainer.moe_config import is_moe, shared_expert_size


@dataclass(frozen=True)
class Site:
    """A megatron linear of a decoder layer and the HF modules fused in it."""

    linear: str  # path in the decoder layer
    hf_module: str  # HF parent module: self_attn, mlp, or a shared expert (mlp.shared_expert[s])
    parts: tuple[str, ...]  # the HF modules (PEFT target names), in the fused rows' order
    layout: str  # "qkv" / "fc1" (column-parallel, fused rows: hf_mapping.fuse_rows) or "row"
    inter: int = 0  # the MLP's intermediate size; 0: the model's (hc.intermediate_size)


def sites(hc) -> tuple[Site, ...]:
    """Every site a decoder layer may have; a layer has the dense MLP's or (MoE) a shared expert's.
    Their order seeds the adapters' init: new sites go at the end."""
    fc1 = ("gate_up_proj",) if hc.model_type == "glm4" else ("gate_proj", "up_proj")
    shared = "mlp.shared_expert" if hc.model_type == "qwen2_moe" else "mlp.shared_experts"
    inter = (shared_expert_size(hc) or 0) if is_moe(hc) else 0
    return (
        Site("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), "qkv"),
        Site("self_attention.linear_proj", "self_attn", ("o_proj",), "row"),
        Site("mlp.linear_fc1", "mlp", fc1, "fc1"),
        Site("mlp.linear_fc2", "mlp", ("down_proj",), "row"),
        Site("mlp.shared_experts.linear_fc1", shared, ("gate_proj", "up_proj"), "fc1", inter),
        Site("mlp.shared_experts.linear_fc2", shared, ("down_proj",), "row", inter),
    )


def part_shape(hc, part: str, inter: int = 0) -> tuple[int, int]:
    """(out, in) of an HF module's weight (`inter`: the MLP's intermediate size, 0 = the model's)."""
    h, d, i = hc.hidden_size, hf_mapping.head_dim(hc), inter or hc.intermediate_size
    nq, nkv = hc.num_attention_heads, hc.num_key_value_heads
    return {
        "q_proj": (nq * d, h),
        "k_proj": (nkv * d, h),
        "v_proj": (nkv * d, h),
        "o_proj": (h, nq * d),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "gate_up_proj": (2 * i, h),
        "down_proj": (h, i),
    }[part]


class SiteAdapter(torch.nn.Module):
    """The adapters of one megatron linear (module docstring): A, B and B's mask on this TP rank."""

    def __init__(
        self,
        site: Site,
        targeted: tuple[str, ...],
        hf_layer: int,
        hc,
        lc: LoraConfig,
        tp: int,
        tp_rank: int,
        sp: bool,
        seed: int,
    ):
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.site, self.targeted, self.hf_layer, self.hc = site, targeted, hf_layer, hc
        self.r, self.scale, self.p_drop = lc.rank, lc.alpha / lc.rank, lc.dropout
        self.tp, self.tp_rank, self.sp = tp, tp_rank, sp
        self.enabled = True
        width = len(targeted) * self.r
        a = torch.empty(width, self._shape(targeted[0])[1])
        # PEFT's init, from a generator seeded by the layer and site: every TP rank and layout draws alike
        gen = torch.Generator().manual_seed(seed * 1_000_003 + hf_layer * 8 + sites(hc).index(site))
        for j in range(len(targeted)):
            torch.nn.init.kaiming_uniform_(a[j * self.r : (j + 1) * self.r], a=math.sqrt(5), generator=gen)
        self.A = torch.nn.Parameter(self._local_a(a))
        self.B = torch.nn.Parameter(self._local_rows({}, width))
        ones = {p: torch.ones(self._shape(p)[0], self.r) for p in targeted}
        self.register_buffer("mask", self._local_rows(ones, width).bool(), persistent=False)
        if site.layout == "row":  # A split along its input like the weight; B whole on every rank
            set_tensor_model_parallel_attributes(self.A, True, 1, 1)
            self.B.lora_tp_partial = sp and tp > 1  # each rank saw its own tokens' share
        else:  # B's rows split like the weight's; A whole on every rank, its gradient partial
            set_tensor_model_parallel_attributes(self.B, True, 0, 1)
            self.A.lora_tp_partial = tp > 1

    def hf_name(self, part: str) -> str:
        return f"model.layers.{self.hf_layer}.{self.site.hf_module}.{part}"

    def _shape(self, part: str) -> tuple[int, int]:
        return part_shape(self.hc, part, self.site.inter)

    # -- layouts: PEFT's per-module tensors <-> this rank's fused ones --------------------------------
    def _local_a(self, a_full: torch.Tensor) -> torch.Tensor:
        return a_full.chunk(self.tp, 1)[self.tp_rank].contiguous() if self.site.layout == "row" else a_full

    def _local_rows(self, blocks: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """Each targeted module's block [out_p, r] in its own r columns of a [out_p, width] slab (zeros for
        the modules of the site not targeted), fused into this rank's rows of the site."""
        slabs = []
        for p in self.site.parts:
            slab = torch.zeros(self._shape(p)[0], width)
            if p in blocks:
                j = self.targeted.index(p)
                slab[:, j * self.r : (j + 1) * self.r] = blocks[p]
            slabs.append(slab)
        if self.site.layout == "row":
            return slabs[0]
        if self.site.parts == ("gate_up_proj",):  # GLM-4: one HF module holding [gate; up]
            slabs = list(slabs[0].chunk(2, 0))
        return hf_mapping.fuse_rows(self.site.layout, slabs, self.hc, self.tp, self.tp_rank)

    def peft_blocks(
        self, a_full: torch.Tensor, b_full: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """TP-gathered A [P*r, in] and B [out, P*r] -> {module: (lora_A [r, in], lora_B [out_p, r])}."""
        rows = (
            [b_full]
            if self.site.layout == "row"
            else hf_mapping.split_rows(self.site.layout, b_full, self.hc)
        )
        if self.site.parts == ("gate_up_proj",):
            rows = [torch.cat(rows)]
        by_part = dict(zip(self.site.parts, rows, strict=True))
        return {
            p: (a_full[j * self.r : (j + 1) * self.r], by_part[p][:, j * self.r : (j + 1) * self.r])
            for j, p in enumerate(self.targeted)
        }

    @torch.no_grad()
    def load_peft(self, blocks: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        a = torch.cat([blocks[p][0].float() for p in self.targeted])
        b = self._local_rows({p: blocks[p][1].float() for p in self.targeted}, len(self.targeted) * self.r)
        self.A.copy_(self._local_a(a))
        self.B.copy_(b)

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.p_drop and self.training:  # each TP rank draws its own mask for its copy of x
            x = F.dropout(x, self.p_drop)
        if self.site.layout == "row":  # x is this rank's share of the input features
            h = F.linear(x, self.A)
            if self.tp > 1:
                h = (
                    mappings.reduce_scatter_to_sequence_parallel_region(h)
                    if self.sp
                    else mappings.reduce_from_tensor_model_parallel_region(h)
                )
            return F.linear(h, self.B) * self.scale
        if self.tp > 1:  # the whole sequence (SP) and input's gradient summed over the ranks' rows of B
            x = (
                mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
                if self.sp
                else mappings.copy_to_tensor_model_parallel_region(x)
            )
        return F.linear(F.linear(x, self.A), self.B * self.mask) * self.scale

    @torch.no_grad()
    def delta(self, key: str = "") -> torch.Tensor:
        """(alpha/r) B.A in this rank's layout of the site's weight (`key`), fp32."""
        return (self.B.float() * self.mask) @ self.A.float() * self.scale

    def partial_grads(self) -> Iterator[tuple[torch.nn.Parameter, object]]:
        from megatron.core import parallel_state as ps

        for p in (self.A, self.B):
            if getattr(p, "lora_tp_partial", False):
                yield p, ps.get_tensor_model_parallel_group()

    def peft_state(self, prefix: str, tp_shards) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters under PEFT's names (`prefix` + HF module), full and fp32 (`tp_shards(t)`: the TP
        ranks' shards of t, in rank order). Collective over TP: every rank consumes it to the end."""
        A, B = self.A.detach().float(), self.B.detach().float()
        if self.site.layout == "row":
            a_full, b_full = torch.cat(tp_shards(A), 1), B
        else:
            fused = "linear_qkv.weight" if self.site.layout == "qkv" else "linear_fc1.weight"
            a_full, b_full = A, hf_mapping.merge_tp(fused, tp_shards(B), self.hc)
        for part, (la, lb) in self.peft_blocks(a_full, b_full).items():
            yield f"{prefix}{self.hf_name(part)}.lora_A.weight", la.contiguous()
            yield f"{prefix}{self.hf_name(part)}.lora_B.weight", lb.contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"A": 1} if self.site.layout == "row" else {"B": 0}  # the other one: a replica per TP rank
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


class LoraAdapters(torch.nn.ModuleDict):
    """A decoder layer's adapters by linear name; checkpoints each with its own sharding."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        out = {}
        for name, adapter in self.items():
            out.update(adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return out


def _add_output(adapter: SiteAdapter):
    def hook(module, args, kwargs, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0] if args else kwargs["input_"]).to(out.dtype), bias

    return hook


def _trained_whole(key: str, modules: set[str], tied: bool) -> bool:
    """Whether megatron parameter `key` belongs to one of `modules` (PEFT's modules_to_save names)."""
    return (
        ("embed_tokens" in modules and key == "embedding.word_embeddings.weight")
        # a tied model's last pipeline stage holds the shared embedding as output_layer.weight
        or (key == "output_layer.weight" and ("lm_head" in modules or (tied and "embed_tokens" in modules)))
        or ("model.norm" in modules and key == "decoder.final_layernorm.weight")
        or ("input_layernorm" in modules and key.endswith(".input_layernorm.weight"))
        or ("post_attention_layernorm" in modules and key.endswith(".pre_mlp_layernorm.weight"))
    )


def _needs_grad(module, args, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


class Lora:
    """The policy's adapters: `sites` (SiteAdapter by the megatron weight it adapts,
    decoder.layers.{i}.<linear>.weight), `experts` (ExpertAdapters, one per MoE layer of this rank),
    `adapters` (every adapted megatron weight -> its adapter), and the parameters trained whole beside
    them (trainer.lora.modules_to_save), by megatron key."""

    def __init__(self, cfg: LoraConfig, hc, sites: dict[str, SiteAdapter], experts: list, whole: set[str]):
        self.cfg, self.hc, self.sites, self.experts, self.whole = cfg, hc, sites, experts, whole
        self.adapters: dict[str, SiteAdapter | ExpertAdapters] = dict(sites)
        self.adapters.update((key, ex) for ex in experts for key in ex.weight_keys())
        self.modules = [*sites.values(), *experts]

    @staticmethod
    def is_adapter_param(key: str) -> bool:
        return ".lora." in key

    def trains(self, key: str) -> bool:
        """Whether megatron parameter `key` is trained (an adapter, or a module trained whole): what a
        checkpoint holds."""
        return key in self.whole or self.is_adapter_param(key)

    def changes(self, key: str) -> bool:
        """Whether a push sends the HF tensors of megatron parameter `key`: a module trained whole, and
        with push=merge an adapted weight, merged (push=adapter sends the adapters instead:
        lora_peft.adapter_push_state; the engine keeps the base)."""
        return key in self.whole or (self.cfg.push == "merge" and key in self.adapters)

    def adapter_for(self, weight_key: str) -> SiteAdapter | ExpertAdapters | None:
        return self.adapters.get(weight_key)

    def merged(self, weight_key: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of base + (alpha/r) B.A, in the weight's dtype. A bf16/fp16 weight of a
        linear takes one GEMM with the base as its accumulator (fp32 inside, one rounding): making fp32
        copies of the weight and the delta first cost a 7B merged push 73 ms of its 172 (H200,
        bench/gpu_lora_push.py). B and A go in at the weight's precision, as the forward computes them."""
        adapter = self.adapters[weight_key]
        if weight.dtype in (torch.bfloat16, torch.float16) and isinstance(adapter, SiteAdapter):
            b = (adapter.B.detach() * adapter.mask).to(weight.dtype)
            return torch.addmm(weight, b, adapter.A.detach().to(weight.dtype), alpha=adapter.scale)
        return (weight.float() + adapter.delta(weight_key)).to(weight.dtype)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model (the KL reference): adapters off for the forwards inside."""
        for a in self.modules:
            a.enabled = False
        try:
            yield
        finally:
            for a in self.modules:
                a.enabled = True

    def after(self, finalize):
        """megatron's gradient finalisation `finalize`, followed by finalize_grads."""

        def finalize_with_lora(*args, **kwargs):
            finalize(*args, **kwargs)
            self.finalize_grads()

        return finalize_with_lora

    def finalize_grads(self) -> None:
        """Sum over TP (experts: over expert-TP) the adapter gradients each rank holds a part of (module
        docstrings)."""
        for a in self.modules:
            for p, group in a.partial_grads():
                grad = p.main_grad if hasattr(p, "main_grad") else p.grad
                if grad is not None:
                    torch.distributed.all_reduce(grad, group=group)


def _linear(layer, path: str):
    """The linear at `path` in a decoder layer, None where the layer has none (a dense MLP's site on an
    MoE layer, a shared expert's where there is none)."""
    try:
        return operator.attrgetter(path)(layer)
    except AttributeError:
        return None


def apply_lora(model, hc, lc: LoraConfig, *, tp: int, sp: bool, seed: int) -> Lora:
    """Freeze `model` (a GPTModel, before any wrapper) and attach adapters to the targeted linears (and
    routed experts) of its decoder layers on this rank. Layer `l`'s adapters start the same whatever the
    parallel layout."""
    from megatron.core import parallel_state as ps

    targets = set(lc.target_modules)
    tp_rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    if "lm_head" in lc.modules_to_save and hc.tie_word_embeddings:
        raise ValueError(
            "trainer.lora.modules_to_save names lm_head, but this model ties it to the embeddings: name "
            "embed_tokens (it trains both)"
        )
    model.requires_grad_(False)
    tied = bool(hc.tie_word_embeddings)
    whole = {k for k, _ in model.named_parameters() if _trained_whole(k, set(lc.modules_to_save), tied)}
    for key, p in model.named_parameters():
        if key in whole:
            p.requires_grad_(True)
    adapters: dict[str, SiteAdapter] = {}
    experts: list[ExpertAdapters] = []
    for i, layer in enumerate(model.decoder.layers):
        hf_layer = layer.layer_number - 1
        box = LoraAdapters()
        for site in sites(hc):
            targeted = tuple(p for p in site.parts if p in targets)
            linear = _linear(layer, site.linear) if targeted else None
            if linear is None:
                continue
            adapter = SiteAdapter(site, targeted, hf_layer, hc, lc, tp, tp_rank, sp, seed)
            # linear_qkv, ..., linear_fc2, shared_experts_linear_fc1: the checkpoints' keys
            box[site.linear.split(".", 1)[1].replace(".", "_")] = adapter
            linear.register_forward_hook(_add_output(adapter), with_kwargs=True)
            adapters[f"decoder.layers.{i}.{site.linear}.weight"] = adapter
        routed = getattr(layer.mlp, "experts", None)
        on_experts = tuple(p for p in EXPERT_PARTS if p in targets)
        if routed is not None and on_experts:
            box["experts"] = attach_expert_adapters(routed, i, hf_layer, on_experts, hc, lc, tp=tp, seed=seed)
            experts.append(box["experts"])
        if len(box):
            layer.add_module("lora", box)
    if not adapters and not experts and model.decoder.layers:
        raise ValueError(f"trainer.lora.target_modules {sorted(targets)} match no linear layer of this model")
    embedding = getattr(model, "embedding", None)
    if embedding is not None and not embedding.word_embeddings.weight.requires_grad:
        # with the embeddings frozen the first layer's input needs no gradient, and megatron's activation
        # recompute (a reentrant checkpoint per layer) then returns outputs that need none either: no
        # adapter would ever get a gradient (measured: a 7B "trained" on one H100 at 1.75 MFU, i.e. no
        # backward). PEFT's enable_input_require_grads, for the same reason
        embedding.register_forward_hook(_needs_grad)
    return Lora(lc, hc, adapters, experts, whole)
