"""The optimizer the policy and the critic train with: megatron's, built on the CPU shim's device,
with what megatron 0.16 leaves out of it (the state SGD's checkpoints load into, Adam's fused kernel)."""

from __future__ import annotations

import torch

from stages.trainer import cpu_shim


def build_optimizer(opt_cfg, model):
    """megatron's optimizer (chained over its parameter groups) for `model`, a DDP-wrapped module."""
    from megatron.core.optimizer import get_megatron_optimizer

    with cpu_shim.device_mode():
        optimizer = get_megatron_optimizer(opt_cfg, [model])
    if opt_cfg.optimizer == "sgd":
        for part in _parts(optimizer):
            if getattr(part, "optimizer", None) is not None and part.init_state_fn is None:
                part.init_state_fn = _make_sgd_state  # see there
    return optimizer


def has_state(optimizer) -> bool:
    """Whether any step made the optimizer's per-parameter state yet (a checkpoint saved before the
    first applied step has none to load)."""
    return any(len(inner.state) for part in _parts(optimizer) if (inner := getattr(part, "optimizer", None)))


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
