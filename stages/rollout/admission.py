"""Staleness admission of one generator (generator.py's module docstring has the rule): whether a new group
may start at the engine's weight version, told apart from the two ways that version goes back. A
relaunched SGLang server runs older weights until the trainer's catch-up push (counting goes on as before:
a dip); a trainer restarted from its checkpoint really went back (counting starts over from its version)."""

from __future__ import annotations

import logging
import time

from stages.rollout.engine import Engine
from stages.rollout.flight import Flight

log = logging.getLogger(__name__)


class StalenessAdmission:
    """`admits(live, running, dip_wait_s)`: whether a group may start beside `live` kept-or-running groups
    (`running` of them in flight) on `engine`, `batch_groups` of which the trainer consumes per version."""

    def __init__(self, engine: Engine, batch_groups: int, max_staleness: int, name: str):
        self.engine, self.batch_groups, self.max_staleness, self.name = (
            engine,
            batch_groups,
            max_staleness,
            name,
        )
        self._last_engine_version, self._relaunches_seen = engine.version_and_relaunches()
        self._kept_offset = 0  # kept groups the trainer will never consume (see admits)
        self._relaunch_dip: int | None = None  # the version a relaunched engine runs until caught up
        self._relaunch_dip_since = 0.0

    def admits(self, live: int, running: int, dip_wait_s: float) -> bool:
        # The version a new group's tokens start at is the engine's. The trainer version learnt from acks
        # is only a lower bound that goes stale exactly when admission blocks (no sends, so no acks):
        # using it here deadlocks a generator that is waiting for the trainer to catch up.
        version, relaunches = self.engine.version_and_relaunches()
        went_back = version < self._last_engine_version
        if went_back and self._in_relaunch_dip(version, relaunches, dip_wait_s):
            # A relaunched server runs older weights (often the base model's) until the trainer's
            # catch-up push; the trainer did not go back. Counting goes on from before the relaunch, so
            # nothing starts meanwhile (it would come too stale) and nothing floods in once caught up.
            self._relaunches_seen = relaunches
        else:
            if went_back:
                # The weights went back (a trainer restarted from its checkpoint): the groups the lost
                # steps consumed are counted as kept, but the new trainer consumes from `version` on.
                # Count as if exactly `version` batches were consumed and nothing of ours waits in the
                # buffer; the buffer's staleness bound still drops whatever that lets through too late.
                self._kept_offset = live - running - version * self.batch_groups
                log.warning("generator %s: engine weights went back to version %d", self.name, version)
            self._relaunch_dip = None
            self._last_engine_version, self._relaunches_seen = version, relaunches
        return live - self._kept_offset < (version + self.max_staleness + 1) * self.batch_groups

    def resume(self, prior_live: int, trainer_version: int) -> None:
        """A new incarnation of a generator: its predecessors left `prior_live` groups live in the buffer
        and the trainer's next fetch is at `trainer_version`, so it has taken that many batches (its
        version, or one more mid-step: position.live_groups_left). Count as if this generator had kept
        `trainer_version * batch_groups` groups that were consumed plus those live ones, so that at
        engine version `trainer_version` only (max_staleness + 1) * batch_groups - prior_live more may
        start (fresh counters would admit (trainer_version + max_staleness + 1) * batch_groups groups:
        far more than the trainer can take in time, so the buffer would evict the surplus as too stale).
        The count is never corrected later: one batch too few here is one batch of surplus for good."""
        self._kept_offset = -(prior_live + trainer_version * self.batch_groups)

    def reshare(self, batch_groups: int) -> None:
        """The run's generator count changed (elastic rollout, docs/elastic.md): from now on the trainer
        consumes `batch_groups` of this generator's groups per version instead. The groups kept so far
        were consumed at the old share, about `old * v` of them by engine version v, so the count is
        re-based as if they had been consumed at the new share: the groups still ahead of the trainer
        (kept, not yet consumed, or running) keep their places, and the window of max_staleness + 1
        versions is measured in the new share from here. The engine's version stands in for the batches
        consumed (it is at most one push behind the trainer's). Only for a sink without stats: `rebase`
        counts from the buffer's own tally, which this estimate can miss by many groups."""
        self._check_share(batch_groups)
        # the last version admits() saw, or a newer one pushed since (a relaunch dip's is lower: not it)
        v = max(self._last_engine_version, self.engine.version)
        self._kept_offset += v * (self.batch_groups - batch_groups)
        self.batch_groups = batch_groups

    def rebase(self, live: int, running: int, buffered: int, trainer_version: int, batch_groups: int) -> None:
        """The run's generator count changed and the buffer told how many of this generator's groups it
        holds (`buffered`, not yet consumed) with the version of the trainer's next fetch
        (position.live_groups_left): from now on the trainer takes `batch_groups` of ours per version.
        Count as if every batch so far had taken exactly that many: the groups ahead of the trainer are
        those buffered plus the `running` ones, whatever share the others took meanwhile. `reshare`'s
        estimate from the engine version alone assumed each batch took exactly the old share; with two
        generators it did not (the trainer takes what arrives first), and the difference stayed a
        surplus for good: each group the buffer evicted as too stale freed a place for another
        (bench/results/elastic_run.jsonl, 2026-11-28: 126 evictions after a removal, none without).
        `live`: kept-or-running groups as admits() counts them."""
        self._check_share(batch_groups)
        self.batch_groups = batch_groups
        self._kept_offset = live - running - buffered - trainer_version * batch_groups

    def _check_share(self, batch_groups: int) -> None:
        if batch_groups <= 0:
            raise ValueError(
                f"generator {self.name}: a share of {batch_groups} groups per trainer batch; need >= 1"
            )

    def _in_relaunch_dip(self, version: int, relaunches: int, dip_wait_s: float) -> bool:
        """Whether `version`, below the last one seen, is a relaunched engine's (True) rather than a
        trainer's gone back to its checkpoint. A dip begins with a relaunch counted with it and lasts
        while the version stays there, for at most the time a relaunch and its catch-up take: a trainer
        restarted meanwhile pushes another version, or, at the dip's own version (a fresh trainer at
        0), is recognised by the dip outlasting that: `dip_wait_s`, twice the relaunch bound, since in a
        pool the dip begins when the server goes down and the catch-up may wait for the trainer's next
        step."""
        now = time.monotonic()
        if relaunches > self._relaunches_seen:
            if self._relaunch_dip is None:
                log.warning(
                    "generator %s: a relaunched engine runs version %d, behind %d: no new group until "
                    "the trainer pushes it the current weights",
                    self.name,
                    version,
                    self._last_engine_version,
                )
            self._relaunch_dip, self._relaunch_dip_since = version, now
            return True
        return version == self._relaunch_dip and now - self._relaunch_dip_since < dip_wait_s


def abort_stale(
    flights: dict[str, Flight], now: int, max_staleness: int, name: str, *, keep_partial: bool = False
) -> None:
    """Cancel the groups of `flights` that can no longer be trained within run.max_staleness at engine
    version `now`. A group whose current attempt started on engine version v has tokens of version >= v,
    and the trainer that consumes it is at least at the engine's version now, so once
    `engine.version - v > max_staleness` the buffer would evict it on arrival. The engine's version, not
    the trainer's from acks: it goes back with a restarted trainer, where the acks' does not. Cancelling
    a group's task closes its requests (SGLang aborts a request whose client went away); it is counted
    once the task has ended cancelled. `keep_partial` (rollout.partial_rollout): interrupt its requests
    instead, which end with their tokens so far for the group to continue from (partial.py)."""
    for gid, f in flights.items():
        if f.generating and not f.aborting and now - f.start_version > max_staleness:
            f.aborting = True
            if keep_partial:
                f.interrupt.set()
            else:
                f.task.cancel()
            log.info(
                "generator %s: %s group %s started at engine version %d: at version %d it can "
                "no longer be trained within run.max_staleness=%d",
                name,
                "recycling" if keep_partial else "aborting",
                gid,
                f.start_version,
                now,
                max_staleness,
            )
