"""Weight-push sub-config (`weights:` section)."""

from __future__ import annotations

from typing import Literal

import msgspec


class WeightsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    push_every: int = 1  # push after every K optimizer steps
    # auto: cpu for the torch engine, nccl for disaggregated SGLang, cuda_ipc for colocated SGLang
    transport: Literal["auto", "cpu", "nccl", "cuda_ipc"] = "auto"
    bucket_mb: int = 64  # tensors are sent in buckets of about this size
    timeout_s: float = 120.0  # a push not applied by every engine within this long raises in the trainer
    bind: str = "tcp://127.0.0.1:0"  # cpu transport: the trainer binds here (port 0 = free); engines connect
    # where the trainer keeps the copy of the weights a push sends while training goes on. gpu: on
    # trainer rank 0's GPU (fastest; costs the model's bf16 size there, 15 GB at 7B); cpu: pinned host
    # memory, filled one gathered tensor at a time, so no GPU ever holds a whole-model copy. auto: gpu
    # for the SGLang transports unless the model is over 10 % of the GPU's memory, else cpu
    snapshot: Literal["auto", "gpu", "cpu"] = "auto"

    def __post_init__(self):
        if self.push_every < 0 or self.bucket_mb < 1 or self.timeout_s <= 0:
            raise ValueError("weights needs push_every >= 0 (0 = never), bucket_mb >= 1 and timeout_s > 0")
