"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, GLM-4.5/4.6/Air) in the megatron trainer: the HF <->
megatron router, shared-expert and expert weights under expert parallelism (EP) and expert tensor
parallelism (ETP), megatron's all-to-all token dispatcher on CPU, and router metrics. Which families
route how, and their TransformerConfig keys: stages/trainer/moe_config.py.

Layouts:
  * HF (checkpoint format, what save_pretrained writes and SGLang loads): `mlp.gate.weight` [E, h]
    (the router; GLM adds `mlp.gate.e_score_correction_bias` [E]) and per expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight`. transformers 5 keeps them fused in memory
    (`mlp.experts.gate_up_proj` [E, 2I, h], `down_proj` [E, h, I]) and also reads that form from
    disk, so both are read here; the export writes the checkpoint format. Shared experts: Qwen2-MoE's
    `mlp.shared_expert.{gate,up,down}_proj.weight` + `mlp.shared_expert_gate.weight` [1, h], GLM's
    `mlp.shared_experts.{gate,up,down}_proj.weight`.
  * megatron local spec (SequentialMLP): `mlp.router.weight` (`mlp.router.expert_bias`) and per local
    expert `mlp.experts.local_experts.{i}.linear_fc1.weight` = cat(gate, up), `...linear_fc2.weight`;
    the TE spec's grouped GEMM (TEGroupedMLP) holds `mlp.experts.linear_fc1.weight{i}`; the grouped
    experts of grouped_experts.py (GroupedMLP's layout) hold all local experts in two tensors,
    `mlp.experts.weight1` = [h, n * 2I] read as n blocks [h, 2I] (fc1 transposed) and
    `mlp.experts.weight2` = [n * I, h] read as n blocks [I, h] (fc2 transposed). The mapping works on
    per-expert tensors and converts at the edges (group_expert_weights, _local_expert_views).
    Shared experts (SharedExpertMLP) are a dense MLP split over TP like any other:
    `mlp.shared_experts.linear_fc1.weight` = cat(gate, up), `linear_fc2.weight`, `gate_weight` [1, h].
  * EP rank r holds global experts r * E/ep .. (r+1) * E/ep - 1 as local 0 ..; ETP shards each
    expert's fc1 (gate and up separately) and fc2 like TP does a dense MLP.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from stages.trainer.moe_config import (  # noqa: F401  (callers use them as moe.*)
    MOE_TYPES,
    check_supported,
    config_kwargs,
    is_moe,
    num_experts,
    shared_expert_size,
)

_LOCAL = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")
_STACKED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])$")


# -- HF <-> megatron ---------------------------------------------------------------------------------
def _expert_hf(get: Callable[[str], torch.Tensor], p: str, e: int, inter: int):
    """(gate [I, h], up [I, h], down [h, I]) of HF expert e of the layer with prefix p."""
    try:
        return tuple(get(p + f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
    except KeyError:  # the fused in-memory form of transformers 5, saved as is
        gate_up = get(p + "mlp.experts.gate_up_proj")[e]
        return gate_up[:inter], gate_up[inter:], get(p + "mlp.experts.down_proj")[e]


def _shared_hf(hc) -> str:
    """The HF prefix (after the layer's) of the shared expert MLP."""
    return "mlp.shared_expert." if hc.model_type == "qwen2_moe" else "mlp.shared_experts."


def hf_to_mcore_moe(
    get,
    hc,
    p: str,
    *,
    ep: int,
    ep_rank: int,
    etp: int,
    etp_rank: int,
    te: bool,
    tp: int = 1,
    tp_rank: int = 0,
) -> dict:
    """An MoE layer's router, shared expert (split over TP: `tp`, `tp_rank`) and this EP/ETP rank's
    experts (keys relative to the layer)."""
    nl = num_experts(hc) // ep
    out = {"mlp.router.weight": get(p + "mlp.gate.weight")}
    if hc.model_type == "glm4_moe":
        out["mlp.router.expert_bias"] = get(p + "mlp.gate.e_score_correction_bias")
    if shared_expert_size(hc):
        s = p + _shared_hf(hc)
        gate, up = (get(s + f"{n}_proj.weight").chunk(tp, 0)[tp_rank] for n in ("gate", "up"))
        out["mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up]).contiguous()
        out["mlp.shared_experts.linear_fc2.weight"] = (
            get(s + "down_proj.weight").chunk(tp, 1)[tp_rank].contiguous()
        )
        if hc.model_type == "qwen2_moe":
            out["mlp.shared_experts.gate_weight"] = get(p + "mlp.shared_expert_gate.weight")
    for i in range(nl):
        gate, up, down = _expert_hf(get, p, ep_rank * nl + i, hc.moe_intermediate_size)
        fc1 = torch.cat([gate.chunk(etp, 0)[etp_rank], up.chunk(etp, 0)[etp_rank]]).contiguous()
        fc2 = down.chunk(etp, 1)[etp_rank].contiguous()
        if te:
            out[f"mlp.experts.linear_fc1.weight{i}"], out[f"mlp.experts.linear_fc2.weight{i}"] = fc1, fc2
        else:
            out[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1
            out[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = fc2
    return out


def mcore_to_hf_moe(sub: str, full: torch.Tensor, p: str, hc) -> list[tuple[str, torch.Tensor]] | None:
    """A layer-relative megatron key of an MoE layer (experts numbered globally, TP/ETP-merged) -> HF
    pairs; None if `sub` is not an MoE key."""
    if sub == "mlp.router.weight":
        return [(p + "mlp.gate.weight", full)]
    if sub == "mlp.router.expert_bias":
        return [(p + "mlp.gate.e_score_correction_bias", full)]
    if sub == "mlp.shared_experts.gate_weight":
        return [(p + "mlp.shared_expert_gate.weight", full)]
    if sub.startswith("mlp.shared_experts.linear_fc"):
        q = p + _shared_hf(hc)
        if sub.endswith("fc2.weight"):
            return [(q + "down_proj.weight", full)]
        gate, up = full.chunk(2, 0)
        return [(q + "gate_proj.weight", gate), (q + "up_proj.weight", up)]
    m = re.fullmatch(
        r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12])\.weight|linear_(fc[12])\.weight(\d+))", sub
    )
    if m is None:
        return None
    e, fc = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
    q = p + f"mlp.experts.{e}."
    if fc == "fc2":
        return [(q + "down_proj.weight", full)]
    gate, up = full.chunk(2, 0)
    return [(q + "gate_proj.weight", gate), (q + "up_proj.weight", up)]


def is_expert_param(key: str) -> bool:
    return bool(_LOCAL.match(key) or _GROUPED.match(key) or _STACKED.match(key))


def group_expert_weights(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A local state dict with per-expert keys (hf_to_mcore's) -> the same with each layer's experts
    stacked into weight1/weight2 where `model` runs them as GroupedExperts; other layers unchanged."""
    from stages.trainer.grouped_experts import GroupedExperts

    out = dict(state)
    for i, layer in enumerate(model.decoder.layers):
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, GroupedExperts):
            continue
        p = f"decoder.layers.{i}.mlp.experts."
        n, h = experts.num_local_experts, experts.config.hidden_size
        fc1 = [out.pop(f"{p}local_experts.{e}.linear_fc1.weight") for e in range(n)]
        fc2 = [out.pop(f"{p}local_experts.{e}.linear_fc2.weight") for e in range(n)]
        # [n, h, 2I] and [n, I, h] contiguous: exactly the memory of weight1 [h, n*2I], weight2 [n*I, h]
        out[p + "weight1"] = torch.stack([w.t() for w in fc1]).contiguous().view(h, -1)
        out[p + "weight2"] = torch.stack([w.t() for w in fc2]).contiguous().view(-1, h)
    return out


def _no_load_count(routing_map, padding_mask=None) -> None:
    return None


def freeze_expert_bias(model) -> int:
    """Each router's `expert_bias` buffer (GLM's e_score_correction_bias) -> a parameter that takes no
    gradient; returns how many. The export (export.py) and so the weight push walk named_parameters: as
    a buffer the bias would be missing from pushes and saved checkpoints. Without requires_grad,
    megatron's DDP and optimizer leave it out; its state_dict key is the same.

    The router's per-expert token count (`_apply_expert_bias`) is skipped: it feeds only the bias
    update, which is off (rate 0, moe_config), and megatron-core 0.16's raises on any forward given a
    padding mask (it ands routing_map [T, E] with the mask [T])."""
    from megatron.core.transformer.moe.router import TopKRouter

    n = 0
    for m in model.modules():
        if isinstance(m, TopKRouter) and m._buffers.get("expert_bias") is not None:
            bias = m._buffers.pop("expert_bias")
            m.expert_bias = torch.nn.Parameter(bias, requires_grad=False)
            m._apply_expert_bias = _no_load_count
            n += 1
    return n


def adapt_built_model(model, hc) -> None:
    """After building an MoE policy: expert biases as frozen parameters (freeze_expert_bias). (The expert
    count is read through moe_config.num_experts everywhere: GLM names it n_routed_experts.)"""
    freeze_expert_bias(model)


def expert_biases(model) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, fp32 copy) of each router's expert bias: to put back after Float16Module casts
    every parameter to bf16, which would round biases of a few units by ~1e-2, more than the gaps
    between experts' sigmoid scores (megatron casts it back to fp32 only at the forward, rounded)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        (m.expert_bias, m.expert_bias.detach().float().clone())
        for m in model.modules()
        if isinstance(m, TopKRouter) and getattr(m, "expert_bias", None) is not None
    ]


def restore_expert_biases(saved: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    for p, fp32 in saved:
        p.data = fp32.to(p.device)


def _local_expert_views(key: str, t: torch.Tensor, hc, num_local: int) -> list[tuple[str, torch.Tensor]]:
    """One parameter of the experts -> (local per-expert key, tensor) pairs: the stacked weight1 /
    weight2 of GroupedExperts split into each expert's linear_fc1 / linear_fc2 (views, transposed
    back); any other expert parameter as it is."""
    m = _STACKED.match(key)
    if m is None:
        return [(key, t)]
    h = hc.hidden_size
    if m.group(2) == "1":
        return [
            (f"{m.group(1)}local_experts.{e}.linear_fc1.weight", w.t())
            for e, w in enumerate(t.view(num_local, h, -1))
        ]
    return [
        (f"{m.group(1)}local_experts.{e}.linear_fc2.weight", w.t())
        for e, w in enumerate(t.view(num_local, -1, h))
    ]


def global_expert_key(key: str, ep_rank: int, num_local: int) -> str:
    """A local expert's parameter name -> the same name with its global expert index."""
    m = _LOCAL.match(key)
    if m:
        return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"
    m = _GROUPED.match(key)
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}"


def gather_experts(key: str, t: torch.Tensor, hc, merge_tp) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over this rank's ETP and EP groups: one local expert parameter -> (global key, full
    tensor) for the same local slot on every EP rank. Every rank of the world calls it for every
    expert parameter in the same order (EP groups span data-parallel ranks)."""
    from megatron.core import parallel_state as ps

    etp = ps.get_expert_tensor_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    nl = num_experts(hc) // ep
    for local_key, local in _local_expert_views(key, t, hc, nl):
        if etp > 1:  # every expert parameter is an fc1 or fc2, split over the expert-TP group
            shards = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(etp)]
            dist.all_gather(shards, local.contiguous(), group=ps.get_expert_tensor_parallel_group())
            local = merge_tp(local_key, shards, hc)
        parts = [local]
        if ep > 1:
            parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(ep)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_expert_model_parallel_group())
        for r, full in enumerate(parts):
            yield global_expert_key(local_key, r, nl), full


# -- megatron's all-to-all dispatcher on CPU ---------------------------------------------------------
def _dtoh_without_streams(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA streams: on CPU the
    split sizes are host tensors already; the all-to-all wants them as numpy, as on GPUs."""

    def host(t, as_numpy=False):
        return t.numpy() if as_numpy and torch.is_tensor(t) else t

    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = host(self.input_splits, True)
        self.output_splits = host(self.output_splits, True)
        self.output_splits_tp = host(self.output_splits_tp, True)
    return tokens_per_expert


_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def prepare_megatron() -> None:
    """Before building an MoE model. megatron-core 0.16's moe_utils imports its transformer-engine
    kernels in a try block and, without TE, leaves the names undefined; the router's gating GEMM then
    tests `te_general_gemm is not None` and raises NameError (CPU, or a GPU without TE). The names
    become None, which is what that code tests for. On CPU, also `cpu_alltoall`. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    # the aux-loss gradient scale is a class attribute that later schedules copy_ into: one left by an
    # earlier model in this process (of another shape: [1] vs []) would break this model's first step
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    if not torch.cuda.is_available():
        cpu_alltoall()


def cpu_alltoall() -> None:
    """Let megatron's all-to-all token dispatcher run without CUDA (W9 of cpu_shim's list): it makes a
    CUDA side stream for device-to-host copies of the split sizes."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    if D.cuda_dtoh_stream is None:
        D.cuda_dtoh_stream = "cpu: no stream"  # the constructor makes a stream only when unset
    D._maybe_dtoh_and_synchronize = _dtoh_without_streams


# -- router metrics ----------------------------------------------------------------------------------
class RouterStats:
    """Tokens per expert (and, with a capacity factor, dropped assignments) of every router on this
    rank, counted by forward hooks and turned into metrics once per step.

    Counts are summed over the whole world: data-parallel and context-parallel ranks route different
    tokens, pipeline stages own different layers (rows of other stages are zero), and TP ranks without
    sequence parallelism route the same tokens, which scales a layer's counts uniformly and leaves the
    ratios below as they are. Positions the model's forward gets as `padding_mask` (True = padding;
    megatron hands it to each router, whose load-balancing loss leaves them out too) are not counted;
    without it every routed position is."""

    def __init__(self, model, hc, capacity_factor: float | None = None, aux_loss: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        self.experts, self.topk = num_experts(hc), hc.num_experts_per_tok
        self.capacity, self.aux_loss = capacity_factor, aux_loss
        # per global layer: E expert loads, tokens routed, router calls, summed aux loss
        self.counts: torch.Tensor | None = None
        self.layers = hc.num_hidden_layers
        while hasattr(model, "module"):  # under DDP / Float16Module wrappers (model.unwrap's loop)
            model = model.module
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if isinstance(router, TopKRouter):
                router.register_forward_hook(self._hook(layer.layer_number - 1), with_kwargs=True)

    def _hook(self, i: int):
        def hook(module, args, kwargs, out):
            _, routing_map = out
            padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            with torch.no_grad():
                if self.counts is None:
                    self.counts = torch.zeros(
                        self.layers, self.experts + 3, dtype=torch.float64, device=routing_map.device
                    )
                if padding is not None:  # [s, b] like the router's tokens, flattened the same way
                    routing_map = routing_map[~padding.reshape(-1)]
                self.counts[i, : self.experts] += routing_map.sum(0)
                self.counts[i, self.experts] += routing_map.shape[0]
                self.counts[i, self.experts + 1] += 1

        return hook

    def _aux_losses(self) -> None:
        """Move megatron's per-layer load-balancing loss sums (unscaled, one per router call) into
        the counts and clear its tracker."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if entry is not None and self.counts is not None:
            values = entry["values"]
            self.counts[: len(values), self.experts + 2] += values.to(self.counts)
            values.zero_()

    def metrics(self) -> dict[str, float]:
        """Collective (every rank): the step's router metrics; resets the counts.

        moe/load_max_over_mean: the busiest expert's tokens over the mean per expert (1 = balanced,
        E/k = all to the same experts), mean over MoE layers; `_worst_layer` is the largest;
        moe/dropped: assignments dropped by the capacity factor; moe/aux_loss: the load-balancing
        loss (unscaled) when trainer.moe_aux_loss_coef > 0."""
        if self.aux_loss:
            self._aux_losses()
        c = self.counts
        if c is None:  # this rank has no MoE layer (a pipeline stage), but must join the sum
            device = "cuda" if torch.cuda.is_available() else "cpu"
            c = torch.zeros(self.layers, self.experts + 3, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(c)
        c = c.cpu()
        self.counts = None
        rows = c[c[:, self.experts] > 0]
        if len(rows) == 0:
            return {}
        load = rows[:, : self.experts]
        ratio = load.max(1).values / load.mean(1).clamp_min(1e-12)
        out = {
            "moe/load_max_over_mean": ratio.mean().item(),
            "moe/load_max_over_mean_worst_layer": ratio.max().item(),
        }
        if self.capacity is not None:
            assigned = rows[:, self.experts].sum() * self.topk
            out["moe/dropped"] = (1 - load.sum() / assigned).item()
        if self.aux_loss:
            out["moe/aux_loss"] = (rows[:, self.experts + 2].sum() / rows[:, self.experts + 1].sum()).item()
        return out


# -- micro-batch counts under expert parallelism -----------------------------------------------------
def equalize_microbatches(mbs: list, align: int, group=None) -> list:
    """Collective over `group` (the data-parallel group): this rank's micro-batches, padded with empty
    ones up to the largest count in the group.

    Each MoE layer's all-to-all runs over the EP group, which spans data-parallel ranks, so every rank
    must run as many forwards and backwards as the others; a rank with fewer micro-batches would wait
    in its gradient sync while the others wait in an all-to-all (a hang). An empty micro-batch is one
    row of `align` padding positions with no response token: it is routed, and adds nothing to the
    loss, the logprobs or the token counts."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return mbs
    group = group or ps.get_data_parallel_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = torch.tensor([len(mbs)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return list(mbs) + [empty_microbatch(align) for _ in range(int(n.item()) - len(mbs))]


def empty_microbatch(row_len: int):
    from stages.trainer.packing import MicroBatch

    zeros = torch.zeros(1, row_len, dtype=torch.long)
    return MicroBatch(
        tokens=zeros,
        targets=zeros.clone(),
        segments=torch.full((1, row_len), -1, dtype=torch.long),  # padding's own segment id
        resp_pos=torch.zeros(0, dtype=torch.long),
        tok_index=torch.zeros(0, dtype=torch.long),
        num_tokens=0,
        cu_seqlens=torch.tensor([0, row_len], dtype=torch.int32),
        max_segment_len=row_len,
    )
