"""`rollout.rollout_fn`: a user's generation loop, streamed to the buffer by the generator.

slime's --rollout-function-path replaces the whole rollout of a step; in this streaming design the
function is an async iterator of groups that runs for the generator's whole life:

    async def my_rollout(ctx: RolloutContext):
        while (group := await ctx.start_group()) is not None:   # waits for admission; None = stop
            ... fill group.samples (one per member; Conversation.fill or hooks.fill_response) ...
            yield group.samples

`start_group()` is the generator's own admission control (in-flight cap, staleness bound), so the
groups a rollout_fn makes are trainable under run.max_staleness exactly like the built-in loop's. A
yielded group is checked (hooks.check_samples), scored with rollout.reward, filtered and put. The
function may run several groups at once (tasks of its own) and yield them as they finish; a group it
gives up on is `ctx.abandon(group)` (counted as failed). Groups still open when it returns are
counted as failed too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.sample import Sample
from stages.rollout.engine import SamplingParams
from stages.rollout.hooks import EngineHandle, HookError, blank_samples, check_samples, hook_name


@dataclass(kw_only=True)
class Group:
    """An admitted group: fill `samples` and yield them."""

    group_id: str
    prompt: Any  # stages.rollout.data.Prompt
    samples: list[Sample]
    engine_version: int  # the engine's version when the group was admitted


@dataclass(kw_only=True)
class RolloutContext:
    """The argument of a rollout_fn."""

    engine: EngineHandle
    params: SamplingParams
    tokenizer: Any
    group_size: int
    kwargs: dict[str, Any] = field(default_factory=dict)  # rollout.generate_kwargs
    _gen: Any = None
    _stop: Any = None
    _max_groups: int | None = None
    _open: dict[str, Group] = field(default_factory=dict)

    @property
    def prompts(self):
        """The generator's prompt source (rollout.data); start_group() draws from it by default."""
        return self._gen.source

    async def start_group(self, prompt=None) -> Group | None:
        """Wait until admission lets a new group start; None once the generator stops (finish the
        groups in flight, yield them, and return). `prompt`: a stages.rollout.data.Prompt of your own
        instead of the next one of rollout.data."""
        if not await self._gen.admitted(self._stop, self._max_groups):
            return None
        gid, prompt = self._gen.start_group(prompt)
        group = Group(
            group_id=gid,
            prompt=prompt,
            samples=blank_samples(
                group_id=gid,
                prompt=prompt,
                n=self.group_size,
                generator_id=self._gen.id,
                created_at=time.time(),
            ),
            engine_version=self._gen.engine.version,
        )
        self._open[gid] = group
        return group

    def abandon(self, group: Group) -> None:
        """Give up a started group (it is counted as failed and frees its admission place)."""
        if self._open.pop(group.group_id, None) is not None:
            self._gen.counters["groups_failed"] += 1
            self._gen._running -= 1

    def _close(self, name: str, got: Any) -> list[Sample]:
        first = got[0] if isinstance(got, list | tuple) and got else None
        group = self._open.get(getattr(first, "group_id", None))
        if group is None:
            raise HookError(
                f"rollout.rollout_fn {name} yielded {type(got).__name__} that is not the samples of a group "
                "from ctx.start_group() still open (yield group.samples, filled, once per group)"
            )
        samples = check_samples(name, list(got), group.samples)
        del self._open[group.group_id]
        return samples


async def run_rollout_fn(gen, stop_event: asyncio.Event | None, max_groups: int | None) -> None:
    """Drive gen.rollout_fn until it returns; score, filter and put each group it yields."""
    name = hook_name(gen.rollout_fn)
    ctx = RolloutContext(
        engine=EngineHandle(gen.engine, f"{gen.id}-r"),
        params=gen.params,
        tokenizer=gen.tok,
        group_size=gen.cfg.rollout.group_size,
        kwargs=dict(gen.cfg.rollout.generate_kwargs),
        _gen=gen,
        _stop=stop_event,
        _max_groups=max_groups,
    )
    stream = gen.rollout_fn(ctx)
    if not hasattr(stream, "__anext__"):
        raise HookError(
            f"rollout.rollout_fn {name} returned {type(stream).__name__}, not an async iterator: write it "
            "as an `async def` that `yield`s groups"
        )
    try:
        while True:
            try:
                got = await stream.__anext__()
            except StopAsyncIteration:
                break
            except HookError:
                raise
            except Exception as e:
                raise HookError(f"rollout.rollout_fn {name} raised {type(e).__name__}: {e}") from e
            samples = ctx._close(name, got)
            try:
                await gen._score(samples)
                await gen._put(samples)
            finally:
                gen._running -= 1
    finally:
        for group in list(ctx._open.values()):  # started, never yielded
            ctx.abandon(group)
        await stream.aclose()
