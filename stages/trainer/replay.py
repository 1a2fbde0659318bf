"""Train on a recorded buffer directory with no generator: a finite BatchSource over Arrow IPC files.

Reads every `*.arrow` file in the directory in name order (the buffer writes `seg-NNNNNN.arrow`
Arrow IPC *stream* files; IPC *file* format is read too), drops duplicate uids (the buffer's ingest is
idempotent, so a resent sample may appear twice across segments), keeps only complete groups
(`group_size` rows present) in order of first appearance, and hands them out once each. A torn tail
(a crash mid-write) ends that file's batches; everything before it is used.
"""

from __future__ import annotations

import glob
import logging
import os

import pyarrow as pa

from buffer.record import upgrade_batch
from stages.trainer.feed import SourceExhausted

log = logging.getLogger(__name__)


def read_arrow(path: str) -> list[pa.RecordBatch]:
    out: list[pa.RecordBatch] = []
    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            reader = opener(pa.memory_map(path))
        except (pa.ArrowInvalid, OSError):
            continue
        if isinstance(reader, pa.ipc.RecordBatchFileReader):  # older recordings read as today's schema
            return [upgrade_batch(reader.get_batch(i)) for i in range(reader.num_record_batches)]
        try:
            for batch in reader:
                out.append(upgrade_batch(batch))
        except (pa.ArrowInvalid, OSError) as e:
            log.warning("%s: torn tail after %d batches (%s); using the intact part", path, len(out), e)
        return out
    raise ValueError(f"{path} is neither an Arrow IPC stream nor an Arrow IPC file")


class ReplaySource:
    """BatchSource over a recorded buffer directory. `fetch` raises SourceExhausted at the end
    (or returns fewer groups than asked only for the final partial batch when `drop_last=False`)."""

    def __init__(self, directory: str, *, drop_last: bool = True):
        files = sorted(glob.glob(os.path.join(directory, "*.arrow")))
        if not files:
            raise FileNotFoundError(f"{directory} has no *.arrow files; point --replay at a buffer directory")
        self.address = f"replay:{directory}"
        batches = [b for f in files for b in read_arrow(f) if b.num_rows]
        if not batches:
            raise ValueError(f"{directory}: the .arrow files hold no samples")
        table = pa.Table.from_batches(batches).combine_chunks()
        self.groups = _complete_groups(table)
        self.table = table
        self.pos = 0
        self.drop_last = drop_last
        self.version = 0
        log.info("replay %s: %d rows, %d complete groups", directory, table.num_rows, len(self.groups))

    def fetch(self, num_groups, version, max_staleness, timeout_s):
        left = len(self.groups) - self.pos
        if left <= 0 or (self.drop_last and left < num_groups):
            raise SourceExhausted(f"{self.address}: all {len(self.groups)} complete groups used")
        rows = [i for g in self.groups[self.pos : self.pos + num_groups] for i in g]
        self.pos += min(num_groups, left)
        return self.table.take(pa.array(rows)).to_batches()[0]

    def set_version(self, version):
        self.version = version

    def stats(self):
        return {"groups": len(self.groups), "served_groups": self.pos, "rows": self.table.num_rows}


def _complete_groups(table: pa.Table) -> list[list[int]]:
    uids = table.column("uid").to_pylist()
    gids = table.column("group_id").to_pylist()
    sizes = table.column("group_size").to_pylist()
    seen: set[str] = set()
    groups: dict[str, list[int]] = {}
    for i, (u, g) in enumerate(zip(uids, gids)):
        if u in seen:
            continue
        seen.add(u)
        groups.setdefault(g, []).append(i)
    return [rows for rows in groups.values() if len(rows) == sizes[rows[0]]]
