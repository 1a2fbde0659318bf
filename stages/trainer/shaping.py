"""DAPO's overlong handling (trainer.loss.overlong_*, mask_truncated), applied to a batch before its
advantages: a soft length penalty on the rewards, and truncated samples masked out of the loss.

The penalty (DAPO, eq. 13): with L = overlong_max_len and B = overlong_buffer_len, a response of |y|
tokens gets 0 up to L - B, then -(|y| - (L - B)) / B, down to -1 at L and beyond; times
overlong_penalty. Masking keeps a truncated sample's reward in its group's statistics (it still tells
the group apart) but trains none of its tokens: its ending was cut, not chosen.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from stages.trainer.config import LossConfig
from stages.trainer.packing import TokenBatch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """The (non-positive) reward term of DAPO's soft overlong punishment, per response length."""
    start = max_len - buffer_len
    excess = (lengths.float() - start).clamp(min=0.0, max=float(buffer_len))
    return -factor * excess / buffer_len


def shape_batch(tb: TokenBatch, lc: LossConfig, max_new_tokens: int) -> TokenBatch:
    """`tb` with trainer.loss's overlong penalty in its rewards and its truncated samples' tokens
    masked (trainer.loss.mask_truncated); `tb` itself when neither is on."""
    changes = {}
    if lc.overlong_buffer_len:
        max_len = lc.overlong_max_len or max_new_tokens
        if max_len < lc.overlong_buffer_len:
            raise ValueError(
                f"trainer.loss.overlong_buffer_len={lc.overlong_buffer_len} but the overlong length is "
                f"{max_len} (trainer.loss.overlong_max_len, else rollout.sampling.max_new_tokens): set it"
            )
        lengths = torch.from_numpy(np.diff(tb.response_off).astype(np.int64))
        changes["rewards"] = tb.rewards + overlong_penalty(
            lengths, max_len, lc.overlong_buffer_len, lc.overlong_penalty
        )
    if lc.mask_truncated and tb.truncated is not None and bool(tb.truncated.any()):
        changes["mask"] = tb.mask * (~tb.truncated)[tb.seq].float()
    return dataclasses.replace(tb, **changes) if changes else tb
