"""The reward sub-config (`rollout.reward:`): which reward function scores the samples, and how."""

from __future__ import annotations

from typing import Any

import msgspec


class RewardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # built-in name ("exact_match", "math", "reasoning_gym", "digit_repeat") or "module:function"
    fn: str = "digit_repeat"
    kwargs: dict[str, Any] = {}  # passed to the function as keyword arguments
    batched: bool = False  # fn(samples, responses) -> list, instead of fn(sample, response) -> value
