"""What the torch engine needs to know of the HF model it runs: its tensors under the names weight
updates use, and (for routing replay) the experts its MoE routers chose."""

from __future__ import annotations

import torch


def checkpoint_names(model) -> dict[str, torch.Tensor]:
    """The model's tensors by the names checkpoints, SGLang and the trainer's export use.

    transformers 5 keeps an MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, h],
    `mlp.experts.down_proj` [E, h, I]) while checkpoints name each expert
    (`mlp.experts.{e}.gate_proj.weight`, ...): those names become views into the fused tensors, so an
    update writes the expert in place."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    for name, p in list(out.items()):
        if p.dim() != 3:
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
