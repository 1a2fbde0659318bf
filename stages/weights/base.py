"""Weight-push interface: the trainer hands a snapshot of HF-named tensors to a `WeightSender`, which
delivers it in the background and returns a `PushHandle` the trainer checks before the next push.

Contract (every transport):
  * `push(version, named_tensors)` returns at once; the tensors must not be modified afterwards
    (the trainer passes a fresh CPU/GPU copy, so training continues while the push is in flight).
  * the handle completes when every engine has applied the weights as `version`, or fails with a
    `WeightPushError` that says which engine / address and what to check.
  * `PushHandle.result(timeout)` raises on failure or when the push is not done within the timeout.

The bottom of the weights package: the transports (zmq_transport.py for torch engines; sglang_transport.py
with nccl_sender.py and cuda_ipc_sender.py for SGLang servers) implement this interface, and the factory
that picks one (`make_sender`) lives in stages/weights/__init__.py. Bucketing is in buckets.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from abc import ABC, abstractmethod

import torch


class WeightPushError(RuntimeError):
    """A push failed or timed out; the trainer stops with this message."""


class PushHandle:
    """A push in flight. `result()` returns push statistics or raises WeightPushError."""

    def __init__(self, version: int, future: cf.Future, timeout_s: float, what: str):
        self.version = version
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.what = what
        self.started = time.monotonic()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> dict:
        """Wait at most `timeout` (default: until the push's own deadline) and return its stats."""
        left = max(0.0, self.deadline - time.monotonic()) if timeout is None else timeout
        try:
            return self.future.result(timeout=left)
        except cf.TimeoutError:
            raise WeightPushError(
                f"weight push of version {self.version} to {self.what} not applied within "
                f"{self.timeout_s:.1f}s (weights.timeout_s); check that the engines are alive and connected"
            ) from None
        except WeightPushError:
            raise
        except Exception as e:
            raise WeightPushError(f"weight push of version {self.version} to {self.what} failed: {e}") from e


class WeightSender(ABC):
    """Trainer side of a weight transport (used on trainer rank 0 only)."""

    # whether its engines take LoRA adapters as a push (trainer.lora.push=adapter) and apply them over
    # the base they keep; the SGLang transports push whole (merged) tensors only
    takes_adapters: bool = False

    @abstractmethod
    def push(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> PushHandle:
        """Start delivering a snapshot; returns immediately."""

    def catch_up(self) -> PushHandle | None:
        """Push the last weights again to the engines the last push left out (they were restarting),
        or None when none is behind. Transports that never leave one out have nothing to catch up."""
        return None

    def needs_push(self) -> list[str]:
        """Engines found running older weights than the last push with nothing kept to send them (one
        relaunched between two pushes): the trainer pushes its current weights again."""
        return []

    def forget(self, engine: str) -> None:  # noqa: B027 - optional
        """Stop waiting for `engine`, whose process died without saying goodbye. Transports that wait for
        no engine by name have nothing to forget."""

    def expect_engines(self, count: int) -> None:  # noqa: B027 - optional
        """The run now has `count` engines (elastic rollout): a push waits for that many. Transports that
        find their engines another way ignore it."""

    def close(self) -> None:  # noqa: B027 - optional
        pass
