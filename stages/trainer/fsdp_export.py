"""The fsdp backend's weights out: full HF-named tensors on rank 0, gathered one at a time from FSDP's
shards (a pure HF model's names are its state dict's), as the weight publisher (WeightExport) and
save_hf take them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from stages.trainer.export import HostSnapshot
from stages.trainer.fsdp_model import HeadedLM, full_tensor, hf_named


def iter_full(model: HeadedLM, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) on rank 0, one gathered tensor alive at a time; nothing elsewhere.
    Collective: every rank consumes it to the end, in step."""
    rank0 = dist.get_rank() == 0
    for name, t in hf_named(model):
        full = full_tensor(t)  # all ranks gather (FSDP shards are DTensors over the data-parallel mesh)
        if rank0:
            yield name, full if dtype is None else full.to(dtype)
        del full


class FsdpExport:
    """stages/weights/publisher.WeightExport of the fsdp policy. `dtype`: what is pushed and saved
    (bf16 for a bf16 run, as the megatron backend's bf16 weights are; None keeps fp32)."""

    def __init__(self, model: HeadedLM, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype

    def snapshot(
        self, *, device: str = "cpu", host: HostSnapshot | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Fresh copies (a background push may run while training changes the weights)."""
        out = {}
        for name, t in iter_full(self.model, self.dtype):
            out[name] = host.copy(name, t.contiguous()) if host is not None else t.to(device, copy=True)
        if dist.get_rank() != 0:
            return None
        if host is not None and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies were queued without waiting
        return out

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_full(self.model, self.dtype)

    def host_buffers(self) -> HostSnapshot:
        return HostSnapshot()

    def model_bytes(self) -> int:
        """The whole model's bytes as pushed (global shapes of the shards)."""
        size = torch.tensor([], dtype=self.dtype).element_size() if self.dtype is not None else None
        return sum(t.numel() * (size or t.element_size()) for _, t in hf_named(self.model))
