"""The rollout generator loop: keeps an engine busy with many GRPO groups in flight, scores each group
as soon as it finishes and streams it to the buffer, under staleness admission control.

Admission (as AReaL does it). The trainer consumes `batch_groups` of this generator's groups per
optimizer step, oldest first, so the k-th kept group (k from 0) is trained at trainer version
>= k // batch_groups. A group started on weights of version v is therefore trainable within
`max_staleness` only if k // batch_groups <= v + max_staleness. The generator starts a new group only while

    kept_or_running_groups < (v + max_staleness + 1) * batch_groups,   v = min(trainer, engine version)

where groups dropped by the filter or by failures do not count (the trainer never sees them). The
trainer version comes from buffer acks and announcements; the engine version from weight pushes.
Tokens carry the engine version, so the engine's (older) version is the one that bounds staleness.

Resuming (a healed incarnation, or a re-run in the same directory). The data position is made durable
group by group: a prompt is settled once its group is acked by the buffer (or filtered, failed, aborted
as stale: an unfaulted run would not draw it again either), and `state_dict()` holds the position of the
oldest unsettled prompt plus the settled ones drawn after it; with `state_path` it is written at each
settlement. A resumed generator draws from there and skips the settled prompts, so the prompts in flight
at a kill are drawn again and no settled one is. At its start (`run()`) it also asks the buffer what its
previous incarnations left there (stats, peek): their live groups keep their admission places, counted as
if this generator had kept pace with the trainer's version (so a heal does not admit a full window
afresh), and their prompts are settled too (acked, but killed before the state was written).

In-flight caps, below that bound: at most `rollout.max_inflight_groups` groups, and with
`rollout.max_inflight_requests` set, a new group starts only while its requests fit beside those the
engine still decodes. Each request counts until its own answer, so a group whose last sequence is
still decoding holds one place, not group_size: with a long length tail that keeps the engine full.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from buffer.record import Sample, Status
from buffer.transport import SampleSink
from stages.models import ModelConfig
from stages.reward.registry import RewardScorer
from stages.rollout.admission import StalenessAdmission, abort_stale
from stages.rollout.agent_run import AgentGenerateFn
from stages.rollout.build import load_source
from stages.rollout.config import RolloutConfig
from stages.rollout.custom_loop import run_rollout_fn
from stages.rollout.engine import Engine, SamplingParams
from stages.rollout.engine_watch import watch_for
from stages.rollout.flight import Flight, SendingEngine
from stages.rollout.generate_fn import GenerateFn
from stages.rollout.hooks import GroupFilter, apply_filter, hook_name, load_hook, resolve_filter
from stages.rollout.partial import continue_partial, has_partial
from stages.rollout.position import DATA_POS_KEY, DataPosition, ResumableGenerator
from stages.rollout.run import RolloutRun
from stages.rollout.scoring import score_samples
from stages.rollout.teacher import TeacherClient

log = logging.getLogger(__name__)
__all__ = ["EngineDown", "Generator", "score_samples"]


HELD_BACK_WARN_S = 30.0  # a generator held back by admission this long says why, and again as often


class Generator(ResumableGenerator):
    """Streams scored, version-tagged GRPO groups from `engine` into `sink`.

    rollout: the `rollout:` section; model: the `model:` section (its tokenizer, unless one is given)
    run: RolloutRun (run.seed, run.max_staleness as the stages run with it)
    sink: buffer.transport.SampleSink (BufferClient, InProcBuffer, or a file writer)
    engine: an Engine; build one with build.build_engine(rollout, model, run)
    generator_id: stable, unique per generator (sample uids are f"{generator_id}-{group}-{i}")
    batch_groups: this generator's share of the trainer batch, in groups (trainer.batch_groups /
        num_generators); 0 disables admission control (e.g. a dry run with no trainer)
    source / tokenizer / scorer / group_filter: override what the config would build (tests, custom tasks)
    state_path: where `state_dict()` is written (atomically) each time a drawn prompt is settled; load it
        with `load_state_dict` before run() to resume (see the module docstring)

    Each group is made by the generate_fn (rollout.generate_fn, default: single_turn), called once per
    group or, with rollout.generate_per_sample, once per sample (generate_fn.GenerateFn, which the evaluator
    calls too; with rollout.agent_fn, agent_run.AgentGenerateFn runs one agent episode per member); what
    it returns is checked (hooks.check_samples), scored, filtered and put.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        model: ModelConfig,
        run: RolloutRun,
        sink: SampleSink,
        engine: Engine,
        generator_id: str,
        batch_groups: int,
        *,
        source: Any = None,
        tokenizer: Any = None,
        scorer: RewardScorer | None = None,
        group_filter: GroupFilter | None = None,
        state_path: str | os.PathLike | None = None,
    ):
        r = rollout
        self.rollout, self.sink, self.engine, self.id = rollout, sink, engine, generator_id
        self.batch_groups = batch_groups
        self.max_staleness, self.run_seed = run.max_staleness, run.seed
        if source is None:
            source, tokenizer = load_source(r.data, model, tokenizer)
        self.source, self.tok = source, tokenizer if tokenizer is not None else source.tok
        self.scorer = scorer or RewardScorer.from_config(r.reward)
        self.teacher = TeacherClient(run.teacher_url) if run.teacher_url else None  # trainer.distill.server
        self.group_filter = group_filter if group_filter is not None else resolve_filter(r.filter)
        self.generate = (AgentGenerateFn if r.agent_fn else GenerateFn).from_config(r, self.tok)
        self.rollout_fn = load_hook(r.rollout_fn, "rollout.rollout_fn") if r.rollout_fn else None
        self.rollout_ctx = None  # the RolloutContext while a rollout_fn runs (custom_loop.run_rollout_fn)
        self.params = SamplingParams.from_config(r.sampling)
        self._rng = random.Random(f"{generator_id}:{run.seed}")
        self._delay_mean = r.delay_mean_s()
        self.trainer_version = engine.version
        self.group_counter = 0
        self.counters = dict.fromkeys(
            (
                "groups_started",
                "groups_finished",
                "groups_filtered",
                "groups_failed",
                "engine_errors",
                "samples",
                "samples_failed",
                "tokens",
                "admission_waits",
                "groups_evicted",
                "groups_aborted_stale",
                "groups_recycled",  # rollout.partial_rollout: continued from their tokens so far
            ),
            0,
        )
        self._flights: dict[str, Flight] = {}  # the groups run() started and not yet done
        self.admission_wait_s = 0.0
        self._evicted_polled = self._recounted_at = 0.0
        self._held_since = self._held_warned = 0.0
        self._held_at_count = -1  # groups_started when the current held-back stretch began
        self._running = 0
        self._engine_down_since: float | None = None  # when engine.available() last turned False
        self._engine_down_warned = 0.0
        # a retry waits this long for a dead engine: its relaunch (startup) plus two health checks
        sglang = r.sglang
        self._engine_down_wait_s = sglang.startup_timeout_s + 2 * sglang.health_check_s
        self._admission = StalenessAdmission(engine, batch_groups, self.max_staleness, generator_id)
        self._stopping = False
        self._wake: asyncio.Event | None = None
        # one thread for every put: sinks (a ZeroMQ DEALER socket) are not thread-safe, and one
        # thread also keeps groups reaching the buffer in the order they finished
        self._put_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{generator_id}-put")
        self._error: BaseException | None = None
        self._watch = None  # the engine watch while run() runs (SGLang with rollout.sglang.health_check_s)
        self._started_at = time.perf_counter()
        # -- the durable data position (see the module docstring) --
        self.state_path = str(state_path) if state_path else ""
        self.position = DataPosition(self.source)
        self._prior_ids: list[str] = []  # previous incarnations' ids, from the loaded state
        self._prior_evicted = 0  # their evicted groups when run() began (later ones free places)
        self.resumed: dict = {}  # what run() learnt from the buffer at start (stats()["resumed"])

    # -- control ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Start no new groups; run() returns once the in-flight groups are streamed."""
        self._stopping = True
        self._poke()

    def set_trainer_version(self, version: int) -> None:
        """A version announcement (also learnt from every buffer ack)."""
        if version > self.trainer_version:
            self.trainer_version = version
            self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def admission_counts(self) -> tuple[int, int]:
        """(groups kept or running, groups running): what staleness admission counts against its window."""
        c = self.counters
        # groups the buffer evicted as too stale will never be consumed: they no longer hold a place
        gone = ("groups_filtered", "groups_failed", "groups_evicted", "groups_aborted_stale")
        return c["groups_started"] - sum(c[k] for k in gone), self._running

    def admissible(self) -> bool:
        if self.batch_groups <= 0:
            return True
        live, running = self.admission_counts()
        # a relaunched engine's dip lasts at most twice the relaunch bound (see StalenessAdmission)
        return self._admission.admits(live, running, 2 * self._engine_down_wait_s)

    def _warn_if_held_back_long(self) -> None:
        """Say so, every HELD_BACK_WARN_S, when admission has kept every new group back that long."""
        now = time.monotonic()
        started = self.counters["groups_started"]
        if started != self._held_at_count:  # a group was admitted since: a new stretch begins
            self._held_since, self._held_warned, self._held_at_count = now, now, started
        elif now - self._held_warned > HELD_BACK_WARN_S:
            self._held_warned = now
            log.warning(
                "generator %s: no new group for %.0fs: %d groups started at engine version %d is the most "
                "run.max_staleness=%d allows until the trainer consumes them and pushes new weights; check "
                "that a trainer is running against this buffer (and, standalone, --weights)%s",
                self.id,
                now - self._held_since,
                self.counters["groups_started"],
                self.engine.version,
                self.max_staleness,
                self.rollout_ctx.unyielded_note(hook_name(self.rollout_fn)) if self.rollout_ctx else "",
            )

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, stop_event: asyncio.Event | None = None, max_groups: int | None = None) -> dict:
        """Generate until stop()/stop_event, or until max_groups groups were started and streamed.
        Returns stats(). An error from the sink (buffer unreachable) stops the loop and is raised."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop_event = stop_event
        tasks: set[asyncio.Task] = set()
        self._watch = watch_for(self.engine, self.rollout)  # restarts a dead SGLang server meanwhile
        watching = asyncio.create_task(self._watch.run()) if self._watch else None
        try:
            await self._resume_from_buffer()
            if self.rollout_fn is not None:
                await run_rollout_fn(self, stop_event, max_groups)
            else:
                while await self.admitted(stop_event, max_groups):
                    self._launch(tasks)
                while tasks:  # the last groups: those past the staleness bound are still aborted
                    self._abort_stale_groups()
                    await asyncio.wait(set(tasks), timeout=0.05)
            if self._error is not None:
                raise self._error
        finally:
            for t in tasks:
                t.cancel()
            if watching is not None:
                watching.cancel()
                self._watch.close()
            self._wake = None
        return self.stats()

    def _launch(self, tasks: set[asyncio.Task]) -> None:
        """Start a group (right after admitted()) as a task in `tasks`."""
        gid, prompt = self.start_group()
        # its requests count against the request cap from now, until they reach the engine (sent)
        flight = Flight(start_version=self.engine.version, unsent=self.rollout.group_size)
        flight.task = asyncio.create_task(self._group(gid, prompt, flight))
        self._flights[gid] = flight
        tasks.add(flight.task)
        # a done callback, not the task's own `finally`: a task cancelled before it first ran never
        # enters its body (a push that lands right after its start, then abort_stale_groups), and its
        # places must be given back all the same
        flight.task.add_done_callback(lambda t: self._group_done(t, tasks, gid))

    @property
    def _unsent(self) -> int:
        """Requests of the groups in flight not yet sent to the engine (the request cap counts them)."""
        return sum(f.unsent for f in self._flights.values())

    async def admitted(self, stop_event: asyncio.Event | None, max_groups: int | None) -> bool:
        """Wait until a new group may start (in-flight cap and staleness admission); False once the
        generator is to stop. Raises the error of a group that failed the run."""
        while not self._should_stop(stop_event, max_groups):
            if self._error is not None:
                raise self._error
            self._abort_stale_groups()
            has_room = self._has_room()
            if not self._engine_up():
                pass  # a server died or is being relaunched: its groups would only fail
            elif has_room and self.admissible():
                return True
            held_back = has_room and self._engine_down_since is None  # by staleness admission
            self.counters["admission_waits"] += held_back
            t0 = time.perf_counter()
            if held_back:
                await self._refresh_evicted()
                self._warn_if_held_back_long()
            await self._wait(stop_event)
            self.admission_wait_s += (time.perf_counter() - t0) * held_back
        return False

    def _engine_up(self) -> bool:
        """Whether the engine can serve; says so when it has been down for long (the engine watch
        relaunches a dead SGLang server and logs each attempt), and raises EngineDown once it has been
        down for two relaunches' time: the generator then fails, named, instead of waiting for ever."""
        if self.engine.available():
            if self._engine_down_since is not None:
                log.warning(
                    "generator %s: the engine is back after %.0fs",
                    self.id,
                    time.monotonic() - self._engine_down_since,
                )
                self._engine_down_since = None
            return True
        now = time.monotonic()
        if self._engine_down_since is None:
            self._engine_down_since = self._engine_down_warned = now
            log.warning("generator %s: the engine is down; no new group until it is back", self.id)
        elif now - self._engine_down_since > 2 * self._engine_down_wait_s:
            raise EngineDown(
                f"generator {self.id}: the engine has been down for {now - self._engine_down_since:.0f}s, two "
                "relaunches' time (rollout.sglang.startup_timeout_s + 2 x health_check_s each); the engine "
                "watch's errors and the SGLang log say why it does not come back"
            )
        elif now - self._engine_down_warned > HELD_BACK_WARN_S:
            self._engine_down_warned = now
            log.warning(
                "generator %s: the engine has been down for %.0fs (the engine watch relaunches a dead SGLang "
                "server every rollout.sglang.health_check_s; its log says why it is not back)",
                self.id,
                now - self._engine_down_since,
            )
        return False

    async def _until_engine_up(self) -> None:
        """Before a group's retry: wait while the engine is down, at most its relaunch time
        (rollout.sglang.startup_timeout_s + 2 x health_check_s); then the retry runs, and if it fails
        the group counts as failed: no wait without an end."""
        deadline = time.monotonic() + self._engine_down_wait_s
        while not self._engine_up() and time.monotonic() < deadline:
            if self._should_stop(self._stop_event, None):
                return
            await asyncio.sleep(0.2)

    def _abort_stale_groups(self) -> None:
        """rollout.abort_stale_groups: cancel the groups that can no longer be trained within
        run.max_staleness (admission.abort_stale), so that the engine decodes something else."""
        if self.rollout.abort_stale_groups and self.batch_groups > 0:
            keep = self.rollout.partial_rollout
            abort_stale(self._flights, self.engine.version, self.max_staleness, self.id, keep_partial=keep)

    def _has_room(self) -> bool:
        """Room for one more group under the in-flight caps: max_inflight_groups, and with
        max_inflight_requests set, a whole group's requests beside those the engine still decodes."""
        r = self.rollout
        if self._running >= r.max_inflight_groups:
            return False
        if not r.max_inflight_requests:
            return True
        in_flight = self.engine.requests_in_flight()
        if in_flight is None:
            return True
        return in_flight + self._unsent + r.group_size <= r.max_inflight_requests

    def start_group(self, prompt=None) -> tuple[str, object]:
        """Count a new group as started (call right after admitted()); returns its id and prompt."""
        gid = f"{self.id}-{self.group_counter}"
        if prompt is None:
            prompt = self.position.draw(gid)
        self.group_counter += 1
        self.counters["groups_started"] += 1
        self._running += 1
        return gid, prompt

    def _should_stop(self, stop_event: asyncio.Event | None, max_groups: int | None) -> bool:
        if self._stopping or (stop_event is not None and stop_event.is_set()):
            return True
        return max_groups is not None and self.counters["groups_started"] >= max_groups

    def _group_done(self, task: asyncio.Task, tasks: set[asyncio.Task], gid: str) -> None:
        tasks.discard(task)
        flight = self._flights.pop(gid)  # with it, its unsent request places
        self._running -= 1
        if task.cancelled() and flight.aborting and not self.rollout.partial_rollout:  # abort_stale's cancel
            self.counters["groups_aborted_stale"] += 1
            self.settle(gid)
        elif not task.cancelled() and task.exception() is None:  # put (acked or filtered) or failed
            self.settle(gid)
        # cancelled at shutdown, or the sink failed: not settled, its prompt is drawn again on resume
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()  # the sink failed: run() re-raises it
        if self._wake is not None:
            self._wake.set()

    async def _wait(self, stop_event: asyncio.Event | None) -> None:
        """Sleep until a group finishes, a version changes, or stop."""
        self._wake.clear()
        waiters = [asyncio.ensure_future(self._wake.wait())]
        if stop_event is not None:
            waiters.append(asyncio.ensure_future(stop_event.wait()))
        # the engine version may change without anyone poking us (a push applied by another thread)
        await asyncio.wait(waiters, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()

    async def _group(self, gid: str, prompt, flight: Flight) -> None:
        samples = await self._generate(gid, prompt, flight)
        while self.rollout.partial_rollout and flight.aborting and has_partial(samples):  # it went stale
            self.counters["groups_recycled"] += 1
            flight.recycle(self.engine.version)
            engine = self.seeded(SendingEngine(self.engine, lambda n: None, flight), gid)
            samples = await continue_partial(
                engine, f"{gid}-r{flight.recycles}", samples, self.params, self.id
            )
        flight.generating = False  # past aborting: its put may already be on the way
        if samples is None:
            self.counters["groups_failed"] += 1
            return
        await self._score(samples)
        await self._put(samples)

    async def _put(self, samples: list[Sample]) -> None:
        """Filter a scored group and stream it to the sink (counted either way)."""
        gid = samples[0].group_id if samples else ""
        if self.group_filter is not None and not apply_filter(self.group_filter, samples):
            self.counters["groups_filtered"] += 1
            self.settle(gid)
            return
        pos = self.position.of(gid)
        if pos is not None:  # which prompt it was, for a resumed incarnation and for audits
            for s in samples:
                s.metadata[DATA_POS_KEY] = list(pos)
        ack = await asyncio.get_running_loop().run_in_executor(self._put_thread, self.sink.put, samples)
        self.settle(gid)  # acked: durable in the buffer, so its prompt is never drawn again
        self.set_trainer_version(ack.trainer_version)
        self.counters["groups_finished"] += 1
        self.counters["samples"] += len(samples)
        self.counters["samples_failed"] += sum(s.status == Status.FAILED for s in samples)
        self.counters["tokens"] += sum(s.response_len for s in samples)

    async def _generate(self, gid: str, prompt, flight: Flight) -> list[Sample] | None:
        """The group's Samples from the generate_fn (None when the engine kept failing). An engine error
        is retried with fresh blanks, once the engine is up; anything else the function raises, or a bad
        return, is raised."""

        def sent(n: int) -> None:
            flight.unsent = max(0, flight.unsent - n)

        async def before_retry() -> None:
            flight.generating = False  # nothing to abort while it waits: its stale tokens are gone
            await self._until_engine_up()
            flight.start_version, flight.generating = self.engine.version, True  # the retry's are new

        try:
            samples = await self.generate.with_retries(
                gid=gid,
                prompt=prompt,
                n=self.rollout.group_size,
                generator_id=self.id,
                params=self.params,
                engine=self.seeded(SendingEngine(self.engine, sent, flight), gid),
                retries=self.rollout.engine_retries,
                on_engine_error=self._count_engine_error,
                before_retry=before_retry,
            )
        finally:
            flight.unsent = 0  # a group that failed, or sent fewer requests than its size
        if samples is not None and self._delay_mean:  # bench only: a long-tailed per-group latency
            await asyncio.sleep(self._rng.lognormvariate(0, 1) * self._delay_mean / 1.6487)
        return samples

    def _count_engine_error(self, _error: BaseException) -> None:
        self.counters["engine_errors"] += 1

    async def _score(self, samples: list[Sample]) -> None:
        """The reward of each sample, and with a served teacher its logprobs of the response."""
        await score_samples(self.scorer, self.tok, samples)
        if self.teacher is not None:
            await self.teacher.annotate(samples)

    # -- observability ----------------------------------------------------------------------------
    def stats(self) -> dict:
        out = dict(self.counters)
        out.update(
            groups_running=self._running,
            trainer_version=self.trainer_version,
            engine_version=self.engine.version,
            admission_wait_s=round(self.admission_wait_s, 3),
            reward_failures=self.scorer.failures,
            elapsed_s=round(time.perf_counter() - self._started_at, 3),
            data=dict(self.source.counters, **self.source.state_dict()),
        )
        if self.resumed:
            out["resumed"] = dict(self.resumed)
        in_flight = self.engine.requests_in_flight()
        if in_flight is not None:  # how full the engine is kept (the request cap's doing)
            out["requests_in_flight"] = in_flight
        eng = self.engine.stats()
        out.update(
            {
                f"engine_{k}": v
                for k, v in eng.items()
                if k in ("busy_s", "idle_s", "tokens", "prefill_tokens", "updates")
            }
        )
        if self._watch is not None:
            out["engine_restarts"] = self._watch.restarts
        return out


class EngineDown(RuntimeError):
    """The generator's engine stayed down (not available()) for longer than relaunches take."""
