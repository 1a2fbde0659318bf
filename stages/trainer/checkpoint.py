"""Trainer checkpoints over `Stateful` parts: megatron distributed checkpoints (model + optimizer state,
any TP/PP/DP layout) plus a small `trainer_state.json` with the policy version.

As torchtitan's CheckpointManager, this module knows parts, not the trainer: each part hands out its
state (`state_dict`) and takes it back (`load_state_dict`); the trainer names the parts and adds its
own figures (the version) to the JSON. The root part (ROOT, the policy) is saved in the step folder
itself, every other part in a sub-folder of its name (megatron wants an empty folder per save).

Layout: <run dir>/checkpoints/step_<version>/ (megatron dist_checkpointing folder + trainer_state.json,
and with advantage=ppo the critic's own folder `critic/` inside it) and <run dir>/checkpoints/latest
(the folder name). A save is written into checkpoints/.tmp-step_<version>/, renamed when complete and
only then named by `latest`, so a crash mid-save resumes from the previous one; with trainer.async_save
a writer process writes it while the trainer steps (async_checkpoint.py has the protocol,
docs/checkpoints.md the whole story). Resume continues at the next version. The buffer remembers what it handed out, so
a resumed trainer reuses no sample; samples consumed after the last checkpoint are lost to training,
never trained twice.

Optimizer state of the distributed optimizer (trainer.distributed_optimizer) is saved in megatron's
fully_reshardable format and resumes exactly, also at another DP size; the JSON records each part's
optimizer format, and a checkpoint of one format is refused by a run of the other (megatron loads
neither into the other).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from stages.trainer import cpu_shim
from stages.trainer.async_checkpoint import WAIT_TIMEOUT_S, SaveJob, run_job, snapshot_part
from stages.trainer.optimizer import has_state, is_distributed, lay_out_state

log = logging.getLogger(__name__)

ROOT = "policy"  # the part saved in the step folder itself; its flags carry no prefix in the JSON
DISTRIBUTED, REPLICATED = "distributed", "replicated"  # Stateful.optimizer_format


class Stateful(Protocol):
    """One part of a checkpoint: a model with its optimizer, as dist_checkpointing saves them."""

    def state_dict(self, loading: bool = False, optimizer: bool = True) -> dict:
        """The (sharded) state to save, or with `loading` the template to load into; the model's alone
        when not `optimizer`."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Take back what `state_dict` gave (its optimizer part only if it is there)."""
        ...

    def has_optimizer_state(self) -> bool:
        """Whether the optimizer holds state yet (none before the first applied step)."""
        ...

    def optimizer_format(self) -> str:
        """How its optimizer state is laid out: DISTRIBUTED (megatron's DistributedOptimizer, Adam state
        sharded over the data-parallel ranks) or REPLICATED (every data-parallel rank holds all of it).
        A checkpoint's optimizer state loads only into the format it was saved from."""
        ...


class MegatronPart:
    """A DDP-wrapped megatron model (the policy's or the critic's) and its optimizer."""

    def __init__(self, model: Any, optimizer: Any, keep: Callable[[str], bool] | None = None):
        # keep (LoRA): the model keys training changes; the frozen rest is the model folder the run
        # starts from, so only those (and their optimizer state) are saved
        self.model, self.optimizer, self.keep = model, optimizer, keep

    def state_dict(self, loading: bool = False, optimizer: bool = True) -> dict:
        model_sd = self.model.module.sharded_state_dict()  # DDP wraps (Float16Module ->) GPTModel
        if self.keep is not None:
            model_sd = {k: v for k, v in model_sd.items() if self.keep(k)}
        if not optimizer or self.optimizer is None:  # None: a model converted offline (convert.py)
            return {"model": model_sd}
        if loading:
            lay_out_state(self.optimizer)
        return {
            "model": model_sd,
            # fully_reshardable: the distributed optimizer's default format (flattened ranges) is refused
            # by this megatron's own checkpoint validator; this one also reloads under another TP/PP/DP
            # (tests/test_dist_optimizer_resume.py resumes DP=2's at DP=4). Ignored by the replicated one
            "optimizer": self.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.keep is not None:
            gpt = self.model.module.module if hasattr(self.model.module, "module") else self.model.module
            missing, unexpected = gpt.load_state_dict(state["model"], strict=False)
            lost = [k for k in missing if self.keep(k)] + list(unexpected)
            if lost:
                raise ValueError(
                    f"checkpoint: the LoRA adapters do not match this model's ({lost[:3]}...): was it saved "
                    "with other trainer.lora.target_modules or another model?"
                )
        else:
            self.model.module.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def has_optimizer_state(self) -> bool:
        return self.optimizer is not None and has_state(self.optimizer)

    def optimizer_format(self) -> str:
        return DISTRIBUTED if self.optimizer is not None and is_distributed(self.optimizer) else REPLICATED


def _flag(name: str, what: str = "state") -> str:
    """The JSON key that says whether part `name` was saved with optimizer state (`what`: "format",
    the key of its Stateful.optimizer_format)."""
    return f"optimizer_{what}" if name == ROOT else f"{name}_optimizer_{what}"


_FORMAT_SETTING = {
    DISTRIBUTED: "trainer.distributed_optimizer=true (Adam state sharded over the data-parallel ranks)",
    REPLICATED: "a replicated optimizer (trainer.distributed_optimizer=false, dp=1 or trainer.optimizer=sgd)",
}


def _format_problem(path: str, part_name: str, saved: str, now: str) -> str | None:
    """Why the checkpoint's optimizer state (`saved` format) cannot load into this run's (`now`)."""
    if saved == now:
        return None
    again = "trainer.distributed_optimizer=true at any dp > 1 (megatron reshards it)"
    if saved == REPLICATED:
        again = "trainer.distributed_optimizer=false"
    return (
        f"{path}: its {part_name} optimizer state was saved with {_FORMAT_SETTING[saved]}, and this run has "
        f"{_FORMAT_SETTING[now]}; megatron-core 0.16 loads neither format into the other. Resume with "
        f"{again}, or set trainer.resume=false to start fresh"
    )


def _saved_format(state: dict, part_name: str, folder: str) -> str:
    """The optimizer format of a part of a checkpoint: from trainer_state.json, or for checkpoints from
    before it was recorded there, from whether megatron's common state names a distributed layout."""
    if _flag(part_name, "format") in state:
        return state[_flag(part_name, "format")]
    import torch

    common = torch.load(os.path.join(folder, "common.pt"), map_location="cpu", weights_only=False)
    optimizer = common.get("optimizer") or {}
    chained = optimizer.values() if all(isinstance(k, int) for k in optimizer) else [optimizer]
    return DISTRIBUTED if any("param_state_sharding_type" in o for o in chained) else REPLICATED


class CheckpointManager:
    """Saves and loads the checkpoints of one run directory, keeping the newest `keep` (0: all).

    `async_save` (trainer.async_save): save() returns once the state is copied, and a writer process
    plans, writes and commits it while the trainer steps on (async_checkpoint_writer.py); at most one
    save is in flight, so the next save() first waits for it (at most `wait_timeout_s`). wait() and
    close() block until it is committed and raise what failed in it; close() also ends the writer."""

    def __init__(
        self,
        run_dir: str,
        keep: int = 0,
        *,
        async_save: bool = False,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
        writer_hook: tuple[str, ...] = (),
    ):
        """`writer_hook`: ("module:function", *arguments) the writer process calls first (tests)."""
        self.root = os.path.join(run_dir, "checkpoints")
        self.run_dir, self.keep, self.async_save = run_dir, keep, async_save
        self._background = None
        if async_save:  # its writer process starts now: its imports overlap the trainer's start-up
            from stages.trainer.async_checkpoint_writer import BackgroundSave

            self._background = BackgroundSave(self.root, wait_timeout_s, writer_hook)
        self._validated: set[tuple[str, bool]] = set()  # (part, with optimizer) layouts megatron checked

    def save(self, version: int, parts: dict[str, Stateful | None], meta: dict) -> str:
        """Collective. `parts`: ROOT and any others by name (None: a part this run does not have, saved as
        absent). `meta` goes into trainer_state.json beside the version. Returns the checkpoint folder,
        which with async_save exists once the background write committed it (wait())."""
        self.wait()  # at most one save in flight: the previous one is committed (or its error raised)
        os.makedirs(self.root, exist_ok=True)
        if self._background is None:
            run_job(self._snapshot(version, parts, meta, store=None))
            return os.path.join(self.root, f"step_{version:06d}")
        self._background.ready()
        job = self._snapshot(version, parts, meta, store=self._background.store)
        self._background.start(job)
        log.info("checkpoint %s: copied in %.3fs, written in the background", job.name, _since(job))
        return job.path

    def _snapshot(self, version: int, parts: dict[str, Stateful | None], meta: dict, store) -> SaveJob:
        """Every rank: the state of every part as it is now (async_checkpoint.snapshot_part)."""
        state: dict = {"version": version, **meta}
        snaps, started = [], time.monotonic()
        for part_name, part in parts.items():
            if part_name != ROOT:
                state[part_name] = part is not None
            # none before the first applied step (a run that ended before it still saves at version 0):
            # loading would lay out state the checkpoint does not have, and fail on its keys
            state[_flag(part_name)] = part is not None and part.has_optimizer_state()
            if part is None:
                continue
            state[_flag(part_name, "format")] = part.optimizer_format()
            with cpu_shim.device_mode():  # the distributed optimizer's gather calls .cuda() (cpu_shim W4)
                sd = part.state_dict()
            layout = (part_name, "optimizer" in sd)
            snaps.append(snapshot_part(part_name, sd, layout not in self._validated, store))
            self._validated.add(layout)
        name = f"step_{version:06d}"
        return SaveJob(self.root, name, state, self.keep, snaps, root_part=ROOT, started=started)

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (async_save), for tests and logs."""
        return self._background.writer.proc.pid if self._background is not None else None

    def wait(self) -> str | None:
        """Block until the save in flight (async_save) is committed; its folder, or None if none was.
        Raises what failed in it (CheckpointWriteError), or TimeoutError after wait_timeout_s."""
        return self._background.wait() if self._background is not None else None

    def close(self) -> None:
        """The end of a run: its last checkpoint committed (the final save and shutdown wait for it),
        then the writer process ended."""
        if self._background is not None:
            self._background.close()

    def load_latest(self, parts: dict[str, Stateful | None], backend: str = "") -> dict | None:
        """Load every part from the latest checkpoint of the run dir; returns its trainer_state.json, or
        None if there is none. A part this run has but the checkpoint lacks is refused."""
        path = latest_path(self.run_dir)
        return None if path is None else self.load(parts, path, backend=backend)

    def load(
        self, parts: dict[str, Stateful | None], path: str, optimizer: bool = True, backend: str = ""
    ) -> dict:
        """Load every part from the checkpoint folder `path` (optimizer state too, where it has some and
        `optimizer`); returns its trainer_state.json. `backend` (trainer.backend): refuse a checkpoint
        another backend wrote (their tensors are keyed differently)."""
        from megatron.core import dist_checkpointing

        self.wait()  # a save of this manager still in flight: the folder may be the one it writes
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        saved_by = state.get("backend", "megatron")  # checkpoints from before the key: megatron's
        if backend and saved_by != backend:
            raise ValueError(
                f"{path} was written by trainer.backend={saved_by}, this run is trainer.backend={backend}: "
                f"their checkpoints do not load into each other. Run with trainer.backend={saved_by}, or "
                "start from an HF folder (the run's hf/ export, or python -m stages.trainer.convert "
                "megatron-to-hf for a megatron checkpoint)"
            )
        for part_name, part in parts.items():
            if part is not None and part_name != ROOT and not state.get(part_name):
                raise ValueError(
                    f"{path} has no {part_name} (it was saved by a run without one, e.g. without "
                    f"trainer.loss.advantage=ppo for the critic), which this run trains: set "
                    "trainer.resume=false to start fresh, or resume with the checkpoint's settings"
                )
            if part is not None and optimizer and state.get(_flag(part_name), True):  # state to load
                folder = path if part_name == ROOT else os.path.join(path, part_name)
                saved = _saved_format(state, part_name, folder)
                problem = _format_problem(path, part_name, saved, part.optimizer_format())
                if problem:
                    raise ValueError(problem)
        with cpu_shim.device_mode():
            for part_name, part in parts.items():
                if part is None:
                    continue
                folder = path if part_name == ROOT else os.path.join(path, part_name)
                # checkpoints written before the flags existed were all saved after steps: with state
                with_optimizer = optimizer and state.get(_flag(part_name), True)
                template = part.state_dict(loading=True, optimizer=with_optimizer)
                loaded = dist_checkpointing.load(template, folder)
                # only what the template asked for: megatron also hands back the common (unsharded) state
                # of keys left out, e.g. an optimizer's param_groups where no optimizer state was saved
                part.load_state_dict({k: v for k, v in loaded.items() if k in template})
        log.info("resumed from %s at version %s", path, state["version"])
        return state


def _since(job: SaveJob) -> float:
    return time.monotonic() - job.started


def resolve_checkpoint(where: str, step: int = 0) -> str:
    """trainer.load's checkpoint folder: `where` is a run dir, its checkpoints/ folder or one step_N
    folder; `step` (trainer.ckpt_step) picks step_N among them, 0 the latest."""
    if os.path.exists(os.path.join(where, "trainer_state.json")):
        if step:
            raise ValueError(
                f"trainer.load={where!r} is one checkpoint already; drop trainer.ckpt_step={step}"
            )
        return where
    root = (
        where
        if os.path.basename(os.path.normpath(where)) == "checkpoints"
        else os.path.join(where, "checkpoints")
    )
    if step:
        path = os.path.join(root, f"step_{step:06d}")
        if not os.path.exists(os.path.join(path, "trainer_state.json")):
            have = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
            raise FileNotFoundError(
                f"trainer.ckpt_step={step}: no complete {path}; {root} has {have or 'none'}"
            )
        return path
    path = latest_path(os.path.dirname(root))
    if path is None:
        raise FileNotFoundError(
            f"trainer.load={where!r}: no checkpoint there (a run dir, its checkpoints/ folder, or a step_N "
            "folder; python -m stages.trainer.convert makes one from an HF model)"
        )
    return path


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
