"""The inference-engine interface every generator drives (torch engine on CPU, SGLang on GPUs).

An engine turns token-id prompts into sampled responses with the per-token logprobs of the sampling
distribution and the policy version that produced each token. Weight updates are versioned and applied
between decode steps without dropping in-flight sequences: tokens produced after the update carry the
new version.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the interface needs no torch at import: the driver loads hooks without it
    import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 = off; with top_p, SGLang's joint filter (stages/rollout/sampling.py)
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # empty = the model's eos token(s)
    # strings that end the response at the token whose decoded text completes one (kept, finish "stop")
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # never stop early (benchmarks); stop_token_ids and stop are then ignored too
    # the request's sampling seed (SGLang's sampling_seed): its tokens then depend on (seed, position)
    # and the weights only, not on the engine's history (stages/rollout/sampling.py); None = the engine's
    seed: int | None = None

    @classmethod
    def from_config(cls, sampling, **overrides) -> SamplingParams:
        """The parameters of a `rollout.sampling` section (training and evaluation alike), with overrides."""
        fields = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
            stop=tuple(sampling.stop),
        )
        return cls(**{**fields, **overrides})


@dataclass(kw_only=True)
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str = ""  # caller's id, echoed back
    # requests with the same key go to the same engine of a pool while that engine is up (an agent
    # episode's calls: a later turn then finds its earlier context where it was computed); "" = any
    affinity: str = ""
    # once set, the engine ends the request as soon as it can, finish "abort", with the tokens it has so
    # far (rollout.partial_rollout keeps them); a threading.Event since engines decode in other threads
    interrupt: threading.Event | None = None


def interrupted(req: GenRequest) -> bool:
    return req.interrupt is not None and req.interrupt.is_set()


@dataclass(kw_only=True)
class GenResult:
    rid: str
    response_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling distribution (after temperature / top-k / top-p)
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" | "length" | "abort"
    meta: dict = field(default_factory=dict)  # "stop_string": the rollout.sampling.stop string that ended it
    # MoE routing replay (engines started with record_routing): [prompt + response - 1, moe_layers * k]
    # expert ids (numpy int16), the rows buffer.record.Sample.routed_experts stores; None otherwise
    routed_experts: object = None


# An adapter push (trainer.lora.push=adapter) sends, for each adapted HF module, `<module>.lora_A.weight`
# and `<module>.lora_B.weight` (alpha/r folded into B) in place of the module's weight
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(name: str) -> bool:
    """Whether a pushed tensor is a LoRA adapter's A or B (an adapter push), not a weight."""
    return name.endswith(LORA_A) or name.endswith(LORA_B)


def stop_token_of(res: GenResult) -> int | None:
    """The stop token that ended `res` (its last token), or None: it ran to its length, was aborted, or
    a stop string ended it (then its last token is ordinary text, which readers of the turn keep)."""
    if res.finish_reason == "stop" and res.response_ids and "stop_string" not in res.meta:
        return res.response_ids[-1]
    return None


class Engine(ABC):
    """A batched generator with versioned weights. Implementations must be safe to call from asyncio."""

    @abstractmethod
    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate for a batch of prompts; results in request order. Raises on engine failure."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Apply HF-named weights as `version`. Blocks until applied (between decode steps)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights currently in use."""

    def pause(self) -> None:  # noqa: B027 - optional hook
        """Stop starting new decode steps (in-flight sequences are kept)."""

    def resume(self) -> None:  # noqa: B027 - optional hook
        """Undo pause()."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources (processes, memory)."""

    def stats(self) -> dict:
        """Engine counters (tokens, busy/idle seconds, weight updates); empty if it keeps none."""
        return {}

    def available(self) -> bool:
        """False while the engine cannot serve (a server that died or is being relaunched): the
        generator then starts no group and retries none until it is back (no hot loop of failures)."""
        return True

    def version_and_relaunches(self) -> tuple[int, int]:
        """`version` and how many times a server of this engine was relaunched, read together: a
        relaunched server runs older weights until the trainer pushes it the current ones, and the
        generator tells that dip from a trainer gone back to its checkpoint by the count that came with
        it (read apart, the drop could be seen before its relaunch)."""
        return self.version, 0

    def requests_in_flight(self) -> int | None:
        """Requests submitted and not yet answered: each counted from the call of generate(), before it
        first awaits, until its own answer (not its batch's); None if the engine does not count them.
        The generator's request cap (rollout.max_inflight_requests) reads it."""
        return None
