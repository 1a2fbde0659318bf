"""The torch engine's running batch: its rows' HF KV cache (across transformers 4.x and 5.x layouts), and
two batches merged into one (continuous batching: requests that arrive join the running batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Batch:
    """The running batch: rows of `seqs`, their HF KV cache ([B, H, T, D] per layer), mask [B, T]."""

    seqs: list  # the engine's sequences, one per row
    cache: object
    mask: torch.Tensor  # 1 = real token, 0 = left padding
    pos: torch.Tensor  # [B] position id of the next token
    last: torch.Tensor  # [B] last sampled token (input of the next decode step)


def out_cache(out):
    cache = out.get("cache")
    return cache if cache is not None else out.past_key_values


def kv_pairs(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of an HF cache, across transformers 4.x and 5.x layouts."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    try:
        return DynamicCache(kv)  # transformers >= 4.56 / 5.x
    except TypeError:
        return DynamicCache.from_legacy_cache(tuple(kv))


def merge(a: Batch, b: Batch) -> Batch:
    """Concatenate two batches along rows, left-padding the one with the shorter cache."""
    width = max(a.mask.shape[1], b.mask.shape[1])

    def lpad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    kv = [
        (torch.cat([lpad(ka, 2), lpad(kb, 2)]), torch.cat([lpad(va, 2), lpad(vb, 2)]))
        for (ka, va), (kb, vb) in zip(kv_pairs(a.cache), kv_pairs(b.cache))
    ]
    return Batch(
        seqs=a.seqs + b.seqs,
        cache=make_cache(kv),
        mask=torch.cat([lpad(a.mask, 1), lpad(b.mask, 1)]),
        pos=torch.cat([a.pos, b.pos]),
        last=torch.cat([a.last, b.last]),
    )
