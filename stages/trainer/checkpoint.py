"""Trainer checkpoints: megatron distributed checkpoints (model + optimizer state, any TP/PP/DP
layout) plus a small `trainer_state.json` with the policy version.

Layout: <run dir>/checkpoints/step_<version>/ (megatron dist_checkpointing folder + trainer_state.json,
and with advantage=ppo the critic's own dist_checkpointing folder `critic/` inside it) and <run dir>/checkpoints/latest (the folder name, replaced atomically only after the save finished,
so a crash mid-save resumes from the previous one). Resume continues at the next version. The buffer
remembers what it handed out, so a resumed trainer reuses no sample; samples consumed after the last
checkpoint are lost to training, never trained twice.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch.distributed as dist

from stages.trainer import cpu_shim
from stages.trainer.optimizer import has_state

log = logging.getLogger(__name__)


def _root(trainer) -> str:
    return os.path.join(trainer.run_dir, "checkpoints")


def _sharded(model, optimizer, is_loading: bool, with_optimizer: bool = True) -> dict:
    """A DDP-wrapped model's (the policy's or the critic's) and its optimizer's state for megatron's
    dist_checkpointing; the model's alone where the optimizer has none to load (see save)."""
    model_sd = model.module.sharded_state_dict()  # DDP wraps (Float16Module ->) GPTModel
    if not with_optimizer:
        return {"model": model_sd}
    return {
        "model": model_sd,
        # fully_reshardable: the distributed optimizer's default format (flattened ranges) is refused
        # by this megatron's own checkpoint validator; this one also reloads under another TP/PP/DP
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        ),
    }


def _load(model, optimizer, path: str, with_optimizer: bool) -> None:
    """Into `model` and `optimizer` (the policy's or the critic's), the state saved at `path`."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(model, optimizer, True, with_optimizer), path)
    model.module.load_state_dict(loaded["model"])
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])


def _patch_writer() -> None:
    """megatron's torch_dist writer creates its result queue with a *spawn* multiprocessing Manager,
    which re-imports __main__ (breaking scripts without a main guard, and slow inside Ray actors).
    With synchronous saves the queue is only written and read in this process, so a plain queue works."""
    import queue

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    if fsa._results_queue is None:
        fsa._results_queue = queue.Queue()
    if not fsa.HAVE_PSUTIL:  # its writer child raises without psutil and the parent then waits forever
        fsa._process_memory = lambda: 0


def save(trainer) -> str:
    """Collective. Returns the checkpoint folder."""
    from megatron.core import dist_checkpointing

    _patch_writer()

    name = f"step_{trainer.version:06d}"
    path = os.path.join(_root(trainer), name)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # a half-written folder from a crash at this version
        os.makedirs(path)
    dist.barrier()
    with cpu_shim.device_mode():
        dist_checkpointing.save(_sharded(trainer.policy.model, trainer.optimizer, False), path)
    has_critic = getattr(trainer, "critic", None) is not None
    if has_critic:  # its own folder (megatron wants an empty one), made after the policy's save
        dist.barrier()
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(path, "critic"))
        dist.barrier()
        with cpu_shim.device_mode():
            dist_checkpointing.save(
                _sharded(trainer.critic.model, trainer.critic.optimizer, False), os.path.join(path, "critic")
            )
    dist.barrier()
    if dist.get_rank() == 0:  # written last: its presence marks the whole checkpoint complete
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            state = {
                "version": trainer.version,
                "model_path": trainer.policy.model_path,
                "critic": has_critic,
                # none before the first applied step (a run that ended before it still saves at version
                # 0): loading would lay out state the checkpoint does not have, and fail on its keys
                "optimizer_state": has_state(trainer.optimizer),
                "critic_optimizer_state": has_critic and has_state(trainer.critic.optimizer),
            }
            json.dump(state, f)
        tmp = os.path.join(_root(trainer), "latest.tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(_root(trainer), "latest"))
        _prune(trainer, keep=trainer.tc.keep_checkpoints)
    dist.barrier()
    log.info("checkpoint saved: %s", path)
    return path


def _prune(trainer, keep: int) -> None:
    if keep <= 0:
        return
    root = _root(trainer)
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in steps[:-keep]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_path(run_dir: str) -> str | None:
    marker = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(run_dir, "checkpoints", f.read().strip())
    if not os.path.exists(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(
            f"{marker} names {path}, which is incomplete; delete the marker to start fresh"
        )
    return path


def load_latest(trainer) -> dict | None:
    """Load model + optimizer state from the latest checkpoint of the run dir; None if there is none."""
    path = latest_path(trainer.run_dir)
    if path is None:
        return None
    if trainer.dist_opt:
        raise NotImplementedError(
            f"resuming from {path} with trainer.distributed_optimizer=true fails inside megatron-core 0.16 "
            "(its optimizer-state loader); set trainer.distributed_optimizer=false (the default) to resume, "
            "or trainer.resume=false to start fresh"
        )
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    value_model = getattr(trainer, "critic", None)
    if value_model is not None and not state.get("critic"):
        raise ValueError(
            f"{path} has no critic (it was saved without trainer.loss.advantage=ppo), which this run trains: "
            "set trainer.resume=false to start fresh, or resume with the checkpoint's advantage estimator"
        )
    with cpu_shim.device_mode():
        # checkpoints written before the flags existed were all saved after steps: with state
        _load(trainer.policy.model, trainer.optimizer, path, state.get("optimizer_state", True))
        if value_model is not None:
            _load(
                value_model.model,
                value_model.optimizer,
                os.path.join(path, "critic"),
                state.get("critic_optimizer_state", True),
            )
    log.info("resumed from %s at version %s", path, state["version"])
    return state
