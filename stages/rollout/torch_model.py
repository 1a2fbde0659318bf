"""What the torch engine needs to know of the HF model it runs: its tensors under the names weight
updates use, LoRA adapters it applies over the base it keeps (trainer.lora.push=adapter), and (for
routing replay) the experts its MoE routers chose.

Adapters. An adapter push names, for each adapted HF module, `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] (B already scaled by alpha/r; stages/trainer/lora_peft.py), an MoE
layer's experts one by one (`mlp.experts.{e}.gate_proj.lora_A.weight`). The engine's weights stay the
base: a linear gets `lora_A` / `lora_B` children and a forward hook adding x A^T B^T to its output; a
fused experts module (transformers 5) gets stacked `lora_<proj>_A` [E, r, in] / `lora_<proj>_B`
[E, out, r] and a forward that adds each expert's low-rank output to its projections (the fc1 ones
before the activation). These are built empty (B zero: the model computes what it did) when a weight
receiver announces the shapes (`announce_adapters`), on the engine's own thread at the next
`checkpoint_names` (TorchEngine applies updates there, between forwards); the update then writes them.
"""

from __future__ import annotations

import re
import threading
import types
import weakref

import torch
import torch.nn.functional as F

from stages.rollout.engine import LORA_A

_EXPERT_MODULE = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+_proj)$")
_EXPERT_SLOT = re.compile(r"\.experts\.lora_(\w+_proj)_([AB])$")
_announced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {name: shape}
_announced_lock = threading.Lock()


def announce_adapters(model, shapes: dict[str, tuple[int, ...]]) -> None:
    """Adapter tensors (engine.is_adapter names -> shapes) that an update to `model` is about to carry: their
    slots are built at the next checkpoint_names(model). Thread-safe (a weight receiver's thread)."""
    with _announced_lock:
        _announced.setdefault(model, {}).update(shapes)


def checkpoint_names(model) -> dict[str, torch.Tensor]:
    """The model's tensors by the names checkpoints, SGLang and the trainer's export use.

    transformers 5 keeps an MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, h],
    `mlp.experts.down_proj` [E, h, I]) while checkpoints name each expert
    (`mlp.experts.{e}.gate_proj.weight`, ...): those names become views into the fused tensors, so an
    update writes the expert in place; the experts' adapter slots likewise. Builds the adapter slots
    announced for `model` first (module docstring)."""
    with _announced_lock:
        pending = _announced.pop(model, None)
    if pending:
        _build_adapters(model, pending)
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    for name, p in list(out.items()):
        if p.dim() != 3:
            continue
        slot = _EXPERT_SLOT.search(name)
        if slot is not None:  # an expert adapter's stack: one name per expert, as the push sends them
            base = name[: slot.start()] + ".experts."
            for e in range(p.shape[0]):
                out[f"{base}{e}.{slot.group(1)}.lora_{slot.group(2)}.weight"] = p.data[e]
            continue
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):  # [gate; up] per expert, transformers' own order
                out[f"{base}{e}.gate_proj.weight"] = p.data[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = p.data[e, inter:]
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = p.data[e]
    return out


# -- adapter slots (trainer.lora.push=adapter) ---------------------------------------------------------
def _build_adapters(model, shapes: dict[str, tuple[int, ...]]) -> None:
    """Empty adapter slots for the announced tensors not yet in `model` (module docstring)."""
    modules = dict(model.named_modules())
    have = set(dict(model.named_parameters()))
    want: dict[str, dict[str, tuple[int, ...]]] = {}  # HF module -> {"A": shape, "B": shape}
    for name, shape in shapes.items():
        if name in have:
            continue
        module, kind = name[: -len(LORA_A)], "A" if name.endswith(LORA_A) else "B"
        want.setdefault(module, {})[kind] = tuple(shape)
    stacks: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}  # (experts module, proj) -> shapes
    for module, ab in want.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"an adapter push names {module}.lora_{next(iter(ab))} without its pair")
        m = _EXPERT_MODULE.match(module)
        if m is not None and m.group(1) in modules:
            stacks.setdefault((m.group(1), m.group(3)), ab)
        elif isinstance(modules.get(module), torch.nn.Linear):
            _add_linear_slot(modules[module], ab["A"], ab["B"])
        # any other name is left to the engine, which refuses the update naming it
    for (path, proj), ab in stacks.items():
        _add_expert_slot(modules[path], proj, ab["A"], ab["B"])


def _add_linear_slot(linear: torch.nn.Linear, a: tuple[int, ...], b: tuple[int, ...]) -> None:
    w = linear.weight
    for name, (out, inp) in (("lora_A", a), ("lora_B", b)):
        layer = torch.nn.Linear(inp, out, bias=False, device=w.device, dtype=w.dtype)
        torch.nn.init.zeros_(layer.weight)
        layer.requires_grad_(False)
        setattr(linear, name, layer)
    linear.register_forward_hook(_add_low_rank)


def _add_low_rank(module, args, output):
    return output + module.lora_B(module.lora_A(args[0]))


def _add_expert_slot(experts, proj: str, a: tuple[int, ...], b: tuple[int, ...]) -> None:
    fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}.get(proj)
    base = getattr(experts, fused or "", None)
    if base is None or base.dim() != 3 or getattr(experts, "is_transposed", False):
        raise ValueError(
            f"an adapter push names {proj} of {type(experts).__name__}'s experts, which this engine cannot "
            "apply adapters to (fused gate_up_proj [E, 2I, h] and down_proj [E, h, I] expected); use "
            "trainer.lora.push=merge"
        )
    n = base.shape[0]
    for kind, shape in (("A", a), ("B", b)):
        slot = torch.zeros(n, *shape, device=base.device, dtype=base.dtype)
        setattr(experts, f"lora_{proj}_{kind}", torch.nn.Parameter(slot, requires_grad=False))
    experts.forward = types.MethodType(_experts_with_adapters, experts)


def _low_rank(experts, proj: str, e: int, x: torch.Tensor):
    a = getattr(experts, f"lora_{proj}_A", None)
    return 0 if a is None else F.linear(F.linear(x, a[e]), getattr(experts, f"lora_{proj}_B")[e])


def _experts_with_adapters(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager loop over the hit experts (its fused weights, the routing weights after the
    down projection), with each expert's adapters added to its gate, up and down projections."""
    out = torch.zeros_like(hidden_states)
    inter = self.gate_up_proj.shape[1] // 2
    with torch.no_grad():
        # [E + 1, k, tokens]: index E is transformers' "no expert here" (experts held elsewhere)
        chosen = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(chosen[: self.num_experts].sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    for e in hit:
        k_pos, tok = torch.where(chosen[e])
        x = hidden_states[tok]
        gate_up = F.linear(x, self.gate_up_proj[e])
        gate = gate_up[..., :inter] + _low_rank(self, "gate_proj", e, x)
        up = gate_up[..., inter:] + _low_rank(self, "up_proj", e, x)
        h = self.act_fn(gate) * up
        y = F.linear(h, self.down_proj[e]) + _low_rank(self, "down_proj", e, h)
        out.index_add_(0, tok, (y * top_k_weights[tok, k_pos, None]).to(out.dtype))
    return out


class RouterRecorder:
    """Forward hooks on an MoE model's routers (transformers' `*TopKRouter` or `*TopkRouter`, returning
    (logits, weights, indices)) that keep the experts each forward chose, for routing replay in the
    trainer."""

    def __init__(self, routers: list[torch.nn.Module]):
        self._chosen: list[torch.Tensor] = []
        self.layers = len(routers)
        for r in routers:
            r.register_forward_hook(lambda _m, _in, out: self._chosen.append(out[2]))

    def take(self, shape: torch.Size) -> torch.Tensor:
        """The last forward's choices as [batch, seq, layers, k] (CPU), for input ids of `shape`."""
        chosen, self._chosen = self._chosen[-self.layers :], []  # (a failed forward's are stale)
        return torch.stack([c.view(*shape, -1) for c in chosen], dim=2).cpu()


def record_routing(model) -> RouterRecorder:
    # Qwen's `*TopKRouter`, GLM's `Glm4MoeTopkRouter`: both return (logits, weights, indices)
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    if not routers:
        raise ValueError(
            f"routing replay (trainer.routing_replay) records the engine's expert choices, but "
            f"{model.config.model_type} has no MoE router; turn trainer.routing_replay off for a dense model"
        )
    return RouterRecorder(routers)
