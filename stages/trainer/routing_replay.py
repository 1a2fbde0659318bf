"""Routing replay ("R3") for MoE policies: the trainer's routers take the experts the engine chose.

The engine and the trainer compute a token's router logits with different kernels; where two experts
score almost alike, they pick different ones, and the trainer then computes the logprob of a token
under experts that did not produce it. With `trainer.routing_replay` the engines record, per position,
the top-k experts of every MoE layer (Sample.routed_experts) and the policy's forwards (logp_old and
the loss) route each position to those experts. The router's weights still get gradients: the
combination weights are the router's own scores at the replayed experts.

Megatron's TopKRouter asks `router.router_replay.get_replay_topk(...)` for its top-k when that
attribute is set (megatron-core's RouterReplay keeps every instance in one process-wide list); here
each router of the policy gets a `ReplayTarget` of its own instead, so the reference model, the
critic and any other model in the process route as usual. Positions without a recording (padding, a
sample whose engine returned none, -1 in MicroBatch.routed) keep the router's own choice.
"""

from __future__ import annotations

import torch

from stages.models import moe_layer_flags
from stages.trainer.moe_config import num_experts
from stages.trainer.packing import routed_width_problem


class ReplayTarget:
    """What one router replays for the current micro-batch ([tokens, k], -1 rows: route yourself), and
    how often its own choice agreed with the recorded one (the routing mismatch replay removes)."""

    def __init__(self):
        self.target: torch.Tensor | None = None
        self.recorded = 0  # positions with a recording (summed over forwards; tensors until read)
        self.agreed = 0  # of those, where the router's own top-k set equals the recorded one

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, own
        target = self.target.to(scores.device, non_blocking=True)
        has = (target >= 0).all(-1, keepdim=True)
        with torch.no_grad():
            same = (own.sort(-1).values == target.sort(-1).values).all(-1, keepdim=True)
            self.recorded = self.recorded + has.sum()
            self.agreed = self.agreed + (same & has).sum()
        idx = torch.where(has, target.long(), own)
        # the score function's own top-k values at these experts (softmax after top-k, or pre-softmax
        # probabilities): megatron turns them into the combination weights as for its own choice. A
        # sigmoid router with an expert bias passes biased scores here, keeps only the indices and
        # gathers the unbiased scores itself; a group limit does not restrict replayed experts
        return scores.gather(1, idx), idx


class RoutingReplay:
    """The ReplayTargets of one model's routers (this pipeline stage's), by MoE layer index."""

    def __init__(self, model, hc):
        from megatron.core.transformer.moe.router import TopKRouter

        flags = moe_layer_flags(hc)
        moe_index = {g: sum(flags[:g]) for g in range(len(flags)) if flags[g]}
        self.routers: list[tuple[int, ReplayTarget]] = []
        for m in model.modules():
            if isinstance(m, TopKRouter):
                if m.layer_number is None or m.layer_number - 1 not in moe_index:
                    raise RuntimeError(
                        f"routing replay: a router has layer number {m.layer_number}, not an MoE layer's"
                    )
                target = ReplayTarget()
                m.router_replay = target
                self.routers.append((moe_index[m.layer_number - 1], target))
        self.shape = (sum(flags), hc.num_experts_per_tok)
        self.num_experts = num_experts(hc)

    def check_batch(self, tb) -> None:
        """Every sample's recording fits this model (whole rows of moe_layers x k ids, each id an
        expert): checked on the whole batch on every rank, so a bad one fails all ranks alike (a rank
        failing alone inside a micro-batch would leave the others waiting in a collective)."""
        if tb.routed is None:
            return
        import numpy as np

        values, offsets = tb.routed
        positions = np.diff(tb.prompt_off) + np.diff(tb.response_off) - 1
        entries = np.diff(offsets)
        bad = np.flatnonzero((entries > 0) & (entries != positions * self.shape[0] * self.shape[1]))
        if len(bad):
            i = int(bad[0])
            raise ValueError(routed_width_problem(i, int(entries[i]), int(positions[i]), self.shape))
        if len(values) and (int(values.max()) >= self.num_experts or int(values.min()) < 0):
            # an id past the router's scores would index out of range (a device-side assert on CUDA)
            raise ValueError(
                f"routed_experts names expert {int(values.max())}, but this model has {self.num_experts} "
                "experts per MoE layer: the engine served another model than the trainer's"
            )

    def set_microbatch(self, routed: torch.Tensor | None, tp_rank: int = 0, tp: int = 1) -> None:
        """Targets for the next forward from MicroBatch.routed [b, s, moe_layers, k] (this CP rank's
        positions); under sequence parallelism each TP rank routes its 1/tp of the positions."""
        if routed is None:
            for _, t in self.routers:
                t.target = None
            return
        if tp > 1:
            routed = routed.chunk(tp, dim=1)[tp_rank]
        by_position = routed.transpose(0, 1)  # the router sees hidden states [s, b, h] flattened s-major
        for layer, t in self.routers:
            t.target = by_position[:, :, layer].reshape(-1, self.shape[1])

    def metrics(self) -> dict:
        """routing/replayed: recorded positions x layers routed by replay since the last call;
        routing/agreement: the share of them where the trainer's own choice was the same experts."""
        recorded = sum(float(t.recorded) for _, t in self.routers)
        agreed = sum(float(t.agreed) for _, t in self.routers)
        for _, t in self.routers:
            t.recorded = t.agreed = 0
        out = {"routing/replayed": recorded}
        if recorded:
            out["routing/agreement"] = agreed / recorded
        return out
