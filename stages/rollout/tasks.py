"""Procedural prompt tasks: the built-in digit-repeat task and reasoning-gym datasets.

A task maps an example index to an `Example` (prompt, label, metadata) deterministically from its
seed, so a restarted data source regenerates exactly the same prompts. Each task names the reward
function that verifies it (`default_reward`).

digit-repeat (the CPU default): the prompt is a string of digits, e.g. "4071", and the correct answer
repeats it: "4071". With the tiny-qwen2 chat template the whole prompt is
`<|im_start|>4071<|im_end|><|im_start|>` and the ideal response `4071<|im_end|>`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Example:
    prompt: str | list[dict[str, str]]  # plain text, or chat messages [{"role": ..., "content": ...}]
    label: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


class Task:
    """A procedural task: `example(i)` is a pure function of (seed, kwargs, i)."""

    name = "task"
    default_reward = "exact_match"

    def example(self, index: int) -> Example:
        raise NotImplementedError


class DigitRepeat(Task):
    """Repeat a random string of `min_digits`..`max_digits` digits."""

    name = "digit_repeat"
    default_reward = "digit_repeat"

    def __init__(self, *, seed: int = 0, min_digits: int = 1, max_digits: int = 3):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(
                f"digit_repeat needs 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}"
            )
        self.seed, self.min_digits, self.max_digits = seed, min_digits, max_digits

    def example(self, index: int) -> Example:
        rng = random.Random(f"digit_repeat:{self.seed}:{index}")  # str seeds hash stably across runs
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        return Example(prompt=[{"role": "user", "content": digits}], label=digits)


# reasoning-gym: the model is asked to put its final answer in <answer>...</answer>, the convention
# reasoning-gym's own extract_answer() and system prompts use.
RG_INSTRUCTION = "Give your final answer inside <answer></answer> tags."


class ReasoningGym(Task):
    """A reasoning-gym dataset (e.g. basic_arithmetic, chain_sum, gsm_symbolic), scored by its own
    `score_answer`."""

    default_reward = "reasoning_gym"

    def __init__(self, dataset: str, *, seed: int = 0, size: int = 10000, **kwargs: Any):
        try:
            import reasoning_gym
        except ImportError:
            raise ImportError("reasoning-gym tasks need the package: pip install reasoning-gym") from None
        self.name = f"reasoning_gym:{dataset}"
        self.dataset = dataset
        self._ds = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **kwargs)
        self.size = size

    def example(self, index: int) -> Example:
        entry = self._ds[index % self.size]
        meta = dict(_jsonable(entry.get("metadata", {})))
        meta["rg_dataset"] = self.dataset
        return Example(
            prompt=[{"role": "user", "content": f"{entry['question']}\n{RG_INSTRUCTION}"}],
            label=str(entry["answer"]),
            metadata=meta,
        )


def _jsonable(x: Any) -> Any:
    """reasoning-gym metadata may hold tuples/sets/other objects; Sample.metadata must be JSON."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return str(x)


TASKS: dict[str, Callable[..., Task]] = {"digit_repeat": DigitRepeat}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make `factory(seed=..., size=..., **task_kwargs)` available as DataConfig.source=name."""
    TASKS[name] = factory


def is_task(source: str) -> bool:
    return source in TASKS or source.startswith("reasoning_gym:")


def make_task(source: str, *, seed: int, size: int, kwargs: dict[str, Any]) -> Task:
    """Build the task named by DataConfig.source."""
    if source.startswith("reasoning_gym:"):
        return ReasoningGym(source.partition(":")[2], seed=seed, size=size, **kwargs)
    if source not in TASKS:
        raise KeyError(f"unknown task {source!r}; known: {sorted(TASKS)} or reasoning_gym:<dataset>")
    factory = TASKS[source]
    if factory is DigitRepeat:
        return DigitRepeat(seed=seed, **kwargs)
    return factory(seed=seed, size=size, **kwargs)
