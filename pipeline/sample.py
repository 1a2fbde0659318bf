"""The `Sample` record every stage agrees on, and its Arrow form.

A Sample is one completion of one prompt. Numeric per-token arrays travel as packed little-endian
buffers (`bytes`), never Python lists, so the buffer builds Arrow arrays by concatenating buffers and
the trainer reads them back as zero-copy numpy views.

Per-token arrays and their dtypes (all little-endian):
  prompt_ids        int32   one per prompt token
  response_ids      int32   one per response token
  rollout_logprobs  float32 one per response token: log p(token) under the *sampling* distribution
  versions          int32   one per response token: the policy version that produced that token
  loss_mask         uint8   one per response token: 1 = trained on, 0 = ignored (e.g. tool output)
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")

# name -> dtype of each packed per-token field; response-aligned ones must all have the same length.
PACKED_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": I32,
    "response_ids": I32,
    "rollout_logprobs": F32,
    "versions": I32,
    "loss_mask": U8,
}
RESPONSE_ALIGNED = ("response_ids", "rollout_logprobs", "versions", "loss_mask")


class Status(enum.StrEnum):
    COMPLETED = "completed"  # finished with a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cut off by the engine (e.g. shutdown); not trained on by default
    FAILED = "failed"  # reward or engine error; `error` says what


def pack(values: Any, dtype: np.dtype) -> bytes:
    """Pack a sequence / numpy array / tensor into little-endian bytes of `dtype`."""
    if hasattr(values, "detach"):  # torch tensor, without importing torch here
        values = values.detach().cpu().numpy()
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


class Sample(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One completion. `uid` is unique across the run: inserting the same uid twice is a no-op."""

    uid: str
    group_id: str
    group_index: int = 0  # position within its GRPO group
    group_size: int = 1  # how many samples the group has when complete
    prompt_ids: bytes = b""
    response_ids: bytes = b""
    rollout_logprobs: bytes = b""
    versions: bytes = b""
    loss_mask: bytes = b""
    reward: float = 0.0
    reward_parts: dict[str, float] = {}
    status: Status = Status.COMPLETED
    error: str = ""
    prompt: str = ""  # prompt text (after chat templating) for reward functions and inspection
    label: str = ""  # ground truth for verifiers
    metadata: dict[str, Any] = {}
    generator_id: str = ""
    created_at: float = 0.0  # unix seconds when generation of this sample started
    finished_at: float = 0.0  # unix seconds when the reward was assigned

    # -- numpy views (zero-copy; read-only) -------------------------------------------------------
    def array(self, name: str) -> np.ndarray:
        return np.frombuffer(getattr(self, name), dtype=PACKED_FIELDS[name])

    @property
    def response_len(self) -> int:
        return len(self.response_ids) // 4

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) // 4

    def min_version(self) -> int:
        """Oldest policy version among the response tokens (-1 if there are none)."""
        v = self.array("versions")
        return int(v.min()) if len(v) else -1

    def validate(self) -> None:
        """Raise ValueError naming the field when the record is internally inconsistent."""
        if not self.uid:
            raise ValueError("Sample.uid is empty: every sample needs a unique id")
        if not self.group_id:
            raise ValueError(f"Sample {self.uid}: group_id is empty")
        if not 0 <= self.group_index < self.group_size:
            raise ValueError(
                f"Sample {self.uid}: group_index {self.group_index} outside [0, group_size={self.group_size})"
            )
        for name, dt in PACKED_FIELDS.items():
            if len(getattr(self, name)) % dt.itemsize:
                raise ValueError(
                    f"Sample {self.uid}: {name} has {len(getattr(self, name))} bytes, "
                    f"not a multiple of {dt.itemsize} ({dt})"
                )
        n = self.response_len
        for name in RESPONSE_ALIGNED[1:]:
            m = len(getattr(self, name)) // PACKED_FIELDS[name].itemsize
            if m != n:
                raise ValueError(
                    f"Sample {self.uid}: {name} has {m} entries but response_ids has {n}; "
                    "every response token needs a logprob, a version and a mask entry"
                )

    @classmethod
    def build(cls, *, prompt_ids, response_ids, rollout_logprobs, versions, loss_mask=None, **kw) -> Sample:
        """Construct from arrays/lists (packing them); loss_mask defaults to all ones."""
        n = len(response_ids)
        if loss_mask is None:
            loss_mask = np.ones(n, dtype=U8)
        kw.setdefault("created_at", time.time())
        return cls(
            prompt_ids=pack(prompt_ids, I32),
            response_ids=pack(response_ids, I32),
            rollout_logprobs=pack(rollout_logprobs, F32),
            versions=pack(versions, I32),
            loss_mask=pack(loss_mask, U8),
            **kw,
        )


# ---------------------------------------------------------------------------------------------------
# Arrow form. One row per sample; per-token arrays are list<primitive> columns. Built from the packed
# buffers by concatenation (no per-element Python work).

ARROW_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("group_id", pa.string()),
        ("group_index", pa.int32()),
        ("group_size", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("reward", pa.float64()),
        ("reward_parts", pa.string()),  # JSON object
        ("status", pa.string()),
        ("error", pa.string()),
        ("prompt", pa.string()),
        ("label", pa.string()),
        ("metadata", pa.string()),  # JSON object
        ("generator_id", pa.string()),
        ("created_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("min_version", pa.int32()),  # derived: oldest response-token version (for staleness queries)
    ]
)
_ARROW_TYPES = {
    "prompt_ids": pa.int32(),
    "response_ids": pa.int32(),
    "rollout_logprobs": pa.float32(),
    "versions": pa.int32(),
    "loss_mask": pa.uint8(),
}
_json = msgspec.json.Encoder()
_unjson = msgspec.json.Decoder()


def _list_column(blobs: list[bytes], name: str) -> pa.Array:
    dt = PACKED_FIELDS[name]
    lengths = np.fromiter((len(b) // dt.itemsize for b in blobs), dtype=np.int32, count=len(blobs))
    offsets = np.zeros(len(blobs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.py_buffer(b"".join(blobs))
    flat = pa.Array.from_buffers(_ARROW_TYPES[name], int(offsets[-1]), [None, values])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat)


def samples_to_batch(samples: list[Sample]) -> pa.RecordBatch:
    """Samples -> one Arrow record batch with ARROW_SCHEMA (columnar: no per-token Python work)."""
    cols: dict[str, pa.Array] = {
        "uid": pa.array([s.uid for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "group_index": pa.array([s.group_index for s in samples], pa.int32()),
        "group_size": pa.array([s.group_size for s in samples], pa.int32()),
    }
    for name in PACKED_FIELDS:
        cols[name] = _list_column([getattr(s, name) for s in samples], name)
    cols["reward"] = pa.array([s.reward for s in samples], pa.float64())
    # empty dicts are the common case: skip the encoder for them
    cols["reward_parts"] = pa.array(
        [_json.encode(s.reward_parts).decode() if s.reward_parts else "{}" for s in samples], pa.string()
    )
    cols["status"] = pa.array([str(s.status) for s in samples], pa.string())
    for name in ("error", "prompt", "label"):
        cols[name] = pa.array([getattr(s, name) for s in samples], pa.string())
    cols["metadata"] = pa.array(
        [_json.encode(s.metadata).decode() if s.metadata else "{}" for s in samples], pa.string()
    )
    cols["generator_id"] = pa.array([s.generator_id for s in samples], pa.string())
    cols["created_at"] = pa.array([s.created_at for s in samples], pa.float64())
    cols["finished_at"] = pa.array([s.finished_at for s in samples], pa.float64())
    cols["min_version"] = pa.array(min_versions(cols["versions"]))
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=ARROW_SCHEMA)


def min_versions(versions: pa.ListArray | pa.ChunkedArray) -> np.ndarray:
    """Oldest response-token version per row (-1 for an empty response), from a `versions` column."""
    if isinstance(versions, pa.ChunkedArray):
        versions = versions.combine_chunks()
    offs = versions.offsets.to_numpy()
    vals = versions.values.to_numpy()
    out = np.full(len(versions), -1, dtype=np.int32)
    nonempty = np.flatnonzero(np.diff(offs) > 0)
    if len(nonempty):  # reduceat over the non-empty rows' starts: empty rows in between add no values
        out[nonempty] = np.minimum.reduceat(vals, offs[nonempty])
    return out


def list_values(batch: pa.RecordBatch | pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column as numpy, zero-copy where Arrow allows.

    Row i's tokens are values[offsets[i]:offsets[i+1]].
    """
    col = batch.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def batch_to_samples(batch: pa.RecordBatch | pa.Table) -> list[Sample]:
    """Arrow batch -> Samples (for inspection, replay and tests; the trainer reads columns directly)."""
    n = batch.num_rows
    packed = {}
    for name in PACKED_FIELDS:
        vals, offs = list_values(batch, name)
        raw = np.ascontiguousarray(vals, dtype=PACKED_FIELDS[name])
        packed[name] = [raw[offs[i] : offs[i + 1]].tobytes() for i in range(n)]
    scalar = {
        name: batch.column(name).to_pylist()
        for name in (
            "uid",
            "group_id",
            "group_index",
            "group_size",
            "reward",
            "reward_parts",
            "status",
            "error",
            "prompt",
            "label",
            "metadata",
            "generator_id",
            "created_at",
            "finished_at",
        )
    }
    out = []
    for i in range(n):
        out.append(
            Sample(
                uid=scalar["uid"][i],
                group_id=scalar["group_id"][i],
                group_index=scalar["group_index"][i],
                group_size=scalar["group_size"][i],
                reward=scalar["reward"][i],
                reward_parts=_unjson.decode(scalar["reward_parts"][i] or "{}"),
                status=Status(scalar["status"][i]),
                error=scalar["error"][i],
                prompt=scalar["prompt"][i],
                label=scalar["label"][i],
                metadata=_unjson.decode(scalar["metadata"][i] or "{}"),
                generator_id=scalar["generator_id"][i],
                created_at=scalar["created_at"][i],
                finished_at=scalar["finished_at"][i],
                **{name: packed[name][i] for name in PACKED_FIELDS},
            )
        )
    return out
