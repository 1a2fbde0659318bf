"""The seams between the trainer's step and the framework that runs the model.

`Trainer` (trainer.py) owns the algorithm: which batch, which advantages, which updates, which metrics.
Everything that depends on how the model is built and parallelised — the forward/backward schedule,
the optimizer step, reductions over ranks, the state a checkpoint holds, the HF export — lives behind
`TrainBackend`. megatron_backend.MegatronBackend is the one implementation today; an HF-native FSDP or
a LoRA backend implements the same methods and the step does not change.

`ScheduleRunner` is the part of a backend a second model trained beside the policy (the critic,
critic.py) runs on, so that component never reaches into the trainer or the backend's internals.
Protocols, not base classes: the tests drive these seams with small fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # types only: the implementations import this module, never the other way round
    from stages.trainer.checkpoint import Stateful
    from stages.trainer.packing import MicroBatch, TokenBatch
    from stages.weights.publisher import WeightExport

# loss_fn(micro-batch, hidden [b, s, h]) -> (loss numerator, token count, {}) as megatron's schedule wants
LossFn = Callable[["MicroBatch", torch.Tensor], tuple]


class ScheduleRunner(Protocol):
    """Forward (and backward) of a model over micro-batches, on this rank's device."""

    device: torch.device

    def run_schedule(self, model: Any, mbs: list[MicroBatch], loss_fn: LossFn, forward_only: bool) -> Any:
        """Run `model` over `mbs`, calling `loss_fn` on each micro-batch's final hidden states."""
        ...

    def grads_finite(self, acc: dict, model: Any) -> bool:
        """The loss in `acc` (sum/loss_num) and every gradient of `model` are finite, on all ranks."""
        ...


class ValueModel(Protocol):
    """A critic (critic.Critic): values per token, and an update toward returns, at the policy's lr."""

    def values(self, tb: TokenBatch, mbs: list[MicroBatch]) -> torch.Tensor:
        """Values [T] at this rank's tokens (zeros elsewhere)."""
        ...

    def update(
        self,
        tb: TokenBatch,
        mbs: list[MicroBatch],
        old_values: torch.Tensor,
        returns: torch.Tensor,
        *,
        policy_lr: float,
        version: int,
        count_unpacked: bool,
    ) -> dict:
        """One optimizer step toward `returns`; summed statistics on the CPU."""
        ...

    def checkpoint_part(self) -> Stateful: ...


class TrainBackend(ScheduleRunner, Protocol):
    """What one optimizer step needs of the model and its parallel layout. Every method is collective
    over the trainer's ranks unless it says otherwise."""

    rank: int  # this process's global rank; rank 0 talks to the buffer and the engines
    dp: int  # data-parallel replicas: the batch is cut into this many shards
    dp_rank: int  # this rank's shard
    has_reference: bool  # a frozen copy of the initial policy is kept (a KL term is on)
    hf_config: Any  # the model's HF config (the critic's and the metrics' sizes)
    model_path: str  # the HF folder the model was built from (checkpoints record it)
    policy: Any  # the built policy (megatron: model.Policy, its .model the wrapped GPTModel): hooks, tests
    optimizer: Any  # the policy's optimizer (the trainer's hooks get it)

    def pack(self, tb: TokenBatch, samples: list[int]) -> list[MicroBatch]:
        """`samples` of the batch in this rank's micro-batches."""
        ...

    def check_batch(self, tb: TokenBatch) -> None:
        """Refuse a batch this model cannot train on (e.g. routing replay without recorded experts)."""
        ...

    def logprobs(self, tb: TokenBatch, mbs: list[MicroBatch], *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [T] of the policy (or the reference) at this rank's tokens, no gradient."""
        ...

    def train(
        self,
        tb: TokenBatch,
        mbs: list[MicroBatch],
        adv: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        *,
        lr: float,
        version: int,
        count_unpacked: bool = True,
    ) -> tuple[dict, torch.Tensor]:
        """Forward/backward over `mbs` and one optimizer step at `lr` (skipped when the loss or a gradient
        is not finite: sum/skipped = 1). Returns summed statistics on the CPU and logp_old [T] (taken from
        the training forward when `old` is None)."""
        ...

    def batch_whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values this rank filled for its shard -> the whole batch's, on every rank (CPU)."""
        ...

    def reduce_stats(self, stats: dict, keys: tuple[str, ...]) -> dict[str, float]:
        """Statistics summed / min'ed / max'ed (by key prefix) over micro-batches and ranks."""
        ...

    def model_metrics(self) -> dict:
        """The model's own figures of the step (MoE router load, routing replay), same on every rank."""
        ...

    def active_params(self) -> int:
        """Parameters of the whole model a token uses (MoE: the routed share of the experts)."""
        ...

    def weight_export(self) -> WeightExport:
        """The policy's weights as the weight publisher takes them (HF names, full tensors on rank 0)."""
        ...

    def save_hf(self, out_dir: str) -> str | None:
        """The policy as an HF folder at `out_dir` (written by rank 0, which gets the path)."""
        ...

    def checkpoint_part(self) -> Stateful:
        """The policy and its optimizer as one checkpoint part."""
        ...

    def nonfinite_param(self) -> str | None:
        """The name of a parameter holding NaN/inf (this rank's shard), None when all are finite."""
        ...

    def build_critic(self) -> ValueModel:
        """A value model of the policy's architecture and layout, with its own optimizer."""
        ...
