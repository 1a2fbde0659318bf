"""The trainer process's CUDA caching-allocator setting, made before its first CUDA allocation.

Training frees and allocates activation chunks of varying size every micro-batch. The default
allocator keeps freed memory reserved in pieces, and a later large request may find none big enough:
the 7B pipeline at TP=2 (bench/RESULTS.md, GPU session of 2026-11-27, 05:10 UTC) ran out of memory on a
1 GiB request in its first weight push with 5 GiB reserved but unallocated. Expandable segments grow
one mapped segment page by page, so freed memory serves a request of any size; bench/trainer_gpu.py
measured 7B at TP=2 with them (73 GB per GPU).

Not under weights.transport=cuda_ipc (nor auto, which may pick it): the trainer then shares its push
buffers with the SGLang server by CUDA IPC, which for expandable segments goes through pidfd_getfd,
refused in unprivileged containers (pytorch/pytorch#165685). A PYTORCH_CUDA_ALLOC_CONF the user set is
kept as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.trainer.config import TrainerConfig
    from stages.weights.config import WeightsConfig

log = logging.getLogger(__name__)

EXPANDABLE = "expandable_segments:True"
# the weight transports that never hand the trainer's CUDA memory to another process
WITHOUT_CUDA_IPC = ("cpu", "nccl")
# the allocator settings a user may have made (PYTORCH_ALLOC_CONF: the newer name): kept as they are
USER_KEYS = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}


def choose_allocator(
    trainer: TrainerConfig, weights: WeightsConfig, env: MutableMapping[str, str] | None = None
) -> str | None:
    """Set PYTORCH_CUDA_ALLOC_CONF in `env` (default os.environ) for a CUDA trainer (trainer.device) whose
    weights leave without CUDA IPC (weights.transport), before the process's first CUDA allocation;
    returns what it set (None: nothing)."""
    env = os.environ if env is None else env
    if trainer.device != "cuda" or weights.transport not in WITHOUT_CUDA_IPC or USER_KEYS & set(env):
        return None
    import torch

    if torch.cuda.is_initialized():  # the allocator has made segments already
        log.warning("trainer: CUDA is in use already; %s not set (call choose_allocator first)", EXPANDABLE)
        return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    if env is os.environ and torch.cuda.is_available():
        # newer torch may read the variable when it is imported, as the Ray worker did before this:
        # tell the allocator too
        # (torch >= 2.9's name; torch.cuda.memory._set_allocator_settings before, deprecated since)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            setter = torch.cuda.memory._set_allocator_settings
        try:
            setter(EXPANDABLE)
        except RuntimeError as e:
            log.warning(
                "trainer: could not set %s on the allocator (%s); the environment has it", EXPANDABLE, e
            )
    return EXPANDABLE
