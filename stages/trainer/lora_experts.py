"""LoRA on the routed experts of MoE layers (trainer.lora with gate_proj / up_proj / down_proj targeted,
issue #37): one PEFT adapter per expert and projection, beside megatron's SequentialMLP (the CPU
default) or the grouped experts of grouped_experts.py.

Names. Checkpoints, SGLang and this trainer's export name each expert's linears
(`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`); so did transformers 4, where PEFT's
`target_modules: [gate_proj, up_proj, down_proj]` put an adapter on every expert's three linears. So
`trainer.lora.target_modules` names the experts' projections as it names a dense MLP's, and the PEFT
folder holds `base_model.model.model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`.
transformers 5 keeps the experts fused (`mlp.experts.gate_up_proj` [E, 2I, h], `down_proj` [E, h, I]);
PEFT targets those with `target_parameters` and converts a per-expert folder on load (gate and up as
one adapter of rank 2r with a block-diagonal B: the same function), which peft 0.21 does for
Qwen3-MoE (tests/test_lora_moe.py). PEFT's own `target_parameters` form (one A per expert shared by
gate and up) is not offered: the per-expert adapters of rank r hold it and more.

Layout on this rank (its n = E/ep local experts, each split over the expert-TP group like its weights):
A1 [n, P*r, h] (P = how many of gate/up are targeted; whole on every ETP rank, gradient partial there),
B1 [n, 2I/etp, P*r] (rows as linear_fc1's: [gate_r; up_r]; each module's B in its own r columns, the
rest masked to zero, as lora.SiteAdapter lays out a fused dense linear), A2 [n, r, I/etp] (split along
its input like linear_fc2) and B2 [n, h, r] (whole; its gradient partial under ETP: each rank adds its
partial product to linear_fc2's partial output, which the token dispatcher sums). The partial gradients
are summed over the expert-TP group in Lora.finalize_grads; EP needs nothing (each rank trains its own
experts; megatron's DDP reduces them over the expert-data-parallel group, `allreduce = False`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from stages.trainer.moe_config import num_experts

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
FC1_PARTS = ("gate_proj", "up_proj")
_SEQUENTIAL_KEY = re.compile(r"local_experts\.(\d+)\.linear_fc([12])\.weight$")


class ExpertAdapters(torch.nn.Module):
    """The adapters of one MoE layer's local experts (module docstring), stacked over the experts."""

    def __init__(
        self, layer: int, hf_layer: int, targeted: tuple[str, ...], hc, lc, grouped: bool, seed: int
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.layer, self.hf_layer, self.targeted, self.grouped = layer, hf_layer, targeted, grouped
        self.fc1_parts = tuple(p for p in FC1_PARTS if p in targeted)
        self.r, self.scale, self.p_drop = lc.rank, lc.alpha / lc.rank, lc.dropout
        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.etp = ps.get_expert_tensor_parallel_world_size()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.n, self.h, self.inter = num_experts(hc) // self.ep, hc.hidden_size, hc.moe_intermediate_size
        self.enabled = True
        # PEFT's init (A kaiming-uniform: U(+-1/sqrt(in)), B zero) drawn for every global expert from one
        # generator per layer, then this rank's share taken: every EP/ETP layout starts alike
        gen = torch.Generator().manual_seed(seed * 1_000_003 + hf_layer * 8 + 7)
        mine = slice(self.ep_rank * self.n, (self.ep_rank + 1) * self.n)
        if self.fc1_parts:
            width = len(self.fc1_parts) * self.r
            bound = self.h**-0.5
            a1 = torch.empty(num_experts(hc), width, self.h).uniform_(-bound, bound, generator=gen)
            self.A1 = torch.nn.Parameter(a1[mine].contiguous())
            self.B1 = torch.nn.Parameter(torch.zeros(self.n, 2 * self.inter // self.etp, width))
            ones = {p: torch.ones(self.inter, self.r) for p in self.fc1_parts}
            self.register_buffer("mask1", self._fc1_rows(ones).bool(), persistent=False)
            set_tensor_model_parallel_attributes(self.B1, True, 1, 1)
            self.A1.lora_tp_partial = self.etp > 1
        if "down_proj" in targeted:
            bound = self.inter**-0.5
            a2 = torch.empty(num_experts(hc), self.r, self.inter).uniform_(-bound, bound, generator=gen)
            self.A2 = torch.nn.Parameter(a2[mine].chunk(self.etp, 2)[self.etp_rank].contiguous())
            self.B2 = torch.nn.Parameter(torch.zeros(self.n, self.h, self.r))
            set_tensor_model_parallel_attributes(self.A2, True, 2, 1)
            self.B2.lora_tp_partial = self.etp > 1
        for p in self.parameters():  # megatron's rule for expert weights: data-parallel only without EP
            p.allreduce = self.ep == 1

    # -- layouts -------------------------------------------------------------------------------------
    def _fc1_rows(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each targeted module's [..., I, r] block in its own r columns of a [..., I, P*r] slab (zeros for
        gate/up not targeted), this ETP rank's rows of both fused as linear_fc1's: [gate_r; up_r]."""
        lead = next(iter(blocks.values())).shape[:-2]
        slabs = []
        for p in FC1_PARTS:
            slab = torch.zeros(*lead, self.inter, len(self.fc1_parts) * self.r)
            if p in blocks:
                j = self.fc1_parts.index(p)
                slab[..., j * self.r : (j + 1) * self.r] = blocks[p]
            slabs.append(slab.chunk(self.etp, -2)[self.etp_rank])
        return torch.cat(slabs, -2).contiguous()

    def global_expert(self, e: int) -> int:
        return self.ep_rank * self.n + e

    def hf_name(self, e: int, part: str) -> str:
        """HF module of local expert e's projection `part`."""
        return f"model.layers.{self.hf_layer}.mlp.experts.{self.global_expert(e)}.{part}"

    def weight_keys(self) -> list[str]:
        """The megatron weights these adapters change (what a merged push sends)."""
        p = f"decoder.layers.{self.layer}.mlp.experts."
        fcs = [fc for fc, on in (("1", bool(self.fc1_parts)), ("2", "down_proj" in self.targeted)) if on]
        if self.grouped:
            return [f"{p}weight{fc}" for fc in fcs]
        return [f"{p}local_experts.{e}.linear_fc{fc}.weight" for e in range(self.n) for fc in fcs]

    # -- compute -------------------------------------------------------------------------------------
    def _factors(self, fc: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if fc == "fc1":
            return (self.A1, self.B1 * self.mask1) if self.fc1_parts else None
        return (self.A2, self.B2) if "down_proj" in self.targeted else None

    def out(self, fc: str, x: torch.Tensor, e: int | None = None, offs=None) -> torch.Tensor | None:
        """The adapters' output for projection `fc` ("fc1" / "fc2") of rows `x`: local expert e's
        (SequentialMLP), or every expert's rows at once grouped by `offs` (the grouped experts; None
        with no rows: an empty product that still gives every adapter a zero gradient)."""
        from stages.trainer.grouped_experts import _ContiguousGrad

        ab = self._factors(fc)
        if ab is None or not self.enabled:
            return None
        a, b = ab
        if self.p_drop and self.training:
            x = F.dropout(x, self.p_drop)
        if e is not None:
            return F.linear(F.linear(x, a[e]), b[e]) * self.scale
        if offs is None:
            return (x @ a[0].t()) @ b[0].t() * self.scale
        mid = torch._grouped_mm(x, a.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(torch._grouped_mm(mid, b.transpose(1, 2), offs=offs)) * self.scale

    @torch.no_grad()
    def delta(self, key: str) -> torch.Tensor:
        """(alpha/r) B.A for megatron weight `key` (weight_keys), in its layout on this rank, fp32."""
        m = _SEQUENTIAL_KEY.search(key)
        if m is not None:
            a, b = self._factors("fc" + m.group(2))
            e = int(m.group(1))
            return b[e].float() @ a[e].float() * self.scale
        fc = "fc1" if key.endswith("weight1") else "fc2"
        a, b = self._factors(fc)
        d = (b.float() @ a.float() * self.scale).transpose(1, 2).contiguous()  # [n, in, out]: weight1/2's
        return d.view(self.h, -1) if fc == "fc1" else d.view(-1, self.h)

    def partial_grads(self) -> Iterator[tuple[torch.nn.Parameter, object]]:
        from megatron.core import parallel_state as ps

        for p in self.parameters():
            if getattr(p, "lora_tp_partial", False):
                yield p, ps.get_expert_tensor_parallel_group()

    # -- PEFT's per-expert tensors ---------------------------------------------------------------------
    def peft_state(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's experts' adapters under PEFT's names (`prefix` + HF module), full and fp32.
        Collective over the expert-TP group: every rank consumes it to the end."""
        from megatron.core import parallel_state as ps

        def whole(t: torch.Tensor, dim: int) -> list[torch.Tensor]:  # the ETP shards, in rank order
            if self.etp == 1:
                return [t]
            shards = [torch.empty_like(t) for _ in range(self.etp)]
            torch.distributed.all_gather(shards, t.contiguous(), group=ps.get_expert_tensor_parallel_group())
            return shards

        rows: dict[str, torch.Tensor] = {}
        if self.fc1_parts:  # each shard's rows are [gate_r; up_r]: a module's full rows are its halves
            halves = [s.chunk(2, 1) for s in whole(self.B1.detach().float(), 1)]
            rows = {p: torch.cat([h[i] for h in halves], 1) for i, p in enumerate(FC1_PARTS)}
        a2 = torch.cat(whole(self.A2.detach().float(), 2), 2) if "down_proj" in self.targeted else None
        for e in range(self.n):
            for j, p in enumerate(self.fc1_parts):
                cols = slice(j * self.r, (j + 1) * self.r)
                yield f"{prefix}{self.hf_name(e, p)}.lora_A.weight", self.A1[e, cols].detach().float().clone()
                yield f"{prefix}{self.hf_name(e, p)}.lora_B.weight", rows[p][e][:, cols].contiguous()
            if a2 is not None:
                yield f"{prefix}{self.hf_name(e, 'down_proj')}.lora_A.weight", a2[e].contiguous()
                yield (
                    f"{prefix}{self.hf_name(e, 'down_proj')}.lora_B.weight",
                    self.B2[e].detach().float().clone(),
                )

    @torch.no_grad()
    def load_peft(self, get: Callable[[str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the adapters from PEFT's: `get(HF module)` -> (lora_A [r, in], lora_B [out, r])."""
        for e in range(self.n):
            blocks = {p: get(self.hf_name(e, p)) for p in self.targeted}
            if self.fc1_parts:
                self.A1[e].copy_(torch.cat([blocks[p][0].float() for p in self.fc1_parts]))
                self.B1[e].copy_(self._fc1_rows({p: blocks[p][1].float() for p in self.fc1_parts}))
            if "down_proj" in blocks:
                a, b = blocks["down_proj"]
                self.A2[e].copy_(a.float().chunk(self.etp, 1)[self.etp_rank])
                self.B2[e].copy_(b.float())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint shards: axis 0 spread over EP (global experts), an ETP-split axis over expert-TP;
        replicas over the expert-data-parallel ranks (and ETP for the unsplit factors)."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing import ShardedTensor

        pre, dp = len(sharded_offsets), ps.get_expert_data_parallel_rank()
        out = {}
        for name, t in self.state_dict(prefix="", keep_vars=True).items():
            split = getattr(t, "tensor_model_parallel", False)
            offsets = [*sharded_offsets, (pre, self.ep_rank, self.ep)]
            if split:
                offsets.append((pre + t.partition_dim, self.etp_rank, self.etp))
            out[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name,
                t,
                *offsets,
                replica_id=(0, 0 if split else self.etp_rank, dp),
                prepend_axis_num=pre,
            )
        return out


def _add_to_expert(adapters: ExpertAdapters, fc: str, e: int):
    def hook(module, args, kwargs, output):
        out, bias = output
        extra = adapters.out(fc, args[0] if args else kwargs["input_"], e=e)
        return (out, bias) if extra is None else (out + extra.to(out.dtype), bias)

    return hook


def attach_expert_adapters(
    experts, layer: int, hf_layer: int, targeted: tuple[str, ...], hc, lc, *, tp: int, seed: int
) -> ExpertAdapters:
    """Adapters for the local experts `experts` (megatron's SequentialMLP or GroupedExperts) of decoder
    layer `layer` on this rank, wired into their forward; the caller keeps the module."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import SequentialMLP

    from stages.trainer.grouped_experts import GroupedExperts

    if ps.get_expert_tensor_parallel_world_size() > 1 and tp == 1:
        # the partial gradients are summed in megatron's gradient finalisation, which the policy's
        # build hooks only when tp > 1 (stages/trainer/model.py)
        raise ValueError(
            "trainer.lora on the experts with trainer.etp > 1 and trainer.tp = 1 is not supported: set "
            "trainer.etp=0 (= tp), or target the attention modules only"
        )
    grouped = isinstance(experts, GroupedExperts)
    if not grouped and not isinstance(experts, SequentialMLP):
        raise ValueError(
            f"trainer.lora on the experts needs trainer.moe_experts grouped or sequential, not "
            f"{type(experts).__name__}"
        )
    adapters = ExpertAdapters(layer, hf_layer, targeted, hc, lc, grouped, seed)
    if grouped:
        experts.lora_delta = lambda fc, x, offs: adapters.out(fc, x, offs=offs)
    else:
        for e, mlp in enumerate(experts.local_experts):
            mlp.linear_fc1.register_forward_hook(_add_to_expert(adapters, "fc1", e), with_kwargs=True)
            mlp.linear_fc2.register_forward_hook(_add_to_expert(adapters, "fc2", e), with_kwargs=True)
    return adapters
