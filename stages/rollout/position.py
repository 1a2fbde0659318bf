"""A generator's durable data position: which prompts of its source are settled (their group acked by
the buffer, or filtered, failed, or aborted as stale: an unfaulted run would not draw them again
either) and which are still open, so that a generator resumed after a kill draws every open prompt
again and no settled one (stages/rollout/generator.py's module docstring tells the whole story).

`DataPosition` keeps, in draw order from the oldest unsettled prompt, [position, settled] for each
drawn prompt; its state is that oldest position plus the settled ones drawn after it.
`live_groups_left` asks the buffer which groups earlier incarnations left live (and at which prompt
positions), for a resumed generator's admission and to settle those prompts too.

The random draws are durable too: each request of a group drawn from the source carries a sampling
seed (SamplingParams.seed) made of the run's seed, the generator's stream (its id up to the first ".",
which incarnations of one generator share: "gen-0" of "gen-0.3fa2c1"), the prompt's position and the
request's place in its group. An engine that honours the seed samples the same tokens for a prompt
drawn again after a kill as an uninterrupted run would have, whatever it ran before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time

DATA_POS_KEY = "slipstream_data_pos"  # Sample.metadata: [epoch, index] of the group's prompt (position)
log = logging.getLogger(__name__)
EVICTED_POLL_S = 0.5  # how often a held-back generator asks the buffer about evictions
# evictions of ours re-count the admission from the buffer's tally at most this often (recount_from_buffer)
RECOUNT_EVERY_S = 5.0
MAX_INCARNATIONS = 8  # earlier generator ids a state remembers (their groups in the buffer are its own)
SNAPSHOT_TRIES = 20  # reads of the buffer at a resume until one saw no fetch served meanwhile


class DataPosition:
    """The draw order of one generator's prompts and which of them are settled."""

    def __init__(self, source):
        self.source = source
        self._draws: list[list] = []  # [position, settled] per drawn prompt, oldest unsettled first
        self._draw_of: dict[str, list] = {}  # group id -> its entry in _draws
        self.skip: set[tuple[int, int]] = set()  # settled positions ahead (loaded state, buffer)
        self.low = self.current()  # the position of the oldest unsettled draw (or the next draw)

    def current(self) -> tuple[int, int]:
        return (int(self.source.epoch), int(self.source.index))

    def draw(self, gid: str):
        """The next prompt of the source that is not settled already, drawn for group `gid`."""
        while True:
            pos = self.current()
            prompt = next(self.source)
            if pos in self.skip:  # settled by an earlier incarnation: never drawn twice
                self.skip.discard(pos)
                self._draws.append([pos, True])
                continue
            entry = [pos, False]
            self._draws.append(entry)
            self._draw_of[gid] = entry
            return prompt

    def drawn(self) -> list[tuple[int, int]]:
        """The positions drawn since the oldest unsettled one, settled or not, in draw order."""
        return [tuple(p) for p, _ in self._draws]

    def of(self, gid: str) -> tuple[int, int] | None:
        """The position of group `gid`'s prompt while it is open (None for a prompt not drawn here)."""
        entry = self._draw_of.get(gid)
        return None if entry is None else tuple(entry[0])

    def settle(self, gid: str) -> bool:
        """Group `gid` is done with: its prompt is not to be drawn again. False if it was not open."""
        entry = self._draw_of.pop(gid, None)
        if entry is None:
            return False
        entry[1] = True
        k = 0
        while k < len(self._draws) and self._draws[k][1]:
            k += 1
        if k:
            del self._draws[:k]
        self.low = self._draws[0][0] if self._draws else self.current()
        return True

    def state_dict(self) -> dict:
        """`data`: the source's state at the oldest unsettled prompt; `done`: the settled ones after it."""
        low = self._draws[0][0] if self._draws else self.current()
        done = sorted({tuple(p) for p, settled in self._draws if settled} | self.skip)
        data = dict(self.source.state_dict(), epoch=low[0], index=low[1])
        return {"data": data, "done": [list(p) for p in done]}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["data"])
        self.skip = {(int(e), int(i)) for e, i in state.get("done", [])}
        self._draws, self._draw_of = [], {}
        self.low = self.current()


async def live_groups_left(sink, prior_ids: list[str]) -> tuple[int, int, dict] | None:
    """(trainer version, groups evicted so far, {group id: prompt position or None}) of the groups
    that the generators `prior_ids` left live in the buffer, from its stats and one peek of every live
    row; None for a sink without stats.

    The version is the one of the trainer's next fetch, i.e. the batches it has taken: one more than
    the buffer's version while the trainer trains on a batch served at that version (those groups left
    the buffer, the version that consumed them is announced only after the step). Counted from the
    buffer's version alone, a heal during a step misses one batch, and the new incarnation admits
    batch_groups groups too many for good (each one the buffer evicts frees its place for another).
    The peek is taken between two reads of the stats, again until no fetch or eviction came in between:
    a batch served meanwhile would be missing from the peek and not yet counted in the version."""
    stats_fn = getattr(sink, "stats", None)
    if stats_fn is None:
        return None
    prior = set(prior_ids)
    peek = getattr(sink, "peek", None)
    stats = await asyncio.to_thread(stats_fn)
    for _ in range(SNAPSHOT_TRIES):
        live: dict[str, tuple[int, int] | None] = {}
        rows = int(stats.get("rows", 0))
        batch = await asyncio.to_thread(peek, rows) if peek is not None and rows else None
        if batch is not None:
            cols = (batch.column(c).to_pylist() for c in ("generator_id", "group_id", "metadata"))
            for gen_id, group_id, meta in zip(*cols, strict=True):
                if gen_id in prior and group_id not in live:
                    pos = json.loads(meta or "{}").get(DATA_POS_KEY)
                    live[group_id] = (int(pos[0]), int(pos[1])) if pos else None
        after = await asyncio.to_thread(stats_fn)
        unchanged = _consumed(after) == _consumed(stats)
        stats = after
        if unchanged:
            break
    evicted = sum(stats.get("evicted_groups_by_producer", {}).get(p, 0) for p in prior)
    version = int(stats.get("version", 0))
    if stats.get("served_version") == version:  # mid-step: the batch of its next version is taken
        version += 1
    return version, evicted, live


def sample_seed(run_seed: int, stream: str, pos: tuple[int, int], key: str) -> int:
    """The sampling seed of one request: 31 bits (the width older SGLang keeps sampling_seed in) of a
    hash of the run's seed, the generator's stream, the prompt's position and the request's key (its
    place in the group: the request id past the group id, e.g. "-2" for the third sample of a
    single-turn group, "-2-1" for the second turn of the third sample in per-sample mode)."""
    text = f"{run_seed}:{stream}:{pos[0]}:{pos[1]}:{key}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & 0x7FFFFFFF


class SeededEngine:
    """The engine as one group's generate_fn reaches it: every request without a seed gets the one
    `seed_of(key)` makes, the key being its id past the group id `gid` (engine handles name requests
    "<gid>-<n>" or, per sample, "<gid>-<i>-<n>"; a request named otherwise keys by its whole id)."""

    def __init__(self, engine, gid: str, seed_of):
        self._engine, self._gid, self._seed_of = engine, gid, seed_of

    @property
    def version(self) -> int:
        return self._engine.version

    async def generate(self, requests):
        return await self._engine.generate([self._seeded(r) for r in requests])

    def _seeded(self, req):
        if req.params.seed is not None:  # a generate_fn's own choice
            return req
        key = req.rid[len(self._gid) :] if req.rid.startswith(self._gid) else req.rid
        return dataclasses.replace(req, params=dataclasses.replace(req.params, seed=self._seed_of(key)))

    def __getattr__(self, name: str):
        if name == "_engine":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._engine, name)


def _consumed(stats: dict) -> tuple:
    """What changes in a buffer's stats when the trainer takes groups out of it (a fetch served, groups
    evicted, a version announced)."""
    keys = ("version", "served_version", "served_groups", "evicted_groups")
    return tuple(stats.get(k) for k in keys)


class ResumableGenerator:
    """The part of the Generator (stages/rollout/generator.py) that makes its position durable and
    resumes it: `settle` a group, the state it writes and loads, and at run()'s start what earlier
    incarnations left in the buffer. It uses the generator's `position` (DataPosition), `state_path`,
    `id`, `group_counter`, `sink`, `batch_groups`, `_admission` (StalenessAdmission), `counters`,
    `_prior_ids`, `_prior_evicted`, `_evicted_polled`, `_recounted_at`, `resumed`, `run_seed` and
    `admission_counts()`."""

    def seeded(self, engine, gid: str):
        """`engine` for group `gid`'s requests: seeded from its prompt's position (module docstring),
        or as it is for a prompt not drawn from the source (a rollout_fn's own)."""
        pos = self.position.of(gid)
        if pos is None:
            return engine
        stream = self.id.split(".", 1)[0]
        return SeededEngine(engine, gid, lambda key: sample_seed(self.run_seed, stream, pos, key))

    def settle(self, gid: str) -> None:
        """The group `gid` is done with (acked, filtered, failed or aborted): its prompt is not to be
        drawn again. Writes the position (with state_path). Once per group."""
        if self.position.settle(gid):
            self._write_state()

    def _write_state(self) -> None:
        if not self.state_path:
            return
        tmp = f"{self.state_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.state_dict(), f)
        os.replace(tmp, self.state_path)  # atomic: a kill leaves the old state or the new one

    def state_dict(self) -> dict:
        """The durable data position (`data`, `done`: DataPosition.state_dict), the group counter and
        this and earlier incarnations' ids. A generator that loads it draws every unsettled prompt
        again and no settled one (see the module docstring)."""
        ids = [*self._prior_ids, self.id][-MAX_INCARNATIONS:]
        return dict(self.position.state_dict(), group_counter=self.group_counter, incarnations=ids)

    def load_state_dict(self, state: dict) -> None:
        self.position.load_state_dict(state)
        self.group_counter = int(state["group_counter"])
        self._prior_ids = [g for g in state.get("incarnations", []) if g != self.id]

    async def _resume_from_buffer(self) -> None:
        """A resumed generator (previous incarnations in its state) asks the buffer what they left live:
        their groups keep their admission places (StalenessAdmission.resume) and their prompts are
        settled. A sink without stats is not asked."""
        if not self._prior_ids or self.resumed:
            return
        left = await live_groups_left(self.sink, self._prior_ids)
        if left is None:
            return
        version, self._prior_evicted, live = left
        ahead = {p for p in live.values() if p is not None and p >= self.position.low}
        self.position.skip |= ahead
        if self.batch_groups > 0:
            self._admission.resume(len(live), version)
        self.resumed = {
            "trainer_version": version,
            "live_groups": len(live),
            "settled_from_buffer": len(ahead),
        }
        log.info(
            "generator %s: resumed at data position %s; previous incarnations %s left %d live groups in the "
            "buffer at trainer version %d",
            self.id,
            self.position.low,
            self._prior_ids,
            len(live),
            version,
        )

    async def _refresh_evicted(self) -> None:
        """While held back by admission, ask the buffer (at most every EVICTED_POLL_S) how many of our
        groups it evicted: acks stop while we are held back, so they cannot carry this news."""
        now = time.monotonic()
        ask = getattr(self.sink, "evicted_groups", None)  # SampleSink has it; a duck-typed sink may not
        if ask is None or now - self._evicted_polled < EVICTED_POLL_S:
            return
        self._evicted_polled = now
        if self._prior_ids and getattr(self.sink, "stats", None) is not None:
            # our previous incarnations' live groups hold places too (_resume_from_buffer): theirs count
            by = (await asyncio.to_thread(self.sink.stats)).get("evicted_groups_by_producer", {})
            n = by.get(self.id, 0) + sum(by.get(p, 0) for p in self._prior_ids) - self._prior_evicted
        else:
            n = await asyncio.to_thread(ask, self.id)
        if n > self.counters["groups_evicted"]:
            self.counters["groups_evicted"] = n
            if now - self._recounted_at >= RECOUNT_EVERY_S:  # a peek of every live row: not at every poll
                self._recounted_at = now
                await self.recount_from_buffer(self.batch_groups)

    async def recount_from_buffer(self, batch_groups: int) -> bool:
        """Re-base the staleness admission on the buffer's tally of our groups not yet consumed
        (StalenessAdmission.rebase), for a share of `batch_groups` per trainer batch; False for a sink
        without stats. Called when the share changes (elastic rollout) and whenever the buffer evicted
        groups of ours as too stale: more of ours were ahead of the trainer than it takes in time (a share
        estimate that missed, a departed generator's groups taken first), and since an evicted group
        frees its place, that surplus would otherwise live on, one eviction after another
        (bench/results/elastic_run.jsonl: 171 evictions after a removal, 2026-11-28)."""
        if batch_groups <= 0:
            return True
        left = await live_groups_left(self.sink, [*self._prior_ids, self.id])
        if left is None:
            return False
        version, _, buffered = left
        # read after the buffer's answer: groups started meanwhile are in both counts
        live, running = self.admission_counts()
        self._admission.rebase(live, running, len(buffered), version, batch_groups)
        return True
