"""`GenerateFn`: a generate_fn (rollout.generate_fn, default: the built-in single_turn) bound to how the
run calls it, for the generator's training groups and the evaluator's prompts alike. The contract it
calls and checks is stages/rollout/hooks.py's; single_turn.py is one implementation of it."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from buffer.record import Sample
from stages.rollout.config import RolloutConfig
from stages.rollout.engine import Engine, SamplingParams
from stages.rollout.hooks import (
    EngineCallError,
    EngineHandle,
    GenerateContext,
    HookError,
    blank_samples,
    check_samples,
    gather_or_cancel,
    hook_name,
    load_hook,
)
from stages.rollout.single_turn import single_turn

log = logging.getLogger(__name__)


class GenerateFn:
    """A generate_fn bound to how it is called: once per group, or once per sample
    (rollout.generate_per_sample), with the run's tokenizer and rollout.generate_kwargs.

    Calling it makes one group's Samples from blanks: an engine error reaches the caller as
    EngineCallError (to retry), anything else the function raises becomes a HookError naming it, and
    what it returns is checked (check_samples). with_retries() adds the retry loop of rollout.engine_retries.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        per_sample: bool,
        kwargs: dict[str, Any],
        tokenizer: Any,
        affinity: bool = False,
    ):
        """`affinity`: each group's (per sample: episode's) calls go to one engine of a pool (EngineHandle)."""
        self.fn, self.name = fn, hook_name(fn)
        if not inspect.iscoroutinefunction(fn):
            raise HookError(f"rollout.generate_fn {self.name}: must be an `async def` function")
        self.per_sample, self.kwargs, self.tokenizer = per_sample, dict(kwargs), tokenizer
        self.affinity = affinity

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, tokenizer: Any) -> GenerateFn:
        """rollout.generate_fn (default: the built-in single-turn generator) as the run calls it."""
        spec = rollout_cfg.generate_fn
        fn = load_hook(spec, "rollout.generate_fn") if spec else single_turn
        return cls(
            fn,
            per_sample=rollout_cfg.generate_per_sample,
            kwargs=rollout_cfg.generate_kwargs,
            tokenizer=tokenizer,
            # with SGLang's prefix cache, where its prompt and earlier turns are cached
            affinity=rollout_cfg.engine == "sglang" and rollout_cfg.sglang.radix_cache,
        )

    async def __call__(
        self, *, gid: str, prompt: Any, blanks: list[Sample], params: SamplingParams, engine: Engine
    ) -> list[Sample]:
        def context(samples: list[Sample], rid: str) -> GenerateContext:
            return GenerateContext(
                prompt=prompt,
                samples=samples,
                params=params,
                engine=EngineHandle(engine, rid, affinity=self.affinity),
                tokenizer=self.tokenizer,
                kwargs=dict(self.kwargs),
            )

        try:
            if self.per_sample:  # an error in one sample cancels the others (an engine error retries all)
                got = await gather_or_cancel(*(self.fn(context([b], b.uid)) for b in blanks))
                got = [s for one in got for s in ([one] if isinstance(one, Sample) else one)]
            else:
                got = await self.fn(context(blanks, gid))
        except (EngineCallError, HookError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise HookError(
                f"rollout.generate_fn {self.name} raised {type(e).__name__}: {e} (group {gid}); "
                "an engine error reaches it as EngineCallError, which it should let through"
            ) from e
        return check_samples(self.name, got, blanks)

    async def with_retries(
        self,
        *,
        gid: str,
        prompt: Any,
        n: int,
        generator_id: str,
        params: SamplingParams,
        engine: Engine,
        retries: int,
        on_engine_error: Callable[[EngineCallError], None] | None = None,
        before_retry: Callable[[], Awaitable[None]] | None = None,
    ) -> list[Sample] | None:
        """The group's n Samples, or None when the engine failed on every one of 1 + retries attempts
        (each attempt with fresh blanks; each failure logged and passed to on_engine_error; each retry
        after `before_retry`, which waits for the engine to be back)."""
        attempts = 1 + max(0, retries)
        for attempt in range(1, attempts + 1):
            if attempt > 1 and before_retry is not None:
                await before_retry()
            blanks = blank_samples(
                group_id=gid, prompt=prompt, n=n, generator_id=generator_id, created_at=time.time()
            )
            try:
                return await self(gid=gid, prompt=prompt, blanks=blanks, params=params, engine=engine)
            except EngineCallError as e:
                log.error("group %s: engine error (attempt %d/%d): %s", gid, attempt, attempts, e)
                if on_engine_error is not None:
                    on_engine_error(e)
        return None
