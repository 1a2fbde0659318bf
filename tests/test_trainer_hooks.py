"""The trainer's user hooks (trainer.hooks.*, slime's custom megatron init / before-log-prob /
before-train-step hooks): called in that order on each batch with the trainer's model, optimizer and
version; what they return is logged; what they raise stops the trainer with the key named."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.config import RunConfig
from stages.trainer.config import TrainerConfig, TrainerHooksConfig
from stages.trainer.testing import ListSource, make_batch, make_tiny_hf
from stages.user_code import HookError

HOOKS = textwrap.dedent(
    """
    CALLS = []

    def init(ctx):
        CALLS.append(("init", ctx.version, ctx.rank, type(ctx.optimizer).__name__))

    def before_log_prob(ctx, batch):
        CALLS.append(("before_log_prob", ctx.version, batch.n))

    def before_train_step(ctx, batch):
        CALLS.append(("before_train_step", ctx.version, batch.n))
        params = sum(p.numel() for p in ctx.model.parameters())
        return {"params": params, "n": batch.n}

    def broken(ctx, batch):
        raise RuntimeError("my hook is broken")
    """
)


def _trainer(tmp_path, **hooks):
    from trainer_setup import make_trainer

    (tmp_path / "my_hooks.py").write_text(HOOKS)
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    cfg = RunConfig()
    cfg.trainer.batch_groups = 2
    cfg.trainer.hooks = TrainerHooksConfig(**{k: f"{tmp_path}/my_hooks.py:{v}" for k, v in hooks.items()})
    batches = [make_batch(2, 4, seed=i) for i in range(2)]
    return make_trainer(cfg, ListSource(batches), path, str(tmp_path / "run"))


def test_hooks_run_in_order_with_the_trainers_state_and_their_numbers_are_logged(tmp_path):
    import sys

    tr = _trainer(
        tmp_path, init="init", before_log_prob="before_log_prob", before_train_step="before_train_step"
    )
    m1, m2 = tr.step(), tr.step()
    tr.close()
    mine = str(tmp_path / "my_hooks.py")
    calls = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == mine).CALLS
    assert calls[0][:3] == ("init", 0, 0) and calls[0][3]  # an optimizer was there
    assert calls[1:] == [
        ("before_log_prob", 0, 8),
        ("before_train_step", 0, 8),
        ("before_log_prob", 1, 8),
        ("before_train_step", 1, 8),
    ]
    assert m1["hook/n"] == m2["hook/n"] == 8 and m1["hook/params"] > 0


def test_a_hook_that_raises_stops_the_trainer_naming_the_key(tmp_path):
    tr = _trainer(tmp_path, before_train_step="broken")
    with pytest.raises(HookError, match=r"trainer.hooks.before_train_step=.*my hook is broken"):
        tr.step()
    tr.close()


def test_a_hook_that_cannot_be_loaded_is_named(tmp_path):
    with pytest.raises(HookError, match="trainer.hooks.init=.*has no callable 'missing'"):
        _trainer(tmp_path, init="missing")
    with pytest.raises(ValueError, match="trainer.hooks.init='nonsense'"):
        TrainerConfig(hooks=TrainerHooksConfig(init="nonsense"))
