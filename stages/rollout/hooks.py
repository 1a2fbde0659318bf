"""Custom rollout hooks: what a `rollout.generate_fn`, `rollout.rollout_fn` or `rollout.filter` given as
"module:function" is called with, how it is loaded, and the checks on what it returns.

Every hook is named "package.module:function" (importable on the generator's sys.path) or
"path/to/file.py:function" (loaded from the file; a relative path is taken from the directory the run
was launched in). docs/rollouts.md has the contract and a complete example of each.

generate_fn:  async fn(ctx: GenerateContext) -> list[Sample]   (per group: one Sample per ctx.samples)
              async fn(ctx: GenerateContext) -> Sample         (rollout.generate_per_sample: true)
rollout_fn:   fn(ctx: RolloutContext) -> AsyncIterator[list[Sample]]   (see stages/rollout/custom_loop.py)
filter:       fn(samples: list[Sample]) -> bool                 (True keeps the group)

The generator hands generate_fn blank Samples (identity, prompt, label and metadata filled in) and
expects them back with their response filled: `Conversation.fill(sample)` (stages/rollout/multiturn.py)
or `fill_response(...)` below. A blank starts as `failed` with the error UNFILLED, which filling
overwrites; a sample returned still carrying it is a bug in the hook. Whatever comes back is checked
here, and a bad return stops the run with an error naming the function, the sample and the field: a
silent fix would train on garbage.

`GenerateFn` (stages/rollout/generate_fn.py) is the one way a generate_fn is called (the generator's
training groups and the evaluator's prompts alike): once per group or once per sample, engine errors
retried with fresh blanks, anything else it raises turned into a HookError naming it, its return
checked with check_samples (here).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffer.record import F32, I16, I32, U8, Sample, Status, pack
from stages.rollout.config import BUILTIN_FILTERS, RolloutConfig
from stages.rollout.engine import Engine, GenRequest, GenResult, SamplingParams
from stages.user_code import HookError, hook_name, is_hook_spec, load_hook  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


class EngineCallError(RuntimeError):
    """The engine failed under a hook's request (retried by the generator like any engine error)."""


def check_hooks(rollout_cfg: RolloutConfig) -> None:
    """Load every hook of a RolloutConfig once (the driver does, before any stage starts), so that a typo
    fails in a second naming the key rather than in a generator's traceback."""
    for key in ("generate_fn", "rollout_fn", "agent_fn"):
        spec = getattr(rollout_cfg, key)
        if spec:
            fn = load_hook(spec, f"rollout.{key}")
            if key in ("generate_fn", "agent_fn") and not inspect.iscoroutinefunction(fn):
                raise HookError(f"rollout.{key}={spec!r}: must be an `async def` function")
    resolve_filter(rollout_cfg.filter)


# -- group filters -----------------------------------------------------------------------------------
GroupFilter = Callable[[list[Sample]], bool]  # True = keep the group


def nonzero_std(samples: list[Sample]) -> bool:
    """Dynamic sampling (DAPO): keep a group only if its rewards differ (all-equal groups have zero
    GRPO advantage and carry no gradient)."""
    rewards = [s.reward for s in samples if s.status != Status.FAILED]
    return len(set(rewards)) > 1


FILTERS: dict[str, GroupFilter | None] = {"none": None, "nonzero_std": nonzero_std}
assert tuple(FILTERS) == BUILTIN_FILTERS, "stages/rollout/config.py names the built-in filters too"


def resolve_filter(spec: str) -> GroupFilter | None:
    """rollout.filter: a built-in name or "module:function" (samples -> bool, True keeps the group)."""
    if spec in FILTERS:
        return FILTERS[spec]
    if not is_hook_spec(spec):
        raise HookError(
            f"rollout.filter={spec!r}: expected {' or '.join(sorted(FILTERS))}, or 'module:function' "
            "taking the group's scored Samples and returning True to keep it"
        )
    fn = load_hook(spec, "rollout.filter")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise HookError(
            f"rollout.filter={spec!r}: must be a plain `def` returning True or False; an `async def` "
            "returns a coroutine, which is always true, so every group would be kept"
        )
    return fn


def apply_filter(fn: GroupFilter, samples: list[Sample]) -> bool:
    """fn(samples) as a keep/drop decision; an exception or a return that is no decision (None, a
    coroutine) is raised as a HookError naming the filter and the group."""
    name, gid = hook_name(fn), samples[0].group_id if samples else "?"
    try:
        keep = fn(samples)
    except Exception as e:
        raise HookError(f"rollout.filter {name} raised {type(e).__name__}: {e} (group {gid})") from e
    if keep is None or inspect.isawaitable(keep):
        if inspect.iscoroutine(keep):
            keep.close()  # never awaited: close it rather than leave a warning behind
        raise HookError(
            f"rollout.filter {name} returned {type(keep).__name__} for group {gid}; it must return True "
            "(keep the group) or False (drop it), from a plain `def`"
        )
    return bool(keep)


# -- what a generate_fn sees -------------------------------------------------------------------------
class EngineHandle:
    """The engine as a generate_fn sees it: token ids in; token ids, logprobs and versions out.

    To continue a conversation, call generate again with the whole context so far (prompt + response
    tokens, exactly as generated: never decoded and re-encoded); `Conversation` does this per turn.
    """

    def __init__(self, engine: Engine, rid_prefix: str, *, affinity: bool = False):
        """`affinity`: every call goes to the pool's engine of the first (its prefix cache has them)."""
        self._engine, self._prefix, self._n = engine, rid_prefix, 0
        self._affinity = rid_prefix if affinity else ""
        self.calls = 0

    @property
    def version(self) -> int:
        """The policy version of the engine's weights now (tokens sampled later may carry a newer one)."""
        return self._engine.version

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1
    ) -> list[GenResult]:
        """n samples of the continuation of prompt_ids. Raises EngineCallError if the engine fails."""
        ids = [int(t) for t in prompt_ids]
        reqs = []
        for _ in range(n):
            rid = f"{self._prefix}-{self._n}"
            reqs.append(GenRequest(prompt_ids=list(ids), params=params, rid=rid, affinity=self._affinity))
            self._n += 1
        self.calls += 1
        try:
            return await self._engine.generate(reqs)
        except Exception as e:
            raise EngineCallError(f"{type(e).__name__}: {e}") from e


@dataclass(kw_only=True)
class GenerateContext:
    """The argument of a generate_fn: one prompt, its blank Samples, and what to generate them with."""

    prompt: Any  # stages.rollout.data.Prompt: text, ids, label, metadata
    samples: list[Sample]  # blank Samples to fill (one per group member; one in per-sample mode)
    params: SamplingParams  # rollout.sampling (frozen: use dataclasses.replace for a variant)
    engine: EngineHandle
    tokenizer: Any
    kwargs: dict[str, Any] = field(default_factory=dict)  # rollout.generate_kwargs (a copy per call)

    @property
    def sample(self) -> Sample:
        """The one Sample of a per-sample call."""
        return self.samples[0]


# the error of a blank Sample until it is filled: a hook that returns it as it was given has a bug
UNFILLED = "not filled: returned as given (fill it with Conversation.fill or fill_response)"


def is_unfilled(sample: Sample) -> bool:
    """True while `sample` is still a blank (no fill_response / Conversation.fill, no failure set)."""
    return sample.status == Status.FAILED and sample.error == UNFILLED


def blank_samples(*, group_id: str, prompt, n: int, generator_id: str, created_at: float) -> list[Sample]:
    """The group's Samples with identity and prompt fields set and an empty response, marked unfilled
    (status failed, error UNFILLED) until fill_response / Conversation.fill writes the response."""
    prompt_ids = pack(prompt.ids, I32)
    return [
        Sample(
            uid=f"{group_id}-{i}",
            group_id=group_id,
            group_index=i,
            group_size=n,
            prompt_ids=prompt_ids,
            prompt=prompt.text,
            label=prompt.label,
            metadata=dict(prompt.metadata),
            generator_id=generator_id,
            created_at=created_at,
            status=Status.FAILED,
            error=UNFILLED,
        )
        for i in range(n)
    ]


def fill_response(
    sample: Sample,
    *,
    response_ids: Sequence[int],
    rollout_logprobs: Sequence[float],
    versions: Sequence[int],
    loss_mask: Sequence[int] | None = None,
    status: Status = Status.COMPLETED,
    error: str = "",
    routed_experts=None,
) -> Sample:
    """Set the response arrays, status and error of `sample` (in place; returned for convenience).
    loss_mask defaults to all ones (every token is the model's). A sample that went wrong is filled too,
    with status=Status.FAILED and the reason in `error` (its response may be empty). routed_experts: the
    engine's GenResult.routed_experts (MoE routing replay), kept only when it covers exactly the
    sample's prompt + response - 1 positions (else the trainer routes that sample itself)."""
    sample.response_ids = pack(response_ids, I32)
    sample.rollout_logprobs = pack(rollout_logprobs, F32)
    sample.versions = pack(versions, I32)
    sample.loss_mask = pack(np.ones(len(response_ids)) if loss_mask is None else loss_mask, U8)
    sample.status, sample.error = Status(status), error
    sample.routed_experts = b""
    if routed_experts is not None and len(response_ids):
        routed = np.asarray(routed_experts)
        if len(routed) == sample.prompt_len + len(response_ids) - 1:
            sample.routed_experts = pack(routed, I16)
    return sample


_IDENTITY = ("uid", "group_id", "group_index", "group_size", "prompt_ids")


def check_samples(fn_name: str, got: Any, blanks: list[Sample]) -> list[Sample]:
    """The Samples a generate_fn returned, checked against the blanks it was given; raises HookError
    naming the function, the sample and the field."""
    if isinstance(got, Sample):
        got = [got]
    if not isinstance(got, list | tuple) or not all(isinstance(s, Sample) for s in got):
        raise HookError(
            f"generate_fn {fn_name} returned {type(got).__name__}; it must return the Samples of its "
            "context (ctx.samples), filled (Conversation.fill or stages.rollout.hooks.fill_response)"
        )
    if len(got) != len(blanks):
        raise HookError(
            f"generate_fn {fn_name} returned {len(got)} samples for {len(blanks)} in ctx.samples; return "
            "every one (a sample that went wrong is returned with status failed, not left out)"
        )
    by_index = {s.group_index: s for s in got}
    out = []
    for blank in blanks:
        s = by_index.get(blank.group_index)
        if s is None:
            raise HookError(f"generate_fn {fn_name}: no sample with group_index {blank.group_index} returned")
        for name in _IDENTITY:
            if getattr(s, name) != getattr(blank, name):
                raise HookError(
                    f"generate_fn {fn_name}: sample {blank.uid} came back with another {name} "
                    f"({getattr(s, name)!r:.60}); fill the Samples of ctx.samples, do not make new ones"
                )
        if is_unfilled(s):
            raise HookError(
                f"generate_fn {fn_name}: sample {s.uid} was returned unfilled, as it was given; fill every "
                "sample (Conversation.fill or fill_response; one that went wrong with status=Status.FAILED "
                "and error=...)"
            )
        if s.error == UNFILLED:  # status set by hand, error left: the blank's marker is no reason
            s.error = ""
        _check_arrays(fn_name, s)
        out.append(s)
    return out


def _check_arrays(fn_name: str, s: Sample) -> None:
    problem = s.array_problem()
    if problem:
        raise HookError(f"generate_fn {fn_name}: sample {s.uid}: {problem}")


# -- calling a generate_fn ---------------------------------------------------------------------------
async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather, except that when one raises the others are cancelled (and waited for) before
    the error is raised: a failing sample or prompt does not leave its siblings running."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
