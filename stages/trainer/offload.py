"""The trainer's state off the device and back (cluster.offload.train): while the engines generate on
the same GPUs, the trainer hands back the memory of its weights, gradients and optimizer state, and
takes it again before its next step (pipeline/orchestration/handover.py says when).

Three parts, freed and restored separately, because the hand-over frees them at different moments:
the gradients and the optimizer state right after the step, the weights only after they are pushed.

  weights     the parameters of the policy, of the KL reference and of the critic (megatron's
              parameter buffers with them): copied to (pinned) host memory, restored bit for bit
  optimizer   the optimizers' state (Adam's moments, SGD's momentum, step counters on the device) and
              their fp32 master weights: copied and restored bit for bit
  grads       the gradient buffers (megatron's grad_data, `main_grad`, `.grad`): freed without a
              copy and restored as zeros: every step zeroes them before its backward (megatron's
              zero_grad_buffer, FSDP's zero_grad), so no value of theirs outlives a step, and a 7B
              model's fp32 gradients (15 GB a GPU at TP=2) would cost a copy each way for nothing

What is moved is found through the backends' public parts (`policy.model`, `optimizer`, `ref`, the
critic's `model` and `optimizer`), the same for megatron and FSDP2 (whose DTensor shards are moved
as their local tensors): stages/host_copy.py moves the storages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from stages.host_copy import HostStash, local_tensor, resident_bytes, unique_storages
from stages.weights.publisher import WeightPublisher

WEIGHTS, OPTIMIZER, GRADS = "weights", "optimizer", "grads"
PARTS = (WEIGHTS, OPTIMIZER, GRADS)


class StateOffloaded(RuntimeError):
    """The trainer was asked to compute while (part of) its state is off the device."""


def _modules(backend: Any, critic: Any) -> list[torch.nn.Module]:
    """The models whose memory the trainer holds: the policy, the KL reference (megatron wraps it in a
    Policy with `.model`, FSDP keeps the module), the critic."""
    out = [backend.policy.model]
    ref = getattr(backend, "ref", None)
    if ref is not None:
        out.append(getattr(ref, "model", ref))
    if critic is not None:
        out.append(critic.model)
    return out


def _optimizers(backend: Any, critic: Any) -> list[Any]:
    out = [backend.optimizer]
    if critic is not None:
        out.append(critic.optimizer)
    return out


def _torch_optimizers(opt: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained, mixed-precision, distributed) ones, or `opt`."""
    for part in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(part, "optimizer", part)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


class TrainerMemory:
    """Offload and onload of the trainer's parts on this rank (no collectives: each rank moves its own
    shards). `offloaded`: the parts now off the device."""

    def __init__(self, backend: Any, critic: Any, device: torch.device, rank: int = 0):
        self.modules, self.optimizers = _modules(backend, critic), _optimizers(backend, critic)
        self.device = device
        self._stash = {p: HostStash(device, f"trainer rank {rank} ({p})") for p in PARTS}

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(p for p, s in self._stash.items() if s)

    def require_resident(self, what: str) -> None:
        """Refuse `what` while any part is off the device: its tensors have no memory behind them."""
        if self.offloaded:
            raise StateOffloaded(
                f"{what} while the trainer's {', '.join(sorted(self.offloaded))} are offloaded "
                "(cluster.offload.train): onload them first; a hand-over ran out of order"
            )

    # -- what each part is -------------------------------------------------------------------------
    def _named(self, part: str) -> Iterator[tuple[str, torch.Tensor]]:
        if part == WEIGHTS:
            for i, m in enumerate(self.modules):
                for n, p in m.named_parameters():
                    yield f"model{i}.{n}", p
                for k, buf in enumerate(_ddp_buffers(m)):
                    yield f"model{i}.param_buffer{k}", buf.param_data
        elif part == GRADS:
            for i, m in enumerate(self.modules):
                for n, p in m.named_parameters():
                    yield f"model{i}.{n}.grad", p.grad
                    yield f"model{i}.{n}.main_grad", getattr(p, "main_grad", None)
                for k, buf in enumerate(_ddp_buffers(m)):
                    yield f"model{i}.grad_buffer{k}", buf.grad_data
            for i, opt in enumerate(self.optimizers):  # masters' gradients (views of the buffers, mostly)
                for k, inner in enumerate(_torch_optimizers(opt)):
                    for g, group in enumerate(inner.param_groups):
                        for j, p in enumerate(group["params"]):
                            yield f"optimizer{i}.{k}.group{g}.param{j}.grad", p.grad
        else:
            for i, opt in enumerate(self.optimizers):
                for k, inner in enumerate(_torch_optimizers(opt)):
                    for g, group in enumerate(inner.param_groups):
                        for j, p in enumerate(group["params"]):  # fp32 masters (model params: weights')
                            yield f"optimizer{i}.{k}.group{g}.param{j}", p
                    for j, state in enumerate(inner.state.values()):
                        for key, v in state.items():
                            if torch.is_tensor(v):
                                yield f"optimizer{i}.{k}.state{j}.{key}", v

    def _storages(self, part: str) -> list[tuple[str, torch.UntypedStorage]]:
        """`part`'s storages on the device, less those of an earlier part in PARTS order (an fp32
        optimizer steps the model's own parameters: they are weights)."""
        claimed: set[int] = set()
        for earlier in PARTS[: PARTS.index(part)]:
            unique_storages(self._named(earlier), self.device, claimed)
        return unique_storages(self._named(part), self.device, claimed)

    def device_bytes(self) -> int:
        """What the trainer holds on its device: CUDA: the caching allocator's reserve (activations and
        caches included: what the engines cannot have); CPU: its parts' storages that are not parked."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        claimed: set[int] = set()
        return sum(
            resident_bytes(s for _, s in unique_storages(self._named(p), self.device, claimed)) for p in PARTS
        )

    # -- the moves ---------------------------------------------------------------------------------
    def offload(self, parts: tuple[str, ...] = PARTS) -> dict:
        """Free `parts` (those already off are skipped); seconds and bytes moved."""
        t0, moved = time.perf_counter(), 0
        for part in _checked(parts):
            if not self._stash[part]:
                moved += self._stash[part].park(self._storages(part), keep=part != GRADS)
        return {"seconds": time.perf_counter() - t0, "bytes": moved}

    def onload(self, parts: tuple[str, ...] = PARTS) -> dict:
        """Restore `parts`; raises host_copy.MemoryHeld naming who holds the device when it cannot."""
        t0, moved = time.perf_counter(), 0
        for part in _checked(parts):
            moved += self._stash[part].restore()
        return {"seconds": time.perf_counter() - t0, "bytes": moved}


class WakingPublisher(WeightPublisher):
    """A WeightPublisher whose pushes find the weights on the device. The hand-over pushes with the
    weights on; the one push that can come while they are off is the feed's, for an SGLang server
    relaunched while the trainer waits for data (feed.py, Got.PUSH_AGAIN): it brings the weights back
    for the gathers and lets them go again after (a background push has its copy by then)."""

    memory: TrainerMemory | None = None  # set once the trainer has its parts (the critic comes later)

    def push(self, version: int) -> dict:
        if self.memory is None or WEIGHTS not in self.memory.offloaded:
            return super().push(version)
        self.memory.onload((WEIGHTS,))
        try:
            return super().push(version)
        finally:
            self.memory.offload((WEIGHTS,))


def _ddp_buffers(m: Any) -> list:
    """megatron DDP's parameter/gradient buffers (a list named `buffers`, shadowing nn.Module.buffers,
    and one for expert parameters); anything else has none."""
    if not isinstance(getattr(m, "buffers", None), list):
        return []
    return [*m.buffers, *getattr(m, "expert_parallel_buffers", [])]


def _checked(parts: tuple[str, ...]) -> tuple[str, ...]:
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"unknown trainer state part(s) {bad}; the parts are {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in parts)  # one order: weights claim their storages first


def snapshot_state(memory: TrainerMemory) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of every tensor of each part, by part (for tests that check a round trip bit for bit)."""
    return {
        p: {n: local_tensor(t).detach().clone() for n, t in memory._named(p) if t is not None} for p in PARTS
    }
