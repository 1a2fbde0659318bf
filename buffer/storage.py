"""The replay buffer itself (`Buffer`): Arrow record batches in memory, optionally backed by durable
segments, indexed by GRPO group, served by a policy. Single-threaded by design: the ZeroMQ server
and `InProcBuffer` serialize access to it.

Ingest is split in two so the server can apply back-pressure and group-commit:
  plan = buf.plan(batch)      dedup by uid, per-group checks; changes nothing
  buf.has_room(plan.n_new)    capacity check (the server parks the message if False)
  t = buf.commit(plan)        queue the batch for the segment writer thread, and index it
  buf.durable_ticket >= t     the writer fsynced it (group commit); ack after this. Or, blocking:
  buf.sync()                  wait until everything committed and logged so far is durable

Invariants: every uid ever accepted or named in the consumption log is in `_seen` (inserts are
idempotent, across restarts and for consumed uids); a live row belongs to exactly one live group;
`live_rows` counts live rows, which is what `capacity_samples` bounds.
"""

from __future__ import annotations

import collections
import itertools
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from buffer.config import BufferConfig
from buffer.policy import Policy, make_policy
from buffer.record import ARROW_SCHEMA, Sample, samples_to_batch
from buffer.segments import ConsumptionLog, LogRecord, SegmentWriter, recover_segments
from buffer.storage_records import FetchResult, Plan, _Group, _Runs
from buffer.validate import check_batch

_REPLAY_CONSUMERS = 1024  # consumers whose last served fetch a restarted buffer can answer again
_ANSWERED_MEMORY = 8192  # (consumer, req) of earlier served fetches a restarted buffer remembers


class Buffer:
    """See the module docstring. `directory` (with cfg.durable) makes it durable and recovers it."""

    def __init__(
        self, cfg: BufferConfig, directory: str | Path | None = None, *, policy: Policy | None = None
    ):
        if cfg.capacity_samples < 1:
            raise ValueError(
                f"buffer.capacity_samples={cfg.capacity_samples}: no ingest could ever be acked; set it >= 1"
            )
        self.cfg = cfg
        self.policy = policy or make_policy(cfg)
        self.directory = Path(directory) if directory else None
        self.durable = bool(cfg.durable and self.directory)
        self.version = 0
        # the trainer version of the last fetch served (-1: none). Equal to `version` while the trainer
        # trains on that batch: its groups left the buffer, but the version that consumed them is only
        # announced after the step (a healed generator counts them as taken: stages/rollout/position.py)
        self.served_version = -1
        self.live_rows = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.evicted_by_producer: collections.Counter[str] = collections.Counter()  # generator_id -> groups
        self._chunks: dict[int, pa.RecordBatch] = {}
        self._live_mask: dict[int, np.ndarray] = {}
        self._chunk_live: dict[int, int] = {}
        self._chunk_ticket: dict[int, int] = {}  # chunk -> its segment write ticket (durable mode)
        self._next_chunk = 0
        self._seen: set[str] = set()
        self._groups: dict[str, _Group] = {}  # every live group
        self._complete: dict[str, _Group] = {}  # complete live groups, in completion order
        self._writer: SegmentWriter | None = None
        self._log: ConsumptionLog | None = None
        self.recovery: dict = {}
        # what recovery found for exactly-once fetches (buffer/fetch_room.py takes them over):
        # consumer -> (req, rows, groups) of its last served fetch, and the (consumer, req) answered before
        self.recovered_replies: dict[str, tuple[int, list[pa.RecordBatch], int]] = {}
        self.recovered_answered: list[tuple[str, int]] = []
        if self.durable:
            self._recover()

    # -- ingest ------------------------------------------------------------------------------------
    def plan(self, batch: pa.RecordBatch, *, checked: bool = False) -> Plan:
        """Dedup and check `batch` against the current state without changing it."""
        if not checked:
            check_batch(batch)
        uids = batch.column("uid").to_pylist()
        runs = self._fresh_runs(batch, uids)
        if runs is not None:
            return Plan(batch, n_new=len(uids), runs=runs)
        gids = batch.column("group_id").to_pylist()
        sizes = batch.column("group_size").to_pylist()
        idxs = batch.column("group_index").to_pylist()
        keep = np.ones(len(uids), dtype=bool)
        plan = Plan(batch)
        local: set[str] = set()
        claimed: dict[str, tuple[int, set[int]]] = {}  # gid -> (size, indices) as of this batch
        for i, uid in enumerate(uids):
            if uid in self._seen or uid in local:
                keep[i] = False
                plan.duplicates += 1
                continue
            gid = gids[i]
            if gid not in claimed:
                g = self._groups.get(gid)
                claimed[gid] = (g.size, {r[0] for r in g.rows}) if g else (sizes[i], set())
            size, taken = claimed[gid]
            err = ""
            if sizes[i] != size:
                err = f"sample {uid}: group {gid} has group_size {size}, this sample says {sizes[i]}"
            elif idxs[i] in taken:
                err = f"sample {uid}: group {gid} already has a sample at group_index {idxs[i]}"
            if err:
                keep[i] = False
                plan.rejected += 1
                if len(plan.errors) < 8:
                    plan.errors.append(err)
                continue
            taken.add(idxs[i])
            local.add(uid)
        plan.n_new = int(keep.sum())
        if plan.n_new == 0:
            plan.batch = None
        elif plan.n_new < len(uids):
            plan.batch = batch.filter(pa.array(keep))
        return plan

    def _fresh_runs(self, batch: pa.RecordBatch, uids: list[str]) -> _Runs | None:
        """The fast path of `plan`: the batch's groups as runs of rows, if every uid is new and
        distinct, every group is new to the buffer and one run of rows, with one group_size and
        distinct group_index values (check_batch guarantees 0 <= group_index < group_size). Then every
        row is accepted, as the row-by-row path would decide; otherwise None (take that path)."""
        n = len(uids)
        if n == 0 or not self._seen.isdisjoint(uids):
            return None
        gids = batch.column("group_id").to_pylist()
        starts = [0, *[i for i in range(1, n) if gids[i] != gids[i - 1]]]
        heads = [gids[i] for i in starts]
        if len(set(heads)) != len(heads) or not self._groups.keys().isdisjoint(heads):
            return None
        if len(set(uids)) != n:
            return None
        sizes = batch.column("group_size").to_numpy()
        idxs = batch.column("group_index").to_numpy()
        run = np.repeat(np.arange(len(starts), dtype=np.int64), np.diff([*starts, n]))
        if not np.array_equal(sizes, sizes[starts][run]):
            return None
        keys = np.sort((run << 32) | idxs.astype(np.int64))
        if n > 1 and not np.all(keys[1:] != keys[:-1]):  # a group_index twice in one group
            return None
        return _Runs(uids, gids, idxs.tolist(), sizes.tolist(), starts)

    def has_room(self, n_new: int) -> bool:
        return self.live_rows + n_new <= self.cfg.capacity_samples

    def commit(self, plan: Plan) -> int:
        """Store the plan's rows; returns the write ticket to wait for before acking (see
        `durable_ticket`): the latest one, since a duplicate may be of rows still being written."""
        self.counters["duplicates"] += plan.duplicates
        self.counters["rejected_samples"] += plan.rejected
        if plan.batch is not None:
            ticket = self._writer.append(plan.batch) if self._writer is not None else 0
            if plan.runs is not None:
                self._add_runs(plan.batch, plan.runs)
            else:
                self._add_chunk(plan.batch, None)
            if ticket and self._next_chunk - 1 in self._chunks:
                self._chunk_ticket[self._next_chunk - 1] = ticket
            self.counters["accepted"] += plan.n_new
        return self._writer.appended if self._writer is not None else 0

    @property
    def durable_ticket(self) -> int:
        """Every commit whose ticket is <= this is fsynced (memory mode: everything)."""
        return self._writer.durable if self._writer is not None else 1 << 62

    @property
    def write_error(self) -> BaseException | None:
        """Why the segment writer stopped (then nothing committed after it becomes durable)."""
        return self._writer.error if self._writer is not None else None

    def on_durable(self, callback) -> None:
        """Call `callback()` from the writer thread whenever `durable_ticket` advances or writing fails."""
        if self._writer is not None:
            self._writer.on_durable = callback

    def sync(self) -> None:
        """Make every commit and log record so far durable (no-op in memory mode)."""
        if self._writer is not None:
            self._writer.sync()
        self.sync_log()

    def sync_log(self) -> None:
        """Make the consumption log durable (what was served, evicted, the version)."""
        if self._log is not None:
            self._log.sync()

    def insert(self, samples: list[Sample] | pa.RecordBatch) -> Plan:
        """plan + commit + sync in one call, ignoring capacity (for tools, tests and replays)."""
        batch = samples if isinstance(samples, pa.RecordBatch) else samples_to_batch(samples)
        plan = self.plan(batch)
        self.commit(plan)
        self.sync()
        return plan

    def _add_runs(self, batch: pa.RecordBatch, runs: _Runs) -> None:
        """`_add_chunk` for a batch of whole new groups (see `_Runs`): one step per group."""
        cid = self._next_chunk
        self._next_chunk += 1
        n = batch.num_rows
        self._chunks[cid], self._live_mask[cid], self._chunk_live[cid] = batch, np.ones(n, bool), n
        self.live_rows += n
        minv = batch.column("min_version").to_numpy()
        none = np.iinfo(np.int32).max  # rows without tokens (-1) take no part in a group's minimum
        lows = np.minimum.reduceat(np.where(minv >= 0, minv, none), runs.starts).tolist()
        uids, gids, idxs, sizes = runs.uids, runs.gids, runs.idxs, runs.sizes
        ends = [*runs.starts[1:], n]
        for s, e, low in zip(runs.starts, ends, lows):
            gid = gids[s]
            g = self._groups[gid] = _Group(
                gid,
                sizes[s],
                None if low == none else low,
                0,
                list(zip(idxs[s:e], itertools.repeat(cid, e - s), range(s, e))),
                uids[s:e],
            )
            if e - s == g.size:
                self._complete[gid] = g
        self._seen.update(uids)

    def _add_chunk(self, batch: pa.RecordBatch, live: np.ndarray | None) -> None:
        """Index `batch` (rows where `live`, default all) into groups."""
        cid = self._next_chunk
        self._next_chunk += 1
        mask = np.ones(batch.num_rows, dtype=bool) if live is None else live.copy()
        n = int(mask.sum())
        if n == 0:
            return
        self._chunks[cid], self._live_mask[cid], self._chunk_live[cid] = batch, mask, n
        self.live_rows += n
        uids = batch.column("uid").to_pylist()
        gids = batch.column("group_id").to_pylist()
        sizes = batch.column("group_size").to_pylist()
        idxs = batch.column("group_index").to_pylist()
        minv = batch.column("min_version").to_pylist()
        for row in np.flatnonzero(mask).tolist():
            gid = gids[row]
            g = self._groups.get(gid)
            if g is None:
                g = self._groups[gid] = _Group(gid, sizes[row])
            g.rows.append((idxs[row], cid, row))
            g.uids.append(uids[row])
            if minv[row] >= 0 and (g.min_version is None or minv[row] < g.min_version):
                g.min_version = minv[row]
            if len(g.rows) == g.size:
                self._complete[gid] = g
        self._seen.update(uids)

    # -- serving -----------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        if version < self.version:
            # The trainer went back: a re-run in this directory resumed from a checkpoint older than the
            # version the buffer last heard. Rows newer than it were made by weights that no longer
            # exist; they would train at negative staleness. Evicted, and counted apart.
            future = [g for g in self._groups.values() if g.staleness(version) < 0]
            self.counters["evicted_future"] += self._evict(future, version)
        if version != self.version:
            self.version = version
            if self._log is not None:
                self._log.append("version", version, [])  # durable with the next sync

    def fetch(
        self, num_groups: int, version: int, max_staleness: int, *, consumer: str = "", req: int = 0
    ) -> FetchResult:
        """Serve `num_groups` complete groups trainable at `version`, or batch=None if there are fewer.

        The served rows are logged, with the (consumer, req) of the fetch they answer, and fsynced
        before this returns (so they are never served to another fetch after a crash, and a resend of
        this one gets them again: see `recovered_replies`); their segment writes are durable too (so
        recovery can find them). Evicted ones are counted in `evicted`.
        """
        self.set_version(version)
        evicted = self.evict_stale(version, max_staleness) if self.policy.enforces_staleness else 0
        # rows newer than the trainer can still arrive after it went back (engines keep the old weights
        # until its first push lands): never served at negative staleness
        future = [g for g in self._complete.values() if g.staleness(version) < 0]
        if future and self.policy.enforces_staleness:
            n = self._evict(future, version)
            self.counters["evicted_future"] += n
            evicted += n
        if len(self._complete) < num_groups:
            self.sync_log()
            return FetchResult(None, 0, evicted)
        chosen = self.policy.select(self._complete.values(), num_groups)
        pieces = self._gather(chosen)
        if self._writer is not None:
            # the rows must be on disk before the log says they answered this fetch: after a crash the
            # resend of the fetch is answered with them, read back from the segments
            need = max((self._chunk_ticket.get(cid, 0) for g in chosen for _, cid, _ in g.rows), default=0)
            if need > self._writer.durable:
                self.counters["fetch_waited_for_segment"] += 1
                self._writer.sync()
        uids = [u for p in pieces for u in p.column("uid").to_pylist()]  # in the reply's order
        for g in chosen:
            g.times_sampled += 1
            if g.times_sampled >= self.policy.max_times_sampled:
                self._retire(g)
        self.counters["served_samples"] += len(uids)
        self.counters["served_groups"] += len(chosen)
        self.served_version = version
        if self._log is not None:
            self._log.append("served", version, uids, consumer, req)
        self.sync_log()
        return FetchResult(pieces, len(chosen), evicted)

    def ready_groups(self) -> int:
        return len(self._complete)

    def evict_stale(self, version: int, max_staleness: int) -> int:
        """Evict every group too stale to be trained at `version` (staleness only grows, so these can
        never be served). Returns the number of samples evicted."""
        pool = self._groups if self.policy.evicts_incomplete else self._complete
        return self._evict([g for g in pool.values() if g.staleness(version) > max_staleness], version)

    def _evict(self, stale: list, version: int) -> int:
        if not stale:
            return 0
        uids = [u for g in stale for u in g.uids]
        for g in stale:
            if g.rows:  # whose group: generators take evicted groups out of their admission count
                _, cid, row = g.rows[0]
                self.evicted_by_producer[self._chunks[cid].column("generator_id")[row].as_py()] += 1
            self._retire(g)
        self.counters["evicted_stale"] += len(uids)
        self.counters["evicted_groups"] += len(stale)
        if self._log is not None:
            self._log.append("evicted", version, uids)
        return len(uids)

    def peek(self, limit: int) -> pa.RecordBatch | None:
        """Up to `limit` live rows (oldest chunks first), without consuming them."""
        pieces, n = [], 0
        for cid, batch in self._chunks.items():
            rows = np.flatnonzero(self._live_mask[cid])[: limit - n]
            if len(rows):
                pieces.append(batch.take(pa.array(rows)))
                n += len(rows)
            if n >= limit:
                break
        return pa.concat_batches(pieces) if pieces else None

    def _gather(self, groups: list[_Group]) -> list[pa.RecordBatch]:
        """Rows of `groups` (group by group, by group_index) as zero-copy slices of stored batches, one
        per contiguous run of a chunk: nothing is copied here."""
        pieces: list[pa.RecordBatch] = []
        run_cid, run_start, run_end = -1, 0, 0
        for g in groups:
            for _, cid, row in sorted(g.rows):
                if cid == run_cid and row == run_end:
                    run_end += 1
                    continue
                if run_cid >= 0:
                    pieces.append(self._chunks[run_cid].slice(run_start, run_end - run_start))
                run_cid, run_start, run_end = cid, row, row + 1
        pieces.append(self._chunks[run_cid].slice(run_start, run_end - run_start))
        return pieces

    def _retire(self, g: _Group) -> None:
        self._groups.pop(g.gid, None)
        self._complete.pop(g.gid, None)
        for _, cid, row in g.rows:
            self._live_mask[cid][row] = False
            self._chunk_live[cid] -= 1
            if self._chunk_live[cid] == 0:  # free the memory of fully consumed batches
                del self._chunks[cid], self._live_mask[cid], self._chunk_live[cid]
                self._chunk_ticket.pop(cid, None)
        self.live_rows -= len(g.rows)

    # -- durability --------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild state from the segments and the consumption log (see buffer.segments)."""
        t0 = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        rec = recover_segments(self.directory)
        self._log = ConsumptionLog(self.directory / "consumed.log")
        served: collections.Counter[str] = collections.Counter()
        gone: set[str] = set()
        last: dict[str, LogRecord] = {}  # consumer -> its last served record (the fetch a resend repeats)
        answered: list[tuple[str, int]] = []
        for r in self._log.records:
            if r.op == "served":
                served.update(r.uids)
                self.served_version = r.v
                if r.consumer:
                    if r.consumer in last:
                        answered.append((r.consumer, last[r.consumer].req))
                    last.pop(r.consumer, None)  # re-inserted last: the dict stays in serving order
                    last[r.consumer] = r
            elif r.op == "evicted":
                gone.update(r.uids)
            self.version = max(self.version, r.v)
        limit = self.policy.max_times_sampled
        evicted_groups: dict[str, str] = {}  # group id -> producer, for the live stats below
        last = dict(list(last.items())[-_REPLAY_CONSUMERS:])
        wanted = {u for r in last.values() for u in r.uids}
        found: dict[str, pa.RecordBatch] = {}  # uid -> its row, for the replies of `last`
        for _, batch in rec.batches:
            uids = batch.column("uid").to_pylist()
            if wanted and not wanted.isdisjoint(uids):
                for k, u in enumerate(uids):
                    if u in wanted:
                        found[u] = batch.slice(k, 1)
            live = np.fromiter((u not in gone and served[u] < limit for u in uids), bool, len(uids))
            self._add_chunk(batch, live)
            self._seen.update(uids)
            for k in np.flatnonzero([u in gone for u in uids]) if gone else ():
                evicted_groups.setdefault(
                    batch.column("group_id")[k].as_py(), batch.column("generator_id")[k].as_py()
                )
        # the live stats continue where the last run left them (they were zero after every restart, while
        # the directory's log counted the evictions)
        self.counters["accepted"] += sum(b.num_rows for _, b in rec.batches)
        self.counters["evicted_stale"] += len(gone)
        self.counters["evicted_groups"] += len(evicted_groups)
        self.evicted_by_producer.update(collections.Counter(evicted_groups.values()))
        self._seen.update(served)
        self._seen.update(gone)
        for g in self._groups.values():
            g.times_sampled = max(served[u] for u in g.uids)
        missing = 0
        for consumer, r in last.items():
            rows = [found[u] for u in r.uids if u in found]
            missing += len(r.uids) - len(rows)
            groups = len({b.column("group_id")[0].as_py() for b in rows})
            self.recovered_replies[consumer] = (r.req, [pa.concat_batches(rows)] if rows else [], groups)
        self.recovered_answered = answered[-_ANSWERED_MEMORY:]
        self._writer = SegmentWriter(self.directory, rec.next_index, self.cfg.segment_max_mb << 20)
        torn = [vars(r) for r in rec.reports if r.problem]
        self.recovery = {
            "segments": len(rec.reports),
            "rows": sum(r.rows for r in rec.reports),
            "live_rows": self.live_rows,
            "consumed_uids": len(served) + len(gone),
            "log_torn_bytes": self._log.torn_bytes,
            "replayable_fetches": len(self.recovered_replies),
            "replay_rows_missing": missing,  # served rows of those fetches not found in any segment
            "torn_segments": torn,
            "seconds": round(time.perf_counter() - t0, 3),
        }

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._log is not None:
            self._log.close()
        self._writer = self._log = None

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "rows": self.live_rows,
            "groups": len(self._groups),
            "complete_groups": len(self._complete),
            "capacity_samples": self.cfg.capacity_samples,
            "version": self.version,
            "served_version": self.served_version,
            "policy": self.policy.name,
            "durable": self.durable,
            "seen_uids": len(self._seen),
            "segment_bytes": self._writer.bytes_written if self._writer else 0,
            "segment_fsyncs": self._writer.fsyncs if self._writer else 0,
            **{k: v for k, v in sorted(self.counters.items())},
            "recovery": self.recovery,
            "evicted_groups_by_producer": dict(self.evicted_by_producer),
        }

    def live_table(self) -> pa.Table:
        """Every live row, for inspection (copies)."""
        parts = [b.filter(pa.array(self._live_mask[c])) for c, b in self._chunks.items()]
        return pa.Table.from_batches(parts, schema=ARROW_SCHEMA)
