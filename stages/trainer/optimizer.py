"""The optimizer the policy and the critic train with: megatron's, built on the CPU shim's device,
with what megatron 0.16 leaves out of it (the state SGD's checkpoints load into, Adam's fused kernel)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from stages.trainer import cpu_shim
from stages.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig


def lr_at(tc: TrainerConfig, version: int, steps: int) -> float:
    """The policy's learning rate at `version` (warmup, then constant, or cosine from trainer.lr to
    trainer.min_lr over the run's `steps`). The critic follows it, scaled (critic.py)."""
    s = version
    if tc.warmup_steps and s < tc.warmup_steps:
        lr = tc.lr * (s + 1) / tc.warmup_steps
    elif tc.lr_schedule == "constant":
        lr = tc.lr
    else:  # cosine from lr to min_lr over the run
        frac = min(1.0, (s - tc.warmup_steps) / max(1, steps - tc.warmup_steps))
        lr = tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * frac))
    return lr


def build_optimizer(opt_cfg: OptimizerConfig, model: torch.nn.Module):
    """megatron's optimizer (chained over its parameter groups) for `model`, a DDP-wrapped module."""
    from megatron.core.optimizer import get_megatron_optimizer

    with cpu_shim.device_mode():
        optimizer = get_megatron_optimizer(opt_cfg, [model])
    if opt_cfg.use_distributed_optimizer:
        for part in _parts(optimizer):
            _load_torch_adam_state(part)
    if opt_cfg.optimizer == "sgd":
        for part in _parts(optimizer):
            if getattr(part, "optimizer", None) is not None and part.init_state_fn is None:
                part.init_state_fn = _make_sgd_state  # see there
    return optimizer


def _load_torch_adam_state(part) -> None:
    """Let a distributed optimizer over torch's Adam load its state exactly: two gaps of megatron 0.16's
    `DistributedOptimizer.load_state_dict` that only its torch-Adam fallback meets (Apex's and
    transformer-engine's Adam keep the step in the param groups, not per parameter), on our CPU and
    GPU machines alike. Patched on this instance, by wrapping two of its methods:

    - its loaders (`load_parameter_state_from_fully_reshardable` and the other formats') leave the
      per-parameter `step` out of what they hand `_set_main_param_and_optimizer_states` ("handled
      separately"), which then copies every key of the live state, `step` among them: KeyError 'step'.
      The setter here copies all but `step`, which keeps the value `load_state_dict` set from the
      param groups;
    - `load_state_dict` gives every parameter's state one shared `step` tensor, which torch's Adam then
      advances once per parameter at each step: from the first step after a resume the bias correction
      used a step count thousands too high, and the run left the uninterrupted one. Each parameter gets
      its own copy back."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if (
        not isinstance(part, DistributedOptimizer)
        or part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    ):
        return
    inner, set_states, load = part.optimizer, part._set_main_param_and_optimizer_states, part.load_state_dict

    def set_all_but_step(model_param, tensors):
        if "step" in tensors:
            return set_states(model_param, tensors)
        group_index, group_order = part.model_param_group_index_map[model_param]
        state = inner.state[inner.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            set_states(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    def load_own_steps(state_dict):
        load(state_dict)
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    part._set_main_param_and_optimizer_states = set_all_but_step
    part.load_state_dict = load_own_steps


def is_distributed(optimizer) -> bool:
    """Whether `optimizer` is megatron's DistributedOptimizer (or chains them): Adam state sharded over
    the data-parallel group (for expert parameters the expert-data-parallel group)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(part, DistributedOptimizer) for part in _parts(optimizer))


def has_state(optimizer) -> bool:
    """Whether any step made the optimizer's per-parameter state yet (a checkpoint saved before the
    first applied step has none to load)."""
    return any(len(inner.state) for part in _parts(optimizer) if (inner := getattr(part, "optimizer", None)))


def lay_out_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet the Adam state a checkpoint loads into.

    Without Apex / transformer-engine (megatron falls back to torch's Adam: on the CPU and on our GPU
    machines alike) megatron 0.16's `DistributedOptimizer.state_dict()`, which its `sharded_state_dict`
    calls first, also when loading, reads the iteration from every parameter's state `step` and asserts
    there is exactly one value: an optimizer that has not stepped has none, so a resume failed there
    (`assert len(steps) == 1`). Zero moments and step 0, as torch's Adam makes them at its first step;
    the checkpoint's values replace them. Nothing to do once the optimizer has stepped."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in _parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if not isinstance(part, DistributedOptimizer) or len(inner.state):
            continue
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                inner.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def use_fused_adam(optimizer) -> None:
    """Switch the torch Adam that megatron falls back to (no apex / transformer-engine) to its fused
    CUDA kernel. Megatron builds it with torch's default, the multi-tensor "foreach" path, whose step
    allocates temporaries the size of all fp32 master weights (14 GB per GPU for a 7B model at TP=2:
    the difference between fitting on two 80 GB cards and not); the fused kernel allocates none and
    launches fewer kernels. Set before the first step, when the state (and its step counters) is made."""
    for part in _parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True
            inner.defaults.update(foreach=False, fused=True)


def _parts(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _make_sgd_state(opt: torch.optim.Optimizer, config=None) -> None:
    """The state a checkpoint's SGD tensors load into: megatron calls its optimizer's `init_state_fn`
    before loading, to lay out the state the checkpoint fills, and builds SGD with none, so a run with
    trainer.optimizer=sgd could not resume ("'NoneType' object is not callable"). Placeholder momentum
    buffers (torch makes them at the first step); the checkpoint's values replace them."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))
