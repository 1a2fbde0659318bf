"""Bucketing of a weight push: tensors grouped into buckets of about a size, optionally packed back to
back into one byte buffer (the layout SGLang's flattened_bucket load reads), with the checks that layout
needs. Shared by every transport."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from stages.weights.base import WeightPushError


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


def check_flat_layout(group) -> None:
    """SGLang's FlattenedTensorBucket lays tensors back to back as bytes and the server views each
    slice as its dtype (see check_offset): checked before anything is sent."""
    offset = 0
    for name, x in group:
        check_offset(name, x, offset)
        offset += x.numel() * x.element_size()
