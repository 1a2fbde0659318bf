"""The trainer's user hooks (trainer.hooks.*, slime's --custom-megatron-init-path,
--custom-megatron-before-log-prob-hook-path and --custom-megatron-before-train-step-hook-path): functions
named "package.module:function" or "path/to/file.py:function", called on every trainer rank.

    init(ctx)                      once, after the model and optimizer are built (and a checkpoint loaded)
    before_log_prob(ctx, batch)    each batch, before its logprob passes (logp_old, the KL reference)
    before_train_step(ctx, batch)  each batch, before its optimizer update(s)

`ctx` is a TrainerHookContext (the megatron model and optimizer, the configs, this rank, the version);
`batch` the step's TokenBatch (stages/trainer/packing.py). A hook may return a dict of numbers: they are
logged with the step's metrics under `hook/<name>` (init's with the first step's). What a hook raises
stops the trainer with an error naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.trainer.config import TrainerConfig, TrainerHooksConfig, TrainerRun
from stages.user_code import HookError, hook_name, load_hook

HOOKS = ("init", "before_log_prob", "before_train_step")


@dataclass
class TrainerHookContext:
    """What a trainer hook may use. `model` and `optimizer` are megatron's (DDP-wrapped GPTModel, its
    optimizer); changing them is the hook's responsibility."""

    config: TrainerConfig
    run: TrainerRun
    rank: int
    model: Any
    optimizer: Any
    version: int = 0


class TrainerHooks:
    """The configured hooks of one trainer rank; calling an unset one does nothing."""

    def __init__(self, cfg: TrainerHooksConfig):
        self._fns: dict[str, Callable[..., Any]] = {
            name: load_hook(getattr(cfg, name), f"trainer.hooks.{name}")
            for name in HOOKS
            if getattr(cfg, name)
        }
        self.metrics: dict[str, float] = {}  # returned by the hooks since the last step's metrics

    def call(self, name: str, ctx: TrainerHookContext, *args: Any) -> None:
        fn = self._fns.get(name)
        if fn is None:
            return
        try:
            out = fn(ctx, *args)
        except Exception as e:
            raise HookError(
                f"trainer.hooks.{name}={hook_name(fn)} raised at version {ctx.version}: {type(e).__name__}: {e}"
            ) from e
        if out is None:
            return
        if not isinstance(out, dict) or not all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in out.values()
        ):
            raise HookError(
                f"trainer.hooks.{name}={hook_name(fn)} returned {type(out).__name__}: return None or a dict of "
                "finite numbers (logged as hook/<name>)"
            )
        self.metrics.update({f"hook/{k}": float(v) for k, v in out.items()})

    def take_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
