"""The trainer's side of weight pushes: when to push, how (a snapshot pushed in the background, or a
direct push from the live weights while training waits), and the push in flight.

Every trainer rank holds a WeightPublisher; only rank 0 holds the sender (a WeightSender of base.py)
and talks to the engines, but taking the weights is collective (TP/PP shards are gathered to rank 0),
so every decision that leads into one is rank 0's, broadcast (`rank0_says`).

The publisher knows the model only as a WeightExport (the trainer's backend gives one), so it imports
nothing of stages/trainer.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from stages.weights.config import WeightsConfig

log = logging.getLogger(__name__)


class WeightExport(Protocol):
    """The model's weights in HF names, as a push takes them. All collective."""

    def snapshot(self, *, device: str = "cpu", host: Any = None) -> dict[str, torch.Tensor] | None:
        """Fresh full copies on rank 0 (on `device`, or in `host`'s pinned buffers); None elsewhere."""
        ...

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same tensors lazily, without copies, on rank 0 (every rank consumes it to the end)."""
        ...

    def host_buffers(self) -> Any:
        """Pinned host buffers that `snapshot(host=...)` fills, reused from push to push."""
        ...

    def model_bytes(self) -> int:
        """The whole model's bytes, about what a push sends."""
        ...

    # (optional) pushes_adapters: bool — the pushes carry LoRA adapters for the engine to apply
    # (trainer.lora.push=adapter), which only a sender with `takes_adapters` delivers


class CatchUp(enum.Enum):
    """What a catch-up request found (WeightPublisher.catch_up)."""

    IN_FLIGHT = "in_flight"  # a push is in flight (maybe just started for an engine left behind)
    IDLE = "idle"  # no push in flight, none needed: an engine relaunched since may be asked about


def rank0_says(yes: bool, device: torch.device) -> bool:
    """Rank 0's `yes` on every rank (for decisions that lead into a collective)."""
    flag = torch.tensor([float(yes)], device=device)
    if dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


class WeightPublisher:
    """Pushes the policy's weights to the engines every weights.push_every versions. `stages`: the
    trainer's pipeline stages (a direct push takes one)."""

    def __init__(
        self,
        wc: WeightsConfig,
        export: WeightExport,
        *,
        rank: int,
        device: torch.device,
        stages: int = 1,
        sender: Any = None,
    ):
        self.wc, self.export = wc, export
        self.rank, self.device, self.stages = rank, device, stages
        self.sender = sender  # rank 0 only
        self.pending: Any = None  # the background push in flight (a PushHandle), rank 0
        self._host_snapshot: Any = None  # pinned host copy of the weights (weights.snapshot=cpu on a GPU)
        self._direct_result: dict | None = None  # the last direct push's figures, until wait() takes them
        self._pushes_direct: bool | None = None  # decided at the first push (goes_direct)
        if sender is not None:
            self.attach(sender)

    def attach(self, sender: Any) -> None:
        """Take rank 0's sender; refused (before any push) where it cannot deliver what the export
        pushes."""
        adapters = getattr(self.export, "pushes_adapters", False)
        if sender is not None and adapters and not getattr(sender, "takes_adapters", False):
            raise ValueError(
                f"trainer.lora.push=adapter sends LoRA adapters for the engines to apply, which only the "
                f"torch engine (weights.transport=cpu) takes, not {type(sender).__name__} (SGLang servers "
                "get whole tensors): set trainer.lora.push=merge (the merged tensors that have adapters)"
            )
        self.sender = sender

    def _rank0_says(self, yes: bool) -> bool:
        return rank0_says(yes, self.device)

    def due(self, version: int) -> bool:
        """Whether the step that made `version` pushes. Only rank 0 holds the sender, but the snapshot
        is collective: every rank must agree."""
        every = self.wc.push_every
        return bool(every and version % every == 0) and self._rank0_says(self.sender is not None)

    def raise_if_failed(self) -> None:
        """A finished background push's failure surfaces at the next step, not only at the next push."""
        if self.rank == 0 and self.pending is not None and self.pending.done():
            self.pending.result()

    # -- a push ------------------------------------------------------------------------------------
    def push(self, version: int) -> dict:
        """Check the previous push, snapshot (collective), start the next push in the background."""
        out = {}
        t0 = time.perf_counter()
        if self.pending is not None and self.rank == 0:
            res = self.pending.result()  # raises WeightPushError on failure or timeout
            out.update(
                {f"push/prev_{k}": v for k, v in res.items() if isinstance(v, int | float) and k != "version"}
            )
        out["push/wait_prev_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self.goes_direct():
            out.update(self._push_direct(version))
            out["push/direct_s"] = time.perf_counter() - t1
            return out
        state = self.export.snapshot(**self._snapshot_target())  # collective; full tensors on rank 0
        if self.rank == 0 and self.sender is not None:
            self.pending = self.sender.push(version, list(state.items()))
        out["push/snapshot_s"] = time.perf_counter() - t1
        return out

    def _push_direct(self, version: int) -> dict:
        """weights.snapshot=direct: no copy; rank 0 pushes the tensors as every rank gathers them from the
        live weights, and training waits for it (collective). Its figures go under the names a
        background push reports them at the next step (`push/prev_*`): it is done now."""
        named = self.export.stream()
        if self.rank == 0 and self.sender is not None:
            if not hasattr(self.sender, "push_now"):
                for _ in named:  # the other ranks are gathering: finish in step, then refuse
                    pass
                raise ValueError(
                    f"weights.snapshot=direct pushes into SGLang servers (weights.transport nccl or cuda_ipc); "
                    f"{type(self.sender).__name__} keeps each push for late joiners: use weights.snapshot=auto"
                )
            res = self._direct_result = self.sender.push_now(version, named, self.export.model_bytes())
            return {
                f"push/prev_{k}": v for k, v in res.items() if isinstance(v, int | float) and k != "version"
            }
        for _ in named:  # take part in every gather
            pass
        return {}

    def goes_direct(self) -> bool:
        """Whether pushes take no copy (_push_direct): weights.snapshot=direct; with auto, where the model
        is over 10 % of the trainer's GPU (where the GPU copy does not go), rank 0's sender pushes into
        SGLang servers and the trainer has one pipeline stage. At 7B on H100s the host copy cost 0.34 s
        of each training step and stood the engines still 0.35 s a push (copied back to the GPU
        meanwhile), where the direct push took 0.16 s of both (bench/RESULTS.md, 2026-11-27). Rank 0
        decides once, for every rank: the ranks gather in step."""
        if self._pushes_direct is None:
            choice = self.wc.snapshot
            if choice == "auto":
                self._pushes_direct = self._rank0_says(
                    self.rank == 0
                    and self.stages == 1
                    and hasattr(self.sender, "push_now")
                    and self.device.type == "cuda"
                    and not self._copy_fits_gpu()
                )
            else:
                self._pushes_direct = choice == "direct"
        return self._pushes_direct

    def _copy_fits_gpu(self) -> bool:
        """The 10 % rule of weights.snapshot=auto: a model copy of at most a tenth of the GPU's memory."""
        return self.export.model_bytes() <= 0.1 * torch.cuda.get_device_properties(self.device).total_memory

    def _snapshot_target(self) -> dict:
        """Where rank 0 keeps the pushed copy (weights.snapshot): on its GPU for the SGLang transports
        (the sender's `snapshot_device`) unless the model is over 10 % of that GPU (then auto pushes
        direct, but with pipeline stages), else in pinned host buffers reused from push to push."""
        choice = self.wc.snapshot
        device = getattr(self.sender, "snapshot_device", "cpu")
        if choice == "auto" and device == "cuda":
            choice = "gpu" if self._copy_fits_gpu() else "cpu"
        # pinned buffers are refilled at the next push, so only for senders that keep nothing of a push
        # once it is done: the SGLang ones; the CPU transport keeps its last snapshot for late joiners
        if choice == "cpu" and self.device.type == "cuda" and device == "cuda":
            if self._host_snapshot is None:
                self._host_snapshot = self.export.host_buffers()
            return {"host": self._host_snapshot}
        return {"device": "cuda" if choice == "gpu" and self.device.type == "cuda" else device}

    def wait(self) -> dict | None:
        """The last push's figures once it is done (rank 0; None elsewhere, or when none was made)."""
        if self.rank != 0:
            return None
        if self.pending is None:  # a direct push is done when push returns
            res, self._direct_result = self._direct_result, None
            return res
        res, self.pending = self.pending.result(), None
        return res

    # -- engines left behind -------------------------------------------------------------------------
    def catch_up(self) -> CatchUp:
        """Start a catch-up push if an engine is behind and no push is in flight (one in flight may
        reach the lagging server: it is asked again after the next slice). Rank 0."""
        if self.pending is not None and not self.pending.done():
            return CatchUp.IN_FLIGHT
        handle = self.sender.catch_up()
        if handle is None:
            return CatchUp.IDLE
        if self.pending is not None:
            self.pending.result()  # a failure of the previous push is raised here, not lost
        self.pending = handle  # push waits for it before the next snapshot
        return CatchUp.IN_FLIGHT

    def stale_engines(self) -> list[str]:
        """Engines running older weights than the last push (relaunched since) or partly loaded ones
        (another server died mid-push): they need the current weights pushed again. Rank 0."""
        return self.sender.needs_push()
