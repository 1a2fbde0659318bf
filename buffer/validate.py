"""Columnar checks of an incoming Arrow batch: the buffer's equivalent of `Sample.validate`.

Everything here works on whole columns (numpy over the Arrow buffers), so validating a batch of
thousands of long responses costs no per-token Python work. Problems raise `ProtocolError` naming
the column.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa

from buffer.record import ARROW_SCHEMA, RESPONSE_ALIGNED, Status, min_versions
from buffer.values import routed_problem, value_problem
from buffer.wire import ProtocolError

_STATUS_SET = frozenset(str(s) for s in Status)
_json_any = msgspec.json.Decoder(dict)


def read_ipc_batch(payload) -> pa.RecordBatch:
    """One Arrow IPC stream holding exactly one record batch in ARROW_SCHEMA (zero-copy)."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
        if not reader.schema.equals(ARROW_SCHEMA):
            raise ProtocolError(
                "Arrow payload schema differs from buffer.record.ARROW_SCHEMA; build batches with "
                "buffer.record.samples_to_batch and run the same slipstream version on both ends",
                "invalid_arrow",
            )
        batches = list(reader)
    except ProtocolError:
        raise
    except (pa.ArrowException, ValueError, OSError) as e:
        raise ProtocolError(
            f"payload is not a valid Arrow IPC stream: {str(e)[:200]}", "invalid_arrow"
        ) from None
    if len(batches) != 1:
        raise ProtocolError(
            f"Arrow payload holds {len(batches)} record batches; expected exactly 1", "invalid_arrow"
        )
    return batches[0]


def _raw_offsets(col: pa.Array) -> np.ndarray:
    """The offsets of a list or string array (null-free, validated), as a numpy view."""
    return np.frombuffer(col.buffers()[1], dtype="<i4", count=len(col) + 1, offset=col.offset * 4)


def _offsets(col: pa.Array) -> np.ndarray:
    offs = _raw_offsets(col)
    return offs - offs[0]


def recompute_min_version(batch: pa.RecordBatch) -> np.ndarray:
    """Oldest trained response-token version per row (-1 for none), from the versions and loss_mask."""
    return min_versions(batch.column("versions"), batch.column("loss_mask"))


def _nonempty(col: pa.Array) -> bool:
    """Every string of a (null-free) string column is non-empty: from its offsets, no decoding."""
    offs = _raw_offsets(col)
    return bool((offs[1:] > offs[:-1]).all())


def _values(col: pa.Array) -> np.ndarray:
    """The flat values of a list column (honouring slicing) as numpy, zero-copy where Arrow allows."""
    return col.flatten().to_numpy(zero_copy_only=False)


def _value_columns(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """The arrays buffer.values.value_problem checks, for all rows of `batch`."""
    return {
        "reward": batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64),
        "group_size": batch.column("group_size").to_numpy(),
        "token_ids": np.concatenate(
            [_values(batch.column("prompt_ids")), _values(batch.column("response_ids"))]
        ),
        "logprobs": _values(batch.column("rollout_logprobs")),
        "versions": _values(batch.column("versions")),
        "loss_mask": _values(batch.column("loss_mask")),
        "routed": _values(batch.column("routed_experts")),
        "teacher": _values(batch.column("teacher_logprobs")),
        "times": {
            "created_at": batch.column("created_at").to_numpy(zero_copy_only=False),
            "finished_at": batch.column("finished_at").to_numpy(zero_copy_only=False),
        },
    }


def _check_values(batch: pa.RecordBatch) -> None:
    """Value bounds (buffer.values.value_problem) over whole columns; on a violation, redo the check
    row by row to name the sample."""
    if not value_problem(**_value_columns(batch)):
        return
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        problem = value_problem(**_value_columns(row))
        if problem:
            raise ProtocolError(f"sample {row.column('uid')[0].as_py()}: {problem}", "invalid_sample")


def _check_routed_rows(batch: pa.RecordBatch) -> None:
    """routed_experts of each row: none, or whole rows for its prompt + response - 1 positions."""
    entries = np.diff(_offsets(batch.column("routed_experts")))
    if not entries.any():
        return
    positions = (
        np.diff(_offsets(batch.column("prompt_ids"))) + np.diff(_offsets(batch.column("response_ids"))) - 1
    )
    bad = (entries > 0) & ((positions <= 0) | (entries % np.maximum(positions, 1) != 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        problem = routed_problem(int(entries[i]), int(positions[i]))
        raise ProtocolError(f"sample {batch.column('uid')[i].as_py()}: {problem}", "invalid_sample")


def check_batch(batch: pa.RecordBatch) -> None:
    """Raise ProtocolError if any row of `batch` would not pass Sample.validate (and then some).

    Whole columns only, on their buffers (numpy): a batch costs a few dozen calls, not per-row work,
    except for the JSON columns, where each distinct text is decoded once.
    """
    if not batch.schema.equals(ARROW_SCHEMA):
        raise ProtocolError("batch schema differs from buffer.record.ARROW_SCHEMA", "invalid_sample")
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        raise ProtocolError(f"malformed Arrow batch: {str(e)[:200]}", "invalid_sample") from None
    for name, col in zip(batch.schema.names, batch.columns):
        if col.null_count:
            raise ProtocolError(
                f"column {name} has {col.null_count} nulls; every field must be set", "invalid_sample"
            )
    if batch.num_rows == 0:
        return
    if not _nonempty(batch.column("uid")):
        raise ProtocolError("a sample has an empty uid: every sample needs a unique id", "invalid_sample")
    if not _nonempty(batch.column("group_id")):
        raise ProtocolError("a sample has an empty group_id", "invalid_sample")
    _check_values(batch)
    gi = batch.column("group_index").to_numpy()
    gs = batch.column("group_size").to_numpy()
    if (gi < 0).any() or (gi >= gs).any():
        bad = int(np.flatnonzero((gi < 0) | (gi >= gs))[0])
        raise ProtocolError(
            f"sample {batch.column('uid')[bad].as_py()}: group_index {gi[bad]} outside [0, group_size={gs[bad]})",
            "invalid_sample",
        )
    ref = _offsets(batch.column("response_ids"))
    for name in RESPONSE_ALIGNED[1:]:
        if not (_offsets(batch.column(name)) == ref).all():
            raise ProtocolError(
                f"column {name} is not aligned with response_ids: every response token needs a "
                "logprob, a version and a mask entry",
                "invalid_sample",
            )
    taught = np.diff(_offsets(batch.column("teacher_logprobs")))
    bad = (taught > 0) & (taught != np.diff(ref))
    if bad.any():
        raise ProtocolError(
            f"sample {batch.column('uid')[int(np.flatnonzero(bad)[0])].as_py()}: teacher_logprobs is not "
            "aligned with response_ids: one per response token, or none",
            "invalid_sample",
        )
    _check_routed_rows(batch)
    if not set(batch.column("status").to_pylist()) <= _STATUS_SET:
        raise ProtocolError(
            f"unknown status value; expected one of {[str(s) for s in Status]}", "invalid_sample"
        )
    if not (batch.column("min_version").to_numpy() == recompute_min_version(batch)).all():
        raise ProtocolError(
            "column min_version does not match the versions column: it is each row's oldest version of a "
            "trained token (loss_mask 1), -1 for none (buffer.record.min_versions)",
            "invalid_sample",
        )
    for name in ("reward_parts", "metadata"):
        for text in set(batch.column(name).to_pylist()):  # rows often share their text ("{}")
            try:
                _json_any.decode(text)
            except msgspec.DecodeError:
                raise ProtocolError(
                    f"column {name} holds {text[:40]!r}, not a JSON object", "invalid_sample"
                ) from None
