"""The rows of a dataset file, JSON lines (.jsonl, or .json with one object per line) or Parquet, each
named by where it stands in the file: what the rollout's prompt data (stages/rollout/data.py) and the
trainer's SFT conversations (stages/trainer/sft.py) both read. Each reader checks the rows itself and
decides whether a bad line fails the run or is skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROW_FORMATS = (".jsonl", ".json", ".parquet")


def file_rows(path: Path) -> Iterator[tuple[str, Any, json.JSONDecodeError | None]]:
    """(where, row, error) of each non-blank line of a JSON-lines file, or each row of a Parquet one:
    `where` is "path:line" or "path: row i"; a line that is not JSON comes as (where, None, its error).
    The suffix must be one of ROW_FORMATS (callers check it first, to name their own key)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}: row {i}", row, None
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line), None
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", None, e
