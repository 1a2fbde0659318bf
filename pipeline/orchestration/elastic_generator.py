"""The generator as an elastic run hosts it: its share of a trainer batch can change mid-run, and one
that joins a run already going counts its admission from the trainer's version (docs/elastic.md).

A subclass rather than calls into the Generator's parts from the actor: the two operations touch the
generator's staleness admission, which the Generator owns; moving `set_share` and `join` into
stages/rollout/generator.py would make this module unnecessary.
"""

from __future__ import annotations

import logging

from stages.rollout.generator import Generator
from stages.rollout.position import live_groups_left

log = logging.getLogger(__name__)


class ElasticGenerator(Generator):
    """A Generator whose share of the trainer batch (`batch_groups`) the driver may change while it runs."""

    async def set_share(self, batch_groups: int) -> None:
        """From now on the trainer takes `batch_groups` of this generator's groups per version. The count
        of groups kept so far is re-based from the buffer's tally of ours (StalenessAdmission.rebase),
        or, from a sink without stats, estimated from the engine version (reshare)."""
        if batch_groups == self.batch_groups:
            return
        if not await self.recount_from_buffer(batch_groups):
            self._admission.reshare(batch_groups)
        log.info(
            "generator %s: share of a trainer batch %d -> %d groups", self.id, self.batch_groups, batch_groups
        )
        self.batch_groups = batch_groups
        self._poke()  # a larger share may admit a group at once

    async def join(self) -> int:
        """Before run(), for a generator added to a run already going: count as if it had kept pace with
        the trainer (the version of the trainer's next fetch, served_version included, as a healed
        incarnation does: position.live_groups_left), so that it admits one window of groups, not one
        per version the run has already trained. A generator with earlier incarnations in its state is
        re-counted by run() itself from their live groups. Returns the version it joined at."""
        left = await live_groups_left(self.sink, [])
        if left is None or self.batch_groups <= 0:
            return 0
        version = left[0]
        self._admission.resume(0, version)
        return version
