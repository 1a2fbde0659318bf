"""A safetensors file written straight from host tensors' memory (an adapter push's folder, sglang_lora.py).

safetensors' own `save_file` copies every tensor to a `bytes` object (numpy's tobytes) and then copies
those into one buffer before the write: for an adapter push that is the whole push twice over on the
engine's host. Here the header is built from shapes and dtypes alone and the tensors' bytes go to the
file in one `os.writev` of views of their memory: the kernel's copy into the file is the only one.

The format (safetensors' README): an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}} padded with spaces
so that the data starts 8-byte aligned, then the tensors' raw bytes (little-endian, row-major) back to
back, offsets counted from the data's start. safetensors' reader checks the offsets cover the data
exactly, with no gap and no overlap.

Imports no torch at module level (sglang_lora.py is imported where torch is not).
"""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN = 8  # the data's start: a multiple of 8 bytes from the file's start, as safetensors writes it
IOV_MAX = 1024  # the most buffers one writev takes on Linux (UIO_MAXIOV); more fail with EINVAL


def _dtype_names() -> dict:
    import torch

    return {
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.float32: "F32",
        torch.float64: "F64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }


def _host_bytes(t: torch.Tensor):
    """`t`'s bytes as a flat uint8 numpy view of its memory (a copy only if it is not a contiguous host
    tensor already): bf16 has no numpy dtype, its bytes do."""
    import torch

    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and the padded JSON header of `tensors`, laid out in their order."""
    names = _dtype_names()
    entries: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
    end = 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise ValueError(f"safetensors_write: {name} is {t.dtype}, which this writer does not write")
        begin, end = end, end + t.numel() * t.element_size()
        entries[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [begin, end]}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to `path` as a safetensors file (what safetensors.torch.save_file writes, with
    the tensors in the dict's order). OSError as the write raises it."""
    views = [memoryview(header(tensors, metadata))]
    views += [memoryview(_host_bytes(t)) for t in tensors.values() if t.numel()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, views)
    finally:
        os.close(fd)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Every byte of `views` to `fd`: writev may write part of its buffers (a signal, a full pipe) and
    takes at most IOV_MAX of them a call, so go on from where it stopped."""
    i = 0
    while i < len(views):
        done = os.writev(fd, views[i : i + IOV_MAX])
        while done and i < len(views):
            if done >= len(views[i]):
                done -= len(views[i])
                i += 1
            else:
                views[i], done = views[i][done:], 0
