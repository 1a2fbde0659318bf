"""Weight-push interface: the trainer hands a snapshot of HF-named tensors to a `WeightSender`, which
delivers it in the background and returns a `PushHandle` the trainer checks before the next push.

Contract (every transport):
  * `push(version, named_tensors)` returns at once; the tensors must not be modified afterwards
    (the trainer passes a fresh CPU/GPU copy, so training continues while the push is in flight).
  * the handle completes when every engine has applied the weights as `version`, or fails with a
    `WeightPushError` that says which engine / address and what to check.
  * `PushHandle.result(timeout)` raises on failure or when the push is not done within the timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import torch


def align_nccl_env(env=None):
    """Give NCCL one cuMem setting in every process of ours (`env` defaults to os.environ); returns env.

    NCCL's cuMem allocator must be on or off in all processes of a communicator. torch leaves it on,
    SGLang's server turns it off unless NCCL_CUMEM_ENABLE is set: a trainer and a server with
    different settings form the weight-push group, and then the server's first receive fails with
    "Cuda failure 'invalid argument'" (seen on 2 GPUs). Called before the trainer's first NCCL
    communicator and on the environment every SGLang server is launched with; a value the user set
    is kept (and then holds on both sides).
    """
    env = os.environ if env is None else env
    env.setdefault("NCCL_CUMEM_ENABLE", "0")
    return env


class WeightPushError(RuntimeError):
    """A push failed or timed out; the trainer stops with this message."""


class PushHandle:
    """A push in flight. `result()` returns push statistics or raises WeightPushError."""

    def __init__(self, version: int, future: cf.Future, timeout_s: float, what: str):
        self.version = version
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.what = what
        self.started = time.monotonic()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> dict:
        """Wait at most `timeout` (default: until the push's own deadline) and return its stats."""
        left = max(0.0, self.deadline - time.monotonic()) if timeout is None else timeout
        try:
            return self.future.result(timeout=left)
        except cf.TimeoutError:
            raise WeightPushError(
                f"weight push of version {self.version} to {self.what} not applied within "
                f"{self.timeout_s:.1f}s (weights.timeout_s); check that the engines are alive and connected"
            ) from None
        except WeightPushError:
            raise
        except Exception as e:
            raise WeightPushError(f"weight push of version {self.version} to {self.what} failed: {e}") from e


class WeightSender(ABC):
    """Trainer side of a weight transport (used on trainer rank 0 only)."""

    @abstractmethod
    def push(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> PushHandle:
        """Start delivering a snapshot; returns immediately."""

    def catch_up(self) -> PushHandle | None:
        """Push the last weights again to the engines the last push left out (they were restarting),
        or None when none is behind. Transports that never leave one out have nothing to catch up."""
        return None

    def needs_push(self) -> list[str]:
        """Engines found running older weights than the last push with nothing kept to send them (one
        relaunched between two pushes): the trainer pushes its current weights again."""
        return []

    def close(self) -> None:  # noqa: B027 - optional
        pass


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of about `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    for group, _ in buckets_marking_last(named, bucket_bytes):
        yield group


class PackedBucket(list):
    """A bucket of (name, tensor). When packed (`flat` set), its tensors are views, back to back, of
    the byte tensor `flat`, which a transport that sends a bucket as one byte tensor sends as it is."""

    flat: torch.Tensor | None = None


def buckets_marking_last(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    pack_on: torch.device | None = None,
    expect_bytes: int | None = None,
) -> Iterator[tuple[PackedBucket, bool]]:
    """buckets(), each with whether it is the last. Found by looking one tensor ahead, not one bucket:
    a lazy source (weights.snapshot=direct) gathers each tensor when asked, and a bucket of lookahead
    would hold two buckets of gathered tensors at once.

    `pack_on` (a device): each tensor is copied into its bucket's byte buffer there as it comes, and
    let go. A lazy source's push then holds one buffer and the tensor ahead, where a bucket of gathered
    tensors and then their flat copy held two buckets (a 7B push ran out of memory so, beside the
    training state). The next bucket reuses the buffer: a bucket's views hold until the next is asked for.
    `expect_bytes` (about what the source holds in all, an upper bound) keeps the buffer that small when
    it is less than a bucket: a 135M model's push needs no 4 GB buffer."""
    it = iter(named)
    cur, size, buf = PackedBucket(), 0, None
    want = bucket_bytes if expect_bytes is None else max(1, min(bucket_bytes, expect_bytes))
    item = next(it, None)
    while item is not None:
        name, t = item
        item = None  # the source's tensor lives on as `t` only, until it is packed
        nb = t.numel() * t.element_size()
        # packed, a bucket also ends where its buffer does (smaller than a bucket by `expect_bytes`)
        limit = bucket_bytes if buf is None else min(bucket_bytes, buf.numel())
        if cur and size + nb > limit:
            yield _sealed(cur, buf, size), False
            cur, size = PackedBucket(), 0
        if pack_on is not None:
            if buf is None or nb > buf.numel():  # the first bucket, or (alone in its bucket) a larger tensor
                buf = None  # the old buffer goes before the new one comes
                buf = torch.empty(max(want, nb), dtype=torch.uint8, device=pack_on)
            t = pack_into(buf, size, name, t)
        cur.append((name, t))
        size += nb
        del t
        item = next(it, None)
    if cur:
        yield _sealed(cur, buf, size), True


def bucket_that_fits(bucket_bytes: int, free_bytes: int) -> int:
    """The bucket for a push packed beside a live model: at most half of the `free_bytes` its device
    has, the other half left for the gathered tensor ahead of the buffer. A larger tensor still gets a
    buffer its size (buckets_marking_last grows it), so a small cap slows a push but never fails it."""
    return max(1, min(bucket_bytes, free_bytes // 2))


def _sealed(bucket: PackedBucket, buf: torch.Tensor | None, size: int) -> PackedBucket:
    if buf is not None:
        bucket.flat = buf[:size]
    return bucket


def pack_into(buf: torch.Tensor, offset: int, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into buf at byte `offset`; the copy, as a view of buf with t's dtype and shape."""
    check_offset(name, t, offset)
    dest = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    dest.copy_(t, non_blocking=True)  # any strides: a transposed or strided view copies as it is
    return dest


def check_offset(name: str, t: torch.Tensor, offset: int) -> None:
    """A tensor laid at byte `offset` of a flat byte bucket is read back as a view of its dtype, which
    needs the offset to be a multiple of the element size: a bf16 tensor of odd size followed by an
    fp32 one would fail there (on an SGLang server: after a partial load)."""
    if offset % t.element_size():
        raise WeightPushError(
            f"weights: {name} ({t.dtype}) would start at byte {offset} of its bucket, not a multiple of "
            f"{t.element_size()}: push tensors of one dtype per bucket"
        )


def make_sender(
    cfg,
    *,
    engine_urls: list[str] | None = None,
    min_engines: int = 0,
    bind: str | None = None,
    engine_tp_sizes: list[int] | None = None,
    pause_mode: str = "in_place",
    master_address: str = "127.0.0.1",
    curve=None,
    restart_grace_s: float = 0.0,
):
    """WeightSender for `weights.transport` (cfg: WeightsConfig).

    cpu: a ZmqWeightSender bound at `bind or cfg.bind`; torch engines connect WeightReceivers to its
    `.address`, and each push waits (within timeout_s) until `min_engines` have connected.
    nccl / cuda_ipc: pushes straight into the SGLang servers at `engine_urls` (TP size per server in
    `engine_tp_sizes`, default 1; `pause_mode` as rollout.sglang.pause_mode; NCCL's rendezvous at
    `master_address`, this process's host as the servers reach it; `restart_grace_s`: how long a
    push may leave out a server that cannot be reached while it restarts). `curve`: the run's CurveKeys
    (buffer/curve.py) for the cpu transport's socket, None for none.
    auto: cpu without engine_urls, else nccl when this process sees 2+ GPUs and cuda_ipc otherwise;
    inside a Ray actor that was given one GPU this always says cuda_ipc, so GPU configs name the
    transport explicitly.
    """
    kind = cfg.transport
    if kind == "auto":
        kind = "cpu"
        if engine_urls:
            kind = "nccl" if torch.cuda.device_count() > 1 else "cuda_ipc"
    if kind == "cpu":
        import zmq

        if cfg.snapshot == "direct":  # before any process starts pushing: a clear error at start-up
            raise ValueError(
                "weights.snapshot=direct pushes from the trainer's GPUs into SGLang servers (weights.transport "
                "nccl or cuda_ipc); the cpu transport keeps each push for engines that join later: use "
                "weights.snapshot=auto"
            )

        from stages.weights.zmq_transport import ZmqWeightSender

        try:
            return ZmqWeightSender(
                bind or cfg.bind,
                bucket_mb=cfg.bucket_mb_for("cpu"),
                timeout_s=cfg.timeout_s,
                min_engines=min_engines,
                curve=curve,
            )
        except zmq.ZMQError as e:
            raise ValueError(
                f"weights.bind={bind or cfg.bind}: cannot bind ({e}); pick a free port, or port 0 for any"
            ) from None
    if kind in ("nccl", "cuda_ipc"):
        if not engine_urls:
            raise ValueError(f"weights.transport={kind} needs the SGLang server URLs (engine_urls)")
        from stages.weights import sglang_transport as sg

        common = dict(
            bucket_mb=cfg.bucket_mb_for(kind),
            timeout_s=cfg.timeout_s,
            engine_tp_sizes=engine_tp_sizes,
            pause_mode=pause_mode,
            restart_grace_s=restart_grace_s,
        )
        if kind == "nccl":
            return sg.NcclSGLangSender(
                engine_urls,
                master_address=master_address,
                receive=cfg.nccl_receive,
                **common,
            )
        return sg.CudaIpcSGLangSender(engine_urls, **common)
    raise ValueError(f"weights.transport={kind!r} has no sender yet (cpu, nccl, cuda_ipc)")
