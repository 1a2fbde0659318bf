"""`rollout.rollout_fn`: a user's generation loop, streamed to the buffer by the generator.

slime's --rollout-function-path replaces the whole rollout of a step; in this streaming design the
function is an async iterator of groups that runs for the generator's whole life:

    async def my_rollout(ctx: RolloutContext):
        async def one(group):
            ... fill group.samples (one per member; Conversation.fill or hooks.fill_response) ...
            return group.samples

        async for samples in ctx.run_groups(one):   # as many groups at once as admission allows
            yield samples

`start_group()` is the generator's own admission control (in-flight cap, staleness bound), so the
groups a rollout_fn makes are trainable under run.max_staleness exactly like the built-in loop's. A
yielded group is checked (hooks.check_samples), scored with rollout.reward, filtered and put. A started
group holds its admission place until it is yielded (or abandoned): a function that runs several groups
at once must wait for admission and for its running groups together and yield each as it finishes,
never sit in start_group() on a finished group (at run.max_staleness 0 that waits for a trainer step
which needs exactly that group). `run_groups(fn)` is that loop; docs/rollouts.md shows it written out.
A group given up on is `ctx.abandon(group)` (counted as failed). Groups still open when the function
returns are counted as failed too.

What the built-in loop does and a rollout_fn's groups do not get: a group's requests count against
rollout.max_inflight_requests only once they reach the engine (start_group() reserves none), and a
group past the staleness bound is not aborted (rollout.abort_stale_groups): the buffer evicts it. Like
the built-in loop, start_group() waits while the engine is down, and run_groups' retries wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from buffer.record import Sample
from stages.rollout.engine import SamplingParams
from stages.rollout.hooks import (
    EngineCallError,
    EngineHandle,
    HookError,
    blank_samples,
    check_samples,
    hook_name,
    is_unfilled,
)

log = logging.getLogger(__name__)


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
    _tasks: set[asyncio.Task] = field(default_factory=set)  # run_groups' tasks (cancelled at the end)

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
            samples=self._blanks(gid, prompt),
            engine_version=self._gen.engine.version,
        )
        self._open[gid] = group
        return group

    def _blanks(self, gid: str, prompt) -> list[Sample]:
        return blank_samples(
            group_id=gid, prompt=prompt, n=self.group_size, generator_id=self._gen.id, created_at=time.time()
        )

    def open_groups(self) -> list[Group]:
        """The groups started and not yet yielded or abandoned (each holds an admission place)."""
        return list(self._open.values())

    def unyielded_note(self, fn_name: str) -> str:
        """How many started groups the function `fn_name` has not yielded (they hold their admission
        places until it does): said when the generator is held back for long."""
        groups = self.open_groups()
        filled = sum(not any(is_unfilled(s) for s in g.samples) for g in groups)
        note = (
            f"; {len(groups)} started groups are not yet yielded by rollout.rollout_fn "
            f"{fn_name} ({filled} of them filled)"
        )
        if filled:
            note += (
                ": a group counts against admission until it is yielded, so a rollout_fn must yield "
                "finished groups while it waits in ctx.start_group() (docs/rollouts.md)"
            )
        return note

    async def run_groups(
        self, fn: Callable[[Group], Awaitable[list[Sample] | None]]
    ) -> AsyncIterator[list[Sample]]:
        """Start a group whenever admission lets one start, run `await fn(group)` on each at once, and
        yield each group's samples as fn returns them (finished groups before the next start, so none is
        held while admission waits). fn returns group.samples, filled, or None after ctx.abandon(group).
        An EngineCallError from fn is retried rollout.engine_retries times on fresh blanks, then the group
        is abandoned (counted as failed); any other exception is raised, naming fn."""
        name = hook_name(fn)
        retries = max(0, self._gen.rollout.engine_retries)
        running: dict[asyncio.Task, tuple[Group, int]] = {}

        async def attempt_of(group: Group, attempt: int):
            if attempt > 1:  # a retry waits for a dead engine to be back (bounded), as the generator's do
                await self._gen._until_engine_up()
            return await fn(group)

        def spawn(group: Group, attempt: int) -> None:
            task = asyncio.ensure_future(attempt_of(group, attempt))
            self._tasks.add(task)
            running[task] = (group, attempt)

        starting: asyncio.Task | None = asyncio.ensure_future(self.start_group())
        self._tasks.add(starting)
        try:
            while starting is not None or running:
                waiting = {*running, *([starting] if starting is not None else [])}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in [t for t in done if t in running]:  # finished groups first
                    group, attempt = running.pop(task)
                    self._tasks.discard(task)
                    try:
                        samples = task.result()
                    except EngineCallError as e:
                        self._gen.counters["engine_errors"] += 1
                        log.error(
                            "group %s: engine error (attempt %d/%d): %s",
                            group.group_id,
                            attempt,
                            1 + retries,
                            e,
                        )
                        if attempt <= retries and group.group_id in self._open:
                            group.samples = self._blanks(group.group_id, group.prompt)
                            spawn(group, attempt + 1)
                        else:
                            self.abandon(group)
                        continue
                    except Exception as e:
                        raise HookError(
                            f"rollout.rollout_fn: {name} raised {type(e).__name__}: {e} (group {group.group_id})"
                        ) from e
                    if samples is None:
                        self.abandon(group)  # given up by fn (a no-op if it abandoned it itself)
                    else:
                        yield samples
                if starting is not None and starting in done:
                    self._tasks.discard(starting)
                    group, starting = starting.result(), None
                    if group is not None:
                        spawn(group, 1)
                        starting = asyncio.ensure_future(self.start_group())
                        self._tasks.add(starting)
        finally:
            pending = [t for t in (*running, starting) if t is not None]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._tasks.difference_update(pending)

    def abandon(self, group: Group, *, settle: bool = True) -> None:
        """Give up a started group (it is counted as failed and frees its admission place; its prompt is
        settled: a resumed generator does not draw it again)."""
        if self._open.pop(group.group_id, None) is not None:
            self._gen.counters["groups_failed"] += 1
            self._gen._running -= 1
            if settle:
                self._gen.settle(group.group_id)

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
        group_size=gen.rollout.group_size,
        kwargs=dict(gen.rollout.generate_kwargs),
        _gen=gen,
        _stop=stop_event,
        _max_groups=max_groups,
    )
    gen.rollout_ctx = ctx
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
        for task in list(ctx._tasks):  # run_groups' tasks, if the function returned without finishing it
            task.cancel()
        for group in list(ctx._open.values()):  # started, never yielded
            ctx.abandon(group, settle=False)  # not finished: a resumed generator draws its prompt again
        await stream.aclose()
        gen.rollout_ctx = None
