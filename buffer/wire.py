"""The wire protocol between stages: message kinds, schema version, encode/decode, validation.

Every ZeroMQ message is a multipart message whose first frame is one msgpack-encoded `Msg` (tagged by
`kind`) and whose optional further frames are raw payloads: Arrow record batches, either as one Arrow
IPC stream or, when the header has a `layout`, as their raw buffers (see buffer/frames.py: large
buffers in frames of their own, sent and received without copying).
Each message carries `schema`; a peer speaking another schema, garbage bytes, wrong field types,
oversized frames and unknown kinds all become `ProtocolError` with a reason that names the problem —
servers answer those with `Error` and count them, they never crash on them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from buffer.record import Sample

# 2: large Arrow buffers may share one frame (buffer/frames.py); 3: routed_experts; 4: teacher_logprobs
SCHEMA_VERSION = 4
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a single frame above this is refused (raise `max_message_mb` to change)


class ProtocolError(ValueError):
    """A message that cannot be accepted; str(e) is the reason sent back to the peer.

    `category` is a short stable name for counting rejects (undecodable, schema_version, unknown_kind,
    invalid_fields, invalid_sample, oversized, frame_count, invalid_arrow, unexpected_kind, ...).
    """

    def __init__(self, reason: str, category: str = "invalid"):
        super().__init__(reason)
        self.category = category


class Msg(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=False):
    schema: int = SCHEMA_VERSION
    req: int = 0  # request id, echoed in the reply so a client can match replies to requests


# -- ingest: generator -> buffer ----------------------------------------------------------------------
class Ingest(Msg, tag="ingest"):
    """A batch of samples. Acked only after the buffer made them durable; resent until acked."""

    producer: str  # stable id of the sending generator
    seq: int  # producer-local sequence number; the ack echoes it
    samples: list[Sample]


class IngestBatch(Msg, tag="ingest_batch"):
    """Columnar ingest of one record batch in ARROW_SCHEMA: with `layout`, the frames after the header
    are its buffers (buffer/frames.py); without, frame 2 is one Arrow IPC stream holding it.

    The fast path (buffer.client sends this): samples are converted to Arrow by the producer, so the
    buffer validates and stores whole columns without touching each token. Acked like `Ingest`.
    """

    producer: str
    seq: int
    num_samples: int  # rows in the batch; must match the payload
    layout: list[list[int]] = []  # per batch: [num_rows, buffer sizes...] (buffer/frames.py)


class IngestAck(Msg, tag="ingest_ack"):
    seq: int
    accepted: int  # newly stored
    duplicates: int  # uid already present (or already consumed): dropped, still acked
    rejected: int  # invalid samples (see errors); acked so they are not resent forever
    trainer_version: int  # the trainer's current policy version, for generator admission control
    errors: list[str] = []


# -- fetch: trainer -> buffer -------------------------------------------------------------------------
class Fetch(Msg, tag="fetch"):
    """Ask for `num_groups` complete groups trainable at `version` within `max_staleness`."""

    consumer: str
    num_groups: int
    version: int  # the trainer's current policy version (also announces it)
    max_staleness: int  # serve only groups with version - min_token_version <= max_staleness
    timeout_s: float  # the server replies with FetchReply(num_groups=0) if not enough data by then
    # > 0: the requester resends this fetch at least this often while it waits; one not renewed for
    # lease_s is dropped unanswered, consuming nothing (its requester is gone). 0: no lease.
    lease_s: float = 0.0


class FetchReply(Msg, tag="fetch_reply"):
    """When num_samples > 0: with `layout`, the frames after the header are the buffers of one or more
    record batches (buffer/frames.py: zero-copy slices of stored batches); without, frame 2 is one
    Arrow IPC stream holding one record batch."""

    num_groups: int
    num_samples: int
    evicted_stale: int = 0  # samples evicted as too stale while serving this request
    waited_s: float = 0.0
    reason: str = ""  # why the reply is short (timeout, ...)
    layout: list[list[int]] = []  # per batch: [num_rows, buffer sizes...] (buffer/frames.py)


# -- control ------------------------------------------------------------------------------------------
class SetVersion(Msg, tag="set_version"):
    """The trainer announces its policy version (generators see it in acks)."""

    version: int


class StatsRequest(Msg, tag="stats"):
    pass


class StatsReply(Msg, tag="stats_reply"):
    stats: dict[str, Any]


class Peek(Msg, tag="peek"):
    """Inspection: up to `limit` live samples, NOT consumed; answered with FetchReply."""

    limit: int


class Ok(Msg, tag="ok"):
    pass


class Error(Msg, tag="error"):
    reason: str


AnyMsg = (
    Ingest
    | IngestBatch
    | IngestAck
    | Fetch
    | FetchReply
    | SetVersion
    | StatsRequest
    | StatsReply
    | Peek
    | Ok
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)
_peek = msgspec.msgpack.Decoder(dict[str, Any])


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> AnyMsg:
    """Decode and validate one header frame; raise ProtocolError with a reason on anything wrong."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            f"message of {len(frame)} bytes exceeds the limit of {max_bytes} bytes; "
            "send smaller batches or raise the server's max_message_mb",
            "oversized",
        )
    try:
        msg = _decoder.decode(frame)
    except msgspec.ValidationError as e:
        raise ProtocolError(*_explain(frame, e)) from None
    except (msgspec.DecodeError, UnicodeDecodeError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"not a slipstream message (undecodable msgpack: {e})", "undecodable") from None
    if msg.schema != SCHEMA_VERSION:
        raise ProtocolError(
            f"schema version {msg.schema} is not supported (this peer speaks {SCHEMA_VERSION}); "
            "run the same slipstream version on both ends",
            "schema_version",
        )
    check_request(msg)
    if isinstance(msg, Ingest):
        for s in msg.samples:
            try:
                s.validate()
            except ValueError as e:
                raise ProtocolError(
                    f"invalid sample in ingest seq {msg.seq}: {e}", "invalid_sample"
                ) from None
    return msg


# Bounds of the fields of control messages (check_request): a value outside is refused with a reason and
# counted in the server's rejects as "invalid_control", like a bad sample is as "invalid_sample".
MAX_VERSION = 2**62  # policy versions and staleness bounds
MAX_REQ = 2**63 - 1  # request ids and ingest sequence numbers
MAX_ID_CHARS = 256  # producer / consumer ids
MAX_FETCH_GROUPS = 1 << 20
MAX_WAIT_S = 86400.0  # fetch timeouts and leases
MAX_PEEK = 2**31 - 1  # inspection may ask for every live row
MAX_BATCH_SAMPLES = 1 << 24


def _id_problem(what: str, value: str) -> str:
    if not value:
        return f"{what} is empty; it names the peer (e.g. the trainer's consumer id)"
    if len(value) > MAX_ID_CHARS:
        return f"{what} has {len(value)} characters; at most {MAX_ID_CHARS}"
    if not value.isprintable():
        return f"{what} {value[:40]!r} holds control characters; use printable text"
    return ""


def _range_problem(what: str, value, lo, hi) -> str:
    if isinstance(value, float) and value != value or not lo <= value <= hi:
        return f"{what}={value!r} outside [{lo}, {hi}]"
    return ""


def check_request(msg: Msg) -> None:
    """Raise ProtocolError("invalid_control") if a request's control fields are out of range: versions in
    [0, MAX_VERSION], ids printable and non-empty, counts and waits bounded and finite. Replies are not
    checked (a client trusts its server)."""
    problems: list[str] = []
    if isinstance(msg, Ingest | IngestBatch | Fetch | SetVersion | StatsRequest | Peek):
        problems.append(_range_problem("req", msg.req, 0, MAX_REQ))
    if isinstance(msg, Ingest | IngestBatch):
        problems.append(_id_problem("producer", msg.producer))
        problems.append(_range_problem("seq", msg.seq, 0, MAX_REQ))
        if isinstance(msg, IngestBatch):
            problems.append(_range_problem("num_samples", msg.num_samples, 0, MAX_BATCH_SAMPLES))
    elif isinstance(msg, Fetch):
        problems.append(_id_problem("consumer", msg.consumer))
        problems.append(_range_problem("num_groups", msg.num_groups, 1, MAX_FETCH_GROUPS))
        problems.append(_range_problem("version", msg.version, 0, MAX_VERSION))
        problems.append(_range_problem("max_staleness", msg.max_staleness, 0, MAX_VERSION))
        problems.append(_range_problem("timeout_s", msg.timeout_s, 0.0, MAX_WAIT_S))
        problems.append(_range_problem("lease_s", msg.lease_s, 0.0, MAX_WAIT_S))
    elif isinstance(msg, SetVersion):
        problems.append(_range_problem("version", msg.version, 0, MAX_VERSION))
    elif isinstance(msg, Peek):
        problems.append(_range_problem("limit", msg.limit, 0, MAX_PEEK))
    problems = [p for p in problems if p]
    if problems:
        kind = msg.__struct_config__.tag
        raise ProtocolError(f"invalid {kind} message: {'; '.join(problems)}", "invalid_control")


def _explain(frame: bytes | memoryview, e: Exception) -> tuple[str, str]:
    """(reason, category): names the schema or kind problem before the field-level one."""
    try:
        head = _peek.decode(frame)
    except Exception:
        return f"invalid message: {e}", "invalid_fields"
    if head.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
        return (
            f"schema version {head.get('schema')!r} is not supported (this peer speaks {SCHEMA_VERSION}); "
            "run the same slipstream version on both ends",
            "schema_version",
        )
    kind = head.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        return f"unknown message kind {str(kind)[:60]!r}; expected one of {sorted(_KINDS)}", "unknown_kind"
    return f"invalid {kind} message: {e}", "invalid_fields"


_KINDS = {
    "ingest",
    "ingest_batch",
    "ingest_ack",
    "fetch",
    "fetch_reply",
    "set_version",
    "stats",
    "stats_reply",
    "peek",
    "ok",
    "error",
}
