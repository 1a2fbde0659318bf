"""CPU shims that let megatron-core 0.16 run on a machine without CUDA (gloo backend).

megatron-core assumes CUDA in a handful of places (measured in /work/shared/notes/megatron-on-cpu.md):
  W1 RNG tracker reads/writes the CUDA generator      -> back it by the CPU generator
  W2 torch.cuda.current_device() for buffer placement -> "cpu"
  W3 default causal mask built with device="cuda"     -> callers always pass an explicit mask
  W4 literal device="cuda"/int devices in factories   -> rewritten to "cpu" by `device_mode()`
  W5 asserts on Tensor.type() == "torch.cuda.*"       -> `device_mode()` reports the CUDA type name
  W6 batch_p2p_sync calls torch.cuda.synchronize()    -> callers set batch_p2p_sync=False on CPU
  W7 torch.cuda.synchronize() (PP + variable lengths) -> no-op
  W8 pin_memory=True (RoPE's context-parallel split) -> unpinned

`activate()` is idempotent and does nothing when CUDA is available, so the same trainer code runs on
GPUs unchanged. The shims touch private megatron names: megatron-core is pinned to >=0.16,<0.17 on
Python 3.11 for that reason.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_active = False


def needed() -> bool:
    return not torch.cuda.is_available()


def activate() -> bool:
    """Install W1, W2 and W7 (process-wide) when there is no CUDA; returns whether shims are active."""
    global _active
    if _active or not needed():
        return _active
    import megatron.core.tensor_parallel.random as rng

    torch.cuda.current_device = lambda: "cpu"  # W2
    torch.cuda.synchronize = lambda *a, **k: None  # W7
    rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # W1
    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def _add(self, name, seed):  # W1: per-name RNG states kept as CPU generator states
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists in the RNG tracker")
        self.seeds_.add(seed)
        self._is_initialized = True
        old = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(old)

    rng.CudaRNGStatesTracker.add = _add
    logging.getLogger(rng.__name__).setLevel(logging.ERROR)  # it warns on every CPU RNG use
    _active = True
    return True


class _CudaToCpu(TorchFunctionMode):
    """W4/W5: rewrite device="cuda" / int devices to CPU and report CUDA tensor type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or str(dev).startswith("cuda")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # W8: RoPE's context-parallel split stages its index in pinned memory
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            target = args[1]
            if isinstance(target, int) or (
                isinstance(target, str | torch.device) and str(target).startswith("cuda")
            ):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def device_mode() -> contextlib.AbstractContextManager:
    """Context for megatron optimizer setup, optimizer steps and the forward/backward schedule.

    A no-op context on CUDA. The mode costs no measurable time on CPU (notes, W4).
    """
    return _CudaToCpu() if _active else contextlib.nullcontext()
