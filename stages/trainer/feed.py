"""The trainer's batch feed: rank 0 fetches complete groups from its BatchSource (a buffer client, an
in-process buffer, a replay directory) and every rank gets the batch, or rank 0's error.

While it waits for data it keeps the engines fed too: with a weight sender the wait is cut into
slices, and between them the publisher may push the last weights again to an engine left behind, or
(after an empty slice) find one relaunched since the last push, which needs the current weights before
it can make data at all. That push is collective, so what rank 0 found is broadcast as a Delivery.
"""

from __future__ import annotations

import enum
import io
import logging
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from stages.trainer.config import TrainerConfig, TrainerRun
from stages.weights.publisher import CatchUp, WeightPublisher

log = logging.getLogger(__name__)
# with a weight sender, the trainer's wait for data is cut into slices of this many seconds, and
# between them the last weights go to it again (BatchFeed._fetch_catching_up)
CATCH_UP_EVERY_S = 10.0


class SourceExhausted(Exception):
    """A finite source (a replay directory) has no more complete groups: the run ends normally."""


class Got(enum.Enum):
    """What rank 0's fetch came to, for every rank."""

    BATCH = "batch"  # data: the batch (Arrow IPC bytes when other ranks need it)
    TIMEOUT = "timeout"  # nothing within trainer.fetch_timeout_s
    PUSH_AGAIN = "push_again"  # an engine needs the current weights before data can come
    EXHAUSTED = "exhausted"  # a finite source has no more
    ERROR = "error"  # data: rank 0's error, as text


@dataclass(frozen=True)
class Delivery:
    got: Got
    data: Any = None


class BatchFeed:
    """Fetch one batch per step, on every rank (collective). `source` is needed on rank 0 only."""

    def __init__(
        self,
        source: Any,
        tc: TrainerConfig,
        run: TrainerRun,
        publisher: WeightPublisher,
        *,
        rank: int,
        device: torch.device,
    ):
        self.source, self.tc, self.run, self.publisher = source, tc, run, publisher
        self.rank, self.device = rank, device

    def set_version(self, version: int) -> None:
        """Announce the policy version to the source (rank 0): staleness is counted from it."""
        if self.rank == 0:
            self.source.set_version(version)

    def fetch(self, version: int) -> pa.RecordBatch:
        """Rank 0 fetches within trainer.fetch_timeout_s; every rank gets the batch (broadcast), or rank
        0's error (the other ranks would otherwise wait in the broadcast). An engine found running older
        weights than the last push (relaunched since) gets the current weights first: every rank takes
        part in that snapshot, then the wait goes on."""
        shared = dist.get_world_size() > 1  # other ranks need the batch: send it as Arrow IPC bytes
        deadline = time.monotonic() + self.tc.fetch_timeout_s
        while True:
            payload: list[Delivery | None] = [None]  # broadcast_object_list's form: a list, filled in place
            failure = None
            if self.rank == 0:
                try:
                    got = self._fetch_catching_up(deadline, version)
                    if got.got is Got.BATCH and shared:
                        got = Delivery(Got.BATCH, _to_ipc(got.data))
                    payload[0] = got
                except SourceExhausted:
                    payload[0] = Delivery(Got.EXHAUSTED)
                except Exception as e:
                    if not shared:
                        raise
                    payload[0], failure = Delivery(Got.ERROR, f"{type(e).__name__}: {e}"), e
            if shared:
                dist.broadcast_object_list(
                    payload, src=0, device=self.device if self.device.type == "cuda" else None
                )
            got = payload[0]
            if got.got is Got.PUSH_AGAIN:
                self.publisher.push(version)
                continue
            if got.got is Got.ERROR:
                if failure is not None:
                    raise failure
                raise RuntimeError(f"trainer rank 0 failed while fetching a batch: {got.data}")
            if got.got is Got.EXHAUSTED:
                raise SourceExhausted("the replay source has no more complete groups")
            if got.got is Got.TIMEOUT:
                raise TimeoutError(self.timeout_message(version))
            return pa.ipc.open_stream(got.data).read_next_batch() if shared else got.data

    def _fetch_catching_up(self, deadline: float, version: int) -> Delivery:
        """source.fetch until `deadline` (Got.TIMEOUT then), or Got.PUSH_AGAIN when an engine needs the
        current weights. With a weight sender the wait is cut into CATCH_UP_EVERY_S slices: before each
        the publisher may push the last weights again to an engine it left out while it restarted
        (catch_up), and after a slice that came back empty it is asked for an engine relaunched since
        the last push (not before, so a step with data waiting pays nothing for it). With one engine no
        fresh batch can come before the relaunched server has the current weights."""
        tc, staleness = self.tc, self.run.max_staleness
        waited = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            if self.publisher.sender is None:
                return _delivered(self.source.fetch(tc.batch_groups, version, staleness, left))
            idle = self.publisher.catch_up() is CatchUp.IDLE
            if waited and idle:
                stale = self.publisher.stale_engines()
                if stale:
                    log.warning(
                        "trainer at version %d: %s run older weights (relaunched since the last push) or "
                        "partly loaded ones (another server died mid-push): pushing them the current ones",
                        version,
                        stale,
                    )
                    return Delivery(Got.PUSH_AGAIN)
            wait = min(left, CATCH_UP_EVERY_S)
            t0 = time.monotonic()
            batch = self.source.fetch(tc.batch_groups, version, staleness, wait)
            # a source answers None only at its timeout, or at once when it has no more (a replay)
            if batch is not None or time.monotonic() >= deadline or time.monotonic() - t0 < 0.5 * wait:
                return _delivered(batch)
            waited = True

    def timeout_message(self, version: int) -> str:
        where = getattr(self.source, "address", None) or type(self.source).__name__
        try:
            stats = self.source.stats() if self.rank == 0 else {}
        except Exception as e:  # noqa: BLE001 - only used to enrich the message
            stats = {"stats unavailable": str(e)}
        return (
            f"trainer at version {version}: no {self.tc.batch_groups} complete groups from the buffer at "
            f"{where} within trainer.fetch_timeout_s={self.tc.fetch_timeout_s:g}s. Check that the buffer is "
            f"running at that address, that generators are connected and producing, and that "
            f"run.max_staleness={self.run.max_staleness} is not dropping everything. Buffer stats: {stats}"
        )


def _delivered(batch: pa.RecordBatch | None) -> Delivery:
    return Delivery(Got.TIMEOUT) if batch is None else Delivery(Got.BATCH, batch)


def _to_ipc(batch: pa.RecordBatch | pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write(batch)
    return sink.getvalue()
