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
  teacher_logprobs  float32 on-policy distillation with a served teacher (optional, empty otherwise): one per
                            response token, log p(token) under the teacher (stages/rollout/teacher.py)
  routed_experts    int16   MoE routing replay (optional, empty otherwise): for each position the trainer
                            forwards (prompt + response tokens but the last, prompt_len + response_len - 1
                            rows), the experts the engine routed it to, layer-major: row r holds
                            [moe layer 0: k ids, moe layer 1: k ids, ...]. SGLang returns the same rows.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from buffer.scratch import ScratchPool
from buffer.values import routed_problem, value_problem

I32 = np.dtype("<i4")
I16 = np.dtype("<i2")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")

# name -> dtype of each packed per-token field; response-aligned ones must all have the same length.
PACKED_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": I32,
    "response_ids": I32,
    "rollout_logprobs": F32,
    "versions": I32,
    "loss_mask": U8,
    "routed_experts": I16,
    "teacher_logprobs": F32,
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
    routed_experts: bytes = b""  # MoE routing replay rows (see the module docstring); empty for dense models
    teacher_logprobs: bytes = b""  # a served teacher's logprob per response token; empty without one
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
        """Oldest policy version among the trained response tokens (-1 if there are none)."""
        v = self.array("versions")[self.array("loss_mask") > 0]
        return int(v.min()) if len(v) else -1

    def array_problem(self) -> str | None:
        """What is wrong with the packed arrays (a length that is not whole elements, or a per-token
        array not one entry per response token), naming the field; None when they are consistent."""
        for name, dt in PACKED_FIELDS.items():
            if len(getattr(self, name)) % dt.itemsize:
                return f"{name} has {len(getattr(self, name))} bytes, not a multiple of {dt.itemsize} ({dt})"
        n = self.response_len
        for name in RESPONSE_ALIGNED[1:]:
            m = len(getattr(self, name)) // PACKED_FIELDS[name].itemsize
            if m != n:
                return (
                    f"{name} has {m} entries but response_ids has {n}; every response token needs a "
                    "logprob, a version and a loss_mask entry (0 for tokens the environment added)"
                )
        taught = len(self.teacher_logprobs) // F32.itemsize
        if taught not in (0, n):
            return f"teacher_logprobs has {taught} entries but response_ids has {n}: one per response token, or none"
        return routed_problem(len(self.routed_experts) // I16.itemsize, self.prompt_len + n - 1)

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
        problem = self.array_problem()
        if problem:
            raise ValueError(f"Sample {self.uid}: {problem}")
        problem = value_problem(
            reward=np.asarray([self.reward], np.float64),
            group_size=np.asarray([self.group_size]),
            token_ids=np.concatenate([self.array("prompt_ids"), self.array("response_ids")]),
            logprobs=self.array("rollout_logprobs"),
            versions=self.array("versions"),
            loss_mask=self.array("loss_mask"),
            routed=self.array("routed_experts"),
            teacher=self.array("teacher_logprobs"),
            times={
                "created_at": np.asarray([self.created_at], np.float64),
                "finished_at": np.asarray([self.finished_at], np.float64),
            },
        )
        if problem:
            raise ValueError(f"Sample {self.uid}: {problem}")

    @classmethod
    def build(
        cls,
        *,
        prompt_ids,
        response_ids,
        rollout_logprobs,
        versions,
        loss_mask=None,
        routed_experts=None,
        **kw,
    ) -> Sample:
        """Construct from arrays/lists (packing them); loss_mask defaults to all ones, routed_experts
        (rows x moe_layers x top_k, any shape holding them in order) to none."""
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
            routed_experts=b"" if routed_experts is None else pack(routed_experts, I16),
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
        ("routed_experts", pa.list_(pa.int16())),
        ("teacher_logprobs", pa.list_(pa.float32())),
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
        ("min_version", pa.int32()),  # derived: oldest trained response-token version (staleness queries)
    ]
)
_ARROW_TYPES = {
    "prompt_ids": pa.int32(),
    "response_ids": pa.int32(),
    "rollout_logprobs": pa.float32(),
    "versions": pa.int32(),
    "loss_mask": pa.uint8(),
    "routed_experts": pa.int16(),
    "teacher_logprobs": pa.float32(),
}
# Schemas older code wrote (a buffer's segments on disk outlive an update): `upgrade_batch` reads them as
# ARROW_SCHEMA. Before routing replay a row had no routed_experts column, and before served teachers no
# teacher_logprobs column.
LEGACY_SCHEMAS = tuple(
    pa.schema([f for f in ARROW_SCHEMA if f.name not in missing])
    for missing in (("routed_experts", "teacher_logprobs"), ("teacher_logprobs",))
)


def is_legacy_schema(schema: pa.Schema) -> bool:
    return any(schema.equals(s) for s in LEGACY_SCHEMAS)


def upgrade_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch in ARROW_SCHEMA or one of LEGACY_SCHEMAS -> ARROW_SCHEMA (missing columns empty).
    Raises ValueError for any other schema."""
    if batch.schema.equals(ARROW_SCHEMA):
        return batch
    if not is_legacy_schema(batch.schema):
        raise ValueError("schema differs from buffer.record.ARROW_SCHEMA (and from every older one)")
    offsets = pa.array(np.zeros(batch.num_rows + 1, np.int32))

    def column(f: pa.Field) -> pa.Array:
        if f.name in batch.schema.names:
            return batch.column(f.name)
        return pa.ListArray.from_arrays(offsets, pa.array([], _ARROW_TYPES[f.name]))  # empty per row

    cols = [column(f) for f in ARROW_SCHEMA]
    return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)


_json = msgspec.json.Encoder()
_unjson = msgspec.json.Decoder()


_FIELD_POS = {name: i for i, name in enumerate(Sample.__struct_fields__)}
_VALUES_ALIGN = 64  # each column's values start on a 64-byte boundary of the shared allocation


SCRATCH = ScratchPool()


def _packed_columns(cols: list[tuple], uids: tuple) -> dict[str, pa.Array]:
    """The per-token list columns (PACKED_FIELDS) from the samples' packed buffers.

    One block from `SCRATCH` holds the values of all the columns (the pages of earlier batches,
    where fresh `bytes` would fault in new ones), and each sample's buffer is copied into it once;
    offsets come from the buffer lengths with numpy.
    """
    n = len(uids)
    lens, sizes = {}, {}
    for name, dt in PACKED_FIELDS.items():
        nb = np.fromiter(map(len, cols[_FIELD_POS[name]]), dtype=np.int64, count=n)
        if dt.itemsize > 1 and n:
            bad = np.flatnonzero(nb % dt.itemsize)
            if len(bad):
                i = int(bad[0])
                raise ValueError(
                    f"Sample {uids[i]}: {name} has {int(nb[i])} bytes, not a multiple of {dt.itemsize} ({dt})"
                )
        lens[name], sizes[name] = nb, int(nb.sum())
        if sizes[name] // dt.itemsize >= 2**31:
            raise ValueError(
                f"{name}: {sizes[name] // dt.itemsize} values in one batch overflow Arrow's 32-bit list "
                "offsets; convert fewer samples at a time"
            )
    total = sum(v + (-v % _VALUES_ALIGN) for v in sizes.values())
    mv, buf = SCRATCH.buffer(total)
    out: dict[str, pa.Array] = {}
    start = 0
    for name, dt in PACKED_FIELDS.items():
        nb = lens[name]
        pos = start
        for blob, end in zip(cols[_FIELD_POS[name]], (np.cumsum(nb) + start).tolist()):
            mv[pos:end] = blob
            pos = end
        pad = -sizes[name] % _VALUES_ALIGN
        mv[pos : pos + pad] = bytes(pad)  # no stale bytes between columns (they may go on the wire)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(nb // dt.itemsize, out=offsets[1:])
        values = pa.Array.from_buffers(
            _ARROW_TYPES[name], int(offsets[-1]), [None, buf.slice(start, sizes[name])]
        )
        out[name] = pa.Array.from_buffers(
            ARROW_SCHEMA.field(name).type, n, [None, pa.py_buffer(offsets)], children=[values]
        )
        start = pos + pad
    return out


def _strings(values: tuple) -> pa.Array:
    return pa.array(values, pa.string())


def _json_column(dicts: tuple) -> pa.Array:
    # empty dicts are the common case: skip the encoder for them
    return pa.array([_json.encode(d) if d else b"{}" for d in dicts], pa.string())


def samples_to_batch(samples: list[Sample]) -> pa.RecordBatch:
    """Samples -> one Arrow record batch with ARROW_SCHEMA (columnar: no per-token Python work).

    Fields are gathered in one pass (a tuple per sample, transposed); each packed buffer is copied
    once, into one pooled allocation (`_packed_columns`). Raises ValueError naming the sample when a
    packed buffer's length is not a multiple of its dtype's size.
    """
    fields = Sample.__struct_fields__
    cols = list(zip(*map(msgspec.structs.astuple, samples))) or [()] * len(fields)
    col = dict(zip(fields, cols))
    packed = _packed_columns(cols, col["uid"])
    try:
        status = _strings(col["status"])  # Status is a StrEnum: Arrow takes its members as strings
    except (pa.ArrowException, TypeError):
        status = _strings(tuple(str(s) for s in col["status"]))
    arrays = {
        "uid": _strings(col["uid"]),
        "group_id": _strings(col["group_id"]),
        "group_index": pa.array(col["group_index"], pa.int32()),
        "group_size": pa.array(col["group_size"], pa.int32()),
        **packed,
        "reward": pa.array(col["reward"], pa.float64()),
        "reward_parts": _json_column(col["reward_parts"]),
        "status": status,
        "error": _strings(col["error"]),
        "prompt": _strings(col["prompt"]),
        "label": _strings(col["label"]),
        "metadata": _json_column(col["metadata"]),
        "generator_id": _strings(col["generator_id"]),
        "created_at": pa.array(col["created_at"], pa.float64()),
        "finished_at": pa.array(col["finished_at"], pa.float64()),
        "min_version": pa.array(min_versions(packed["versions"], packed["loss_mask"])),
    }
    return pa.RecordBatch.from_arrays([arrays[f.name] for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def min_versions(
    versions: pa.ListArray | pa.ChunkedArray, loss_mask: pa.ListArray | pa.ChunkedArray
) -> np.ndarray:
    """Oldest version of a trained response token (loss_mask 1) per row, from the `versions` and
    `loss_mask` columns; -1 for a row with none. Untrained tokens (a tool's output, the recycled start of a
    partial rollout) are context, like the prompt: however old, they make no sample stale."""
    if isinstance(versions, pa.ChunkedArray):
        versions = versions.combine_chunks()
    if isinstance(loss_mask, pa.ChunkedArray):
        loss_mask = loss_mask.combine_chunks()
    offs, moffs = versions.offsets.to_numpy(), loss_mask.offsets.to_numpy()
    # `.values` of a slice is the whole child array: the last row must stop where the slice does
    vals = versions.values.to_numpy()[: offs[-1]].astype(np.int64)
    trained = np.ones(len(vals), dtype=bool)
    mask = loss_mask.values.to_numpy()[moffs[0] : moffs[-1]]
    if len(mask) == len(vals) - offs[0]:  # else misaligned: buffer.validate names that, not this
        trained[offs[0] :] = mask > 0
    vals = np.where(trained, vals, _UNTRAINED)
    out = np.full(len(versions), -1, dtype=np.int32)
    nonempty = np.flatnonzero(np.diff(offs) > 0)
    if len(nonempty):  # reduceat over the non-empty rows' starts: empty rows in between add no values
        mins = np.minimum.reduceat(vals, offs[nonempty])
        out[nonempty] = np.where(mins == _UNTRAINED, -1, mins)
    return out


_UNTRAINED = np.iinfo(np.int64).max  # min_versions: the version an untrained token counts as


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
