"""The fsdp policy and its optimizer as one checkpoint part (checkpoint.Stateful), saved by the
trainer's CheckpointManager unchanged.

CheckpointManager writes every part with megatron's dist_checkpointing, whose torch_dist format is
torch.distributed.checkpoint (DCP) underneath: each rank writes its own shards, a .metadata file maps
them. So this part hands out FSDP2's shards as megatron ShardedTensors: each DTensor's local rows with
their offset in the whole tensor, uneven where FSDP's torch.chunk split is (megatron defers such
layouts to DCP, which reshards them: a checkpoint loads at another data-parallel size). Keys are the
HF names (`model.<name>`, `optimizer.<state>.<name>`); the optimizer's step count and the param
groups' hyperparameters go in megatron's common state (rank 0's common.pt).
"""

from __future__ import annotations

import torch

from stages.trainer.checkpoint import DISTRIBUTED
from stages.trainer.fsdp_model import HeadedLM, hf_named, local

STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # AdamW's moments, SGD's momentum


def _sharded(key: str, t: torch.Tensor):
    """A megatron ShardedTensor of this rank's shard of `t` (a DTensor over the data-parallel mesh, or
    a plain tensor: then one whole replica, written by rank 0); None when this rank holds no rows."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        data, replica = t.to_local(), 0
        if tuple(data.shape) != tuple(shape):
            raise RuntimeError(f"{key}: FSDP's local shard {tuple(data.shape)}, its placement {tuple(shape)}")
    else:
        import torch.distributed as dist

        data, shape, offset, replica = t, tuple(t.shape), (0,) * t.ndim, dist.get_rank()
    if data.numel() == 0:
        return None
    return ShardedTensor(
        key=key,
        data=data.detach(),
        dtype=data.dtype,
        local_shape=tuple(shape),
        global_shape=tuple(t.shape),
        global_offset=tuple(offset),
        axis_fragmentations=None,  # uneven: validated by DCP
        replica_id=replica,
    )


class FsdpPart:
    """checkpoint.Stateful of an FSDP2-sharded HeadedLM and its torch optimizer."""

    def __init__(self, model: HeadedLM, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in hf_named(self.model)]

    def _lay_out_state(self) -> None:
        """The state a checkpoint's optimizer tensors load into (torch makes it at the first step)."""
        sgd = isinstance(self.optimizer, torch.optim.SGD)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state[p]
                if sgd:
                    st.setdefault("momentum_buffer", torch.zeros_like(p))
                elif "exp_avg" not in st:
                    st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p))
                    st["exp_avg_sq"] = torch.zeros_like(p)

    def state_dict(self, loading: bool = False, optimizer: bool = True) -> dict:
        model = {}
        for name, t in self._named():
            st = _sharded(f"model.{name}", t)
            if st is not None:
                model[name] = st
        out: dict = {"model": model}
        if not optimizer or self.optimizer is None:
            return out
        if loading:
            self._lay_out_state()
        state: dict = {}
        steps = set()
        for name, p in self._named():
            st = self.optimizer.state.get(p) if isinstance(p, torch.nn.Parameter) else None
            if not st:
                continue
            for k in STATE_KEYS:
                if k in st:
                    sharded = _sharded(f"optimizer.{k}.{name}", st[k])
                    if sharded is not None:
                        state.setdefault(k, {})[name] = sharded
            if "step" in st:
                steps.add(float(st["step"]))
        if len(steps) > 1:
            raise RuntimeError(f"optimizer parameters at different step counts {sorted(steps)}")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        out["optimizer"] = {"state": state, "step": steps.pop() if steps else None, "param_groups": hyper}
        return out

    def load_state_dict(self, state: dict) -> None:
        params = dict(self._named())
        with torch.no_grad():
            for name, t in state["model"].items():
                local(params[name]).copy_(t)
            if "optimizer" not in state or self.optimizer is None:
                return
            opt = state["optimizer"]
            for k, by_name in opt["state"].items():
                for name, t in by_name.items():
                    local(self.optimizer.state[params[name]][k]).copy_(t)
            for group, saved in zip(self.optimizer.param_groups, opt["param_groups"], strict=True):
                group.update(saved)
            if opt["step"] is not None:
                for st in self.optimizer.state.values():
                    if "step" in st:  # one tensor per parameter: torch's Adam advances each in place
                        st["step"] = torch.tensor(opt["step"], dtype=torch.float32)

    def has_optimizer_state(self) -> bool:
        return self.optimizer is not None and len(self.optimizer.state) > 0

    def optimizer_format(self) -> str:
        """Sharded over the data-parallel ranks as megatron's distributed optimizer's is (and, like it,
        reloadable at another dp). A megatron checkpoint still does not load here: its keys are
        megatron's, and dist_checkpointing refuses the missing HF ones."""
        return DISTRIBUTED
