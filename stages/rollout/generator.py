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
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pipeline.sample import Sample, Status
from stages.reward.registry import RewardScorer
from stages.rollout.build import build_engine, load_source
from stages.rollout.engine import Engine, GenRequest, GenResult, SamplingParams

log = logging.getLogger(__name__)
GroupFilter = Callable[[list[Sample]], bool]  # True = keep the group

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
__all__ = ["Generator", "build_engine", "nonzero_std"]


def nonzero_std(samples: list[Sample]) -> bool:
    """Dynamic sampling (DAPO): keep a group only if its rewards differ (all-equal groups have zero
    GRPO advantage and carry no gradient)."""
    rewards = [s.reward for s in samples if s.status != Status.FAILED]
    return len(set(rewards)) > 1


FILTERS: dict[str, GroupFilter | None] = {"none": None, "nonzero_std": nonzero_std}


EVICTED_POLL_S = 0.5  # how often a held-back generator asks the buffer about evictions
HELD_BACK_WARN_S = 30.0  # a generator held back by admission this long says why, and again as often


class Generator:
    """Streams scored, version-tagged GRPO groups from `engine` into `sink`.

    cfg: pipeline.config.RunConfig (uses cfg.rollout, cfg.run.max_staleness, cfg.run.seed, cfg.model)
    sink: buffer.transport.SampleSink (BufferClient, InProcBuffer, or a file writer)
    engine: an Engine; build one with build_engine(cfg)
    generator_id: stable, unique per generator (sample uids are f"{generator_id}-{group}-{i}")
    batch_groups: this generator's share of the trainer batch, in groups (trainer.batch_groups /
        num_generators); 0 disables admission control (e.g. a dry run with no trainer)
    source / tokenizer / scorer / group_filter: override what cfg would build (tests, custom tasks)
    """

    def __init__(
        self,
        cfg,
        sink,
        engine: Engine,
        generator_id: str,
        batch_groups: int,
        *,
        source=None,
        tokenizer=None,
        scorer: RewardScorer | None = None,
        group_filter: GroupFilter | None = None,
    ):
        r = cfg.rollout
        self.cfg, self.sink, self.engine, self.id = cfg, sink, engine, generator_id
        self.batch_groups = batch_groups
        self.max_staleness = cfg.run.max_staleness
        if source is None:
            source, tokenizer = load_source(cfg, tokenizer)
        self.source, self.tok = source, tokenizer if tokenizer is not None else source.tok
        self.scorer = scorer or RewardScorer.from_config(r.reward)
        self.group_filter = group_filter if group_filter is not None else FILTERS[r.filter]
        stop_ids = tuple(r.sampling.stop_token_ids)
        self.params = SamplingParams(
            temperature=r.sampling.temperature,
            top_p=r.sampling.top_p,
            max_new_tokens=r.sampling.max_new_tokens,
            stop_token_ids=stop_ids,
        )
        self._rng = random.Random(f"{generator_id}:{cfg.run.seed}")
        self._delay_mean = _parse_delay(r.delay_model)
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
            ),
            0,
        )
        self.admission_wait_s = 0.0
        self._evicted_polled = 0.0
        self._held_since = self._held_warned = 0.0
        self._held_at_count = -1  # groups_started when the current held-back stretch began
        self._running = 0
        self._last_engine_version = engine.version
        self._kept_offset = 0  # kept groups the trainer will never consume (see admissible)
        self._stopping = False
        self._wake: asyncio.Event | None = None
        # one thread for every put: sinks (a ZeroMQ DEALER socket) are not thread-safe, and one
        # thread also keeps groups reaching the buffer in the order they finished
        self._put_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{generator_id}-put")
        self._error: BaseException | None = None
        self._started_at = time.perf_counter()

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

    def admission_version(self) -> int:
        # The version a new group's tokens start at is the engine's. The trainer version learnt from acks
        # is only a lower bound that goes stale exactly when admission blocks (no sends, so no acks):
        # using it here deadlocks a generator that is waiting for the trainer to catch up.
        return self.engine.version

    def admissible(self) -> bool:
        if self.batch_groups <= 0:
            return True
        c = self.counters
        # groups the buffer evicted as too stale will never be consumed: they no longer hold a place
        live = c["groups_started"] - c["groups_filtered"] - c["groups_failed"] - c["groups_evicted"]
        version = self.admission_version()
        if version < self._last_engine_version:
            # The weights went back (a trainer restarted from its checkpoint): the groups the lost steps
            # consumed are counted as kept, but the new trainer consumes from `version` on. Count as if
            # exactly `version` batches were consumed and nothing of ours waits in the buffer; the
            # buffer's staleness bound still drops whatever that lets through too late.
            self._kept_offset = live - self._running - version * self.batch_groups
            log.warning("generator %s: engine weights went back to version %d", self.id, version)
        self._last_engine_version = version
        return live - self._kept_offset < (version + self.max_staleness + 1) * self.batch_groups

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
                "that a trainer is running against this buffer (and, standalone, --weights)",
                self.id,
                now - self._held_since,
                self.counters["groups_started"],
                self.engine.version,
                self.max_staleness,
            )

    async def _refresh_evicted(self) -> None:
        """While held back by admission, ask the buffer (at most every EVICTED_POLL_S) how many of our
        groups it evicted: acks stop while we are held back, so they cannot carry this news."""
        now = time.monotonic()
        ask = getattr(self.sink, "evicted_groups", None)  # SampleSink has it; a duck-typed sink may not
        if ask is None or now - self._evicted_polled < EVICTED_POLL_S:
            return
        self._evicted_polled = now
        n = await asyncio.to_thread(ask, self.id)
        if n > self.counters["groups_evicted"]:
            self.counters["groups_evicted"] = n

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, stop_event: asyncio.Event | None = None, max_groups: int | None = None) -> dict:
        """Generate until stop()/stop_event, or until max_groups groups were started and streamed.
        Returns stats(). An error from the sink (buffer unreachable) stops the loop and is raised."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        limit = self.cfg.rollout.max_inflight_groups
        try:
            while not self._should_stop(stop_event, max_groups):
                if self._error is not None:
                    raise self._error
                if self._running >= limit or not self.admissible():
                    held_back = self._running < limit  # by staleness admission, not by the in-flight cap
                    self.counters["admission_waits"] += held_back
                    t0 = time.perf_counter()
                    if held_back:
                        await self._refresh_evicted()
                        self._warn_if_held_back_long()
                    await self._wait(stop_event)
                    self.admission_wait_s += (time.perf_counter() - t0) * held_back
                    continue
                prompt = next(self.source)
                gid = f"{self.id}-{self.group_counter}"
                self.group_counter += 1
                self.counters["groups_started"] += 1
                self._running += 1
                task = asyncio.create_task(self._group(gid, prompt, self.engine.version))
                tasks.add(task)
                task.add_done_callback(lambda t: self._group_done(t, tasks))
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self._error is not None:
                raise self._error
        finally:
            for t in tasks:
                t.cancel()
            self._wake = None
        return self.stats()

    def _should_stop(self, stop_event: asyncio.Event | None, max_groups: int | None) -> bool:
        if self._stopping or (stop_event is not None and stop_event.is_set()):
            return True
        return max_groups is not None and self.counters["groups_started"] >= max_groups

    def _group_done(self, task: asyncio.Task, tasks: set[asyncio.Task]) -> None:
        tasks.discard(task)
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

    async def _group(self, gid: str, prompt, start_version: int) -> None:
        try:
            created = time.time()
            results = await self._generate(gid, prompt)
            if results is None:
                self.counters["groups_failed"] += 1
                return
            samples = await self._score(gid, prompt, results, created)
            if self.group_filter is not None and not self.group_filter(samples):
                self.counters["groups_filtered"] += 1
                return
            ack = await asyncio.get_running_loop().run_in_executor(self._put_thread, self.sink.put, samples)
            self.set_trainer_version(ack.trainer_version)
            self.counters["groups_finished"] += 1
            self.counters["samples"] += len(samples)
            self.counters["samples_failed"] += sum(s.status == Status.FAILED for s in samples)
            self.counters["tokens"] += sum(s.response_len for s in samples)
        finally:
            self._running -= 1

    async def _generate(self, gid: str, prompt) -> list[GenResult] | None:
        n = self.cfg.rollout.group_size
        reqs = [
            GenRequest(prompt_ids=list(prompt.ids), params=self.params, rid=f"{gid}-{i}") for i in range(n)
        ]
        attempts = 1 + max(0, self.cfg.rollout.engine_retries)
        for attempt in range(1, attempts + 1):
            try:
                results = await self.engine.generate(reqs)
                if self._delay_mean:  # bench only: a long-tailed per-group latency
                    await asyncio.sleep(self._rng.lognormvariate(0, 1) * self._delay_mean / 1.6487)
                return results
            except Exception as e:
                self.counters["engine_errors"] += 1
                log.error("group %s: engine error (attempt %d/%d): %s", gid, attempt, attempts, e)
        return None

    async def _score(self, gid: str, prompt, results: list[GenResult], created: float) -> list[Sample]:
        samples, texts = [], []
        for i, res in enumerate(results):
            ids = res.response_ids
            body = ids[:-1] if res.finish_reason == "stop" and ids else ids
            texts.append(self.tok.decode(body, skip_special_tokens=False))
            samples.append(
                Sample.build(
                    uid=f"{gid}-{i}",
                    group_id=gid,
                    group_index=i,
                    group_size=len(results),
                    prompt_ids=prompt.ids,
                    response_ids=ids,
                    rollout_logprobs=res.logprobs,
                    versions=res.versions,
                    status=_STATUS.get(res.finish_reason, Status.ABORTED),
                    prompt=prompt.text,
                    label=prompt.label,
                    metadata=prompt.metadata,
                    generator_id=self.id,
                    created_at=created,
                )
            )
        await self.scorer.score(samples, texts)
        return samples

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
        eng = self.engine.stats()
        out.update(
            {f"engine_{k}": v for k, v in eng.items() if k in ("busy_s", "idle_s", "tokens", "updates")}
        )
        return out

    def state_dict(self) -> dict:
        """Data position + group counter: enough to resume without reusing uids or prompts."""
        return {"data": self.source.state_dict(), "group_counter": self.group_counter}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["data"])
        self.group_counter = int(state["group_counter"])


def _parse_delay(spec: str) -> float:
    if not spec:
        return 0.0
    kind, _, mean = spec.partition(":")
    if kind != "longtail" or not mean:
        raise ValueError(f"rollout.delay_model={spec!r}: expected '' or 'longtail:<mean seconds>'")
    return float(mean)
