"""Resolve `rollout.reward` into a scorer that fills in Sample.reward, and never lets one bad sample
stop a generator.

Calling convention for reward functions (built-in or custom `module:function`):

  per sample:  fn(sample: Sample, response: str, **kwargs) -> float | dict[str, float]
  per batch:   fn(samples: list[Sample], responses: list[str], **kwargs) -> list[float | dict[str, float]]
               (set reward.batched: true, or give the function an attribute `batched = True`)

Either may be `async def`; synchronous custom functions run in a worker thread so that a slow
verifier does not stall the generator's event loop. A dict result becomes `reward_parts`; the reward
is its "reward" entry, else the sum of its values. A function that raises marks the sample (or, for
a batch function, every sample of the call) Status.FAILED with the error text; nothing else fails.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from buffer.record import Sample, Status
from stages.reward import builtin
from stages.reward.config import RewardConfig

log = logging.getLogger(__name__)

REWARDS: dict[str, Callable[..., Any]] = {
    "exact_match": builtin.exact_match,
    "math": builtin.math_answer,
    "reasoning_gym": builtin.reasoning_gym_score,
    "digit_repeat": builtin.digit_repeat,
}


def register_reward(name: str, fn: Callable[..., Any], *, batched: bool = False) -> None:
    """Make `fn` available as reward.fn=name."""
    if batched:
        fn.batched = True  # type: ignore[attr-defined]
    REWARDS[name] = fn


def resolve_reward_fn(spec: str) -> Callable[..., Any]:
    """A built-in name or "package.module:function"."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise KeyError(
            f"unknown reward function {spec!r}: use a built-in ({', '.join(sorted(REWARDS))}) "
            "or a 'package.module:function' path"
        )
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"reward function {spec!r}: cannot import module {mod_name!r} ({e})") from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise AttributeError(f"reward function {spec!r}: {mod_name} has no callable {attr!r}")
    return fn


class RewardScorer:
    """Scores finished samples in place (reward, reward_parts, status, error, finished_at)."""

    def __init__(
        self, fn: Callable[..., Any], *, kwargs: dict[str, Any] | None = None, batched: bool = False
    ):
        self.fn = fn
        self.kwargs = dict(kwargs or {})
        self.batched = batched or bool(getattr(fn, "batched", False))
        self.is_async = inspect.iscoroutinefunction(fn)
        # built-ins are cheap and pure: calling them inline beats a thread hop per sample
        self.inline = fn in REWARDS.values() and fn.__module__ == builtin.__name__
        self.failures = 0

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardScorer:
        """From the `rollout.reward:` section."""
        return cls(resolve_reward_fn(cfg.fn), kwargs=cfg.kwargs, batched=getattr(cfg, "batched", False))

    async def score(self, samples: list[Sample], responses: list[str]) -> None:
        if self.batched:
            try:
                values = await self._call(samples, responses)
                if len(values) != len(samples):
                    raise ValueError(
                        f"batched reward returned {len(values)} values for {len(samples)} samples"
                    )
            except Exception as e:
                for s in samples:
                    self._fail(s, e)
                return
            for s, v in zip(samples, values):
                self._assign(s, v)
            return
        results = await asyncio.gather(
            *(self._call(s, r) for s, r in zip(samples, responses)), return_exceptions=True
        )
        for s, v in zip(samples, results):
            self._assign(s, v)

    async def _call(self, first: Any, second: Any) -> Any:
        if self.is_async:
            return await self.fn(first, second, **self.kwargs)
        if self.inline:
            return self.fn(first, second, **self.kwargs)
        return await asyncio.to_thread(self.fn, first, second, **self.kwargs)

    def _assign(self, s: Sample, value: Any) -> None:
        s.finished_at = time.time()
        if isinstance(value, BaseException):
            self._fail(s, value)
            return
        try:
            if isinstance(value, dict):
                parts = {str(k): float(v) for k, v in value.items()}
                s.reward_parts = parts
                s.reward = parts["reward"] if "reward" in parts else float(sum(parts.values()))
            else:
                s.reward = float(value)
        except (TypeError, ValueError) as e:
            self._fail(s, TypeError(f"reward returned {value!r}, not a number or dict of numbers ({e})"))
            return
        if not math.isfinite(s.reward):  # a NaN would poison its whole group's advantages
            bad = s.reward
            s.reward = 0.0
            self._fail(
                s,
                ValueError(
                    f"reward function {getattr(self.fn, '__name__', self.fn)!r} returned "
                    f"{bad}; rewards must be finite numbers"
                ),
            )

    def _fail(self, s: Sample, err: BaseException) -> None:
        self.failures += 1
        s.status = Status.FAILED
        s.error = f"reward {getattr(self.fn, '__name__', self.fn)}: {type(err).__name__}: {err}"[:2000]
        s.reward = 0.0
        s.finished_at = time.time()
        log.warning("sample %s failed in its reward function: %s", s.uid, s.error)
