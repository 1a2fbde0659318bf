"""How a checkpoint reaches the disk: a snapshot at the step boundary, each rank's shards planned and
written, then a commit by atomic renames. In the trainer's thread, or with trainer.async_save in a writer
process (async_checkpoint_writer.py) while the trainer steps on.

  1. snapshot (`snapshot_part`, the trainer's thread, every rank). megatron's preprocessing of each
     part's sharded state dict (its layout validated at the first save, a collective) and, for a
     background save, a copy of every tensor the write reads (into the writer's shared memory; on GPUs
     the device-to-host copy) and of every object. The trainer may then change its weights and
     optimizer state in place.
  2. plan and write (`write_shards`, every rank, no collective). DCP's decentralized plan of megatron's
     torch_dist format into <checkpoints>/.tmp-step_N/ (one file per rank, named by the rank), the
     shards written and fsync'd.
  3. exchange and commit (`finish`). The ranks gather each other's local plans and write results;
     rank 0 builds DCP's global metadata from the plans and commits: .metadata and metadata.json for
     every part, trainer_state.json, an fsync of every file and folder, the rename .tmp-step_N ->
     step_N, `latest` (temp file, fsync, rename), the prune of older steps.

A kill anywhere before `latest` is replaced leaves it naming the previous checkpoint, complete; the
.tmp- folder it leaves is never read (it is no step_ folder) and is removed at the next commit.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import queue
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # a save not committed: no step_ folder, so never loaded, listed or pruned as one
WAIT_TIMEOUT_S = 600.0  # how long a save waits for the one still being written before it gives up


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written or committed; the previous one stays the latest."""


@dataclass(eq=False)
class PartSnapshot:
    """One part's state as it was at the save: megatron's sharded tensors and objects (after
    save_preprocess) and, on rank 0, the common state serialized (common.pt)."""

    name: str
    sharded: dict
    common: bytes | None


@dataclass(eq=False)
class PartPlan:
    """One part's written shards on this rank: the planner and writer (rank 0 commits with them), DCP's
    local plan and the write results (what the other ranks need for the global metadata)."""

    name: str
    folder: str
    planner: Any
    writer: Any
    local_plan: Any
    results: list


@dataclass(eq=False)
class SaveJob:
    """One checkpoint between its snapshot and its commit."""

    root: str  # <run dir>/checkpoints
    name: str  # step_000042
    state: dict  # trainer_state.json, written last
    keep: int  # newest step_ folders kept after the commit (0: all)
    parts: list[PartSnapshot]
    root_part: str  # the part saved in the step folder itself (the others in sub-folders of their name)
    started: float  # time.monotonic() at the snapshot

    @property
    def tmp(self) -> str:
        return os.path.join(self.root, TMP_PREFIX + self.name)

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.name)

    def folder(self, part: str) -> str:
        return self.tmp if part == self.root_part else os.path.join(self.tmp, part)


def patch_writer() -> None:
    """megatron's torch_dist writer creates its result queue with a *spawn* multiprocessing Manager,
    which re-imports __main__ (breaking scripts without a main guard, and slow inside Ray actors). The
    writer asks for that queue although this module never uses it: a plain queue does."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    if fsa._results_queue is None:
        fsa._results_queue = queue.Queue()
    if not fsa.HAVE_PSUTIL:  # its writer logs its memory through psutil, and raises without it
        fsa._process_memory = lambda: 0


def snapshot_part(name: str, sharded_state_dict: dict, validate: bool, store: Any = None) -> PartSnapshot:
    """Step 1 of the module docstring for one part (collective when `validate`: megatron's check that
    every shard is saved exactly once, worth its time when the layout is new; it does not change
    between the saves of a run). `store` (the writer's Arena: reserve(bytes, count), keep(tensor) ->
    what stands for its copy); None, for a save written before the trainer goes on, keeps the tensors
    and objects themselves."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import save_preprocess

    sharded, common = save_preprocess(sharded_state_dict, validate)
    if store is not None:
        tensors = [v.data for v in nested_values(sharded) if isinstance(v, ShardedTensor)]
        store.reserve(sum(t.numel() * t.element_size() for t in tensors), len(tensors))

        def snap(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                v.data = store.keep(v.data.detach())
            elif isinstance(v, ShardedObject):
                v.data = copy.deepcopy(v.data)
            return v

        dict_list_map_inplace(snap, sharded)
    data = None
    if dist.get_rank() == 0:  # small; serialized now, as it is now
        buf = io.BytesIO()
        torch.save(common, buf)
        data = buf.getvalue()
    return PartSnapshot(name=name, sharded=sharded, common=data)


def write_shards(job: SaveJob, rank: int, cache: dict | None = None) -> list[PartPlan]:
    """Step 2: every part's local plan and this rank's shards, written (the job's folders exist).
    What megatron's save_state_dict_async_plan does in its decentralized mode, without the gather of
    the local plans (the exchange of step 3 carries them) and with the write done here.

    `cache` (the writer process's, kept from save to save): a part whose layout (keys, shapes, and the
    memory its tensors are in) is the last save's reuses that plan, whose tensors are that very memory,
    now holding this snapshot; only the serialized objects are made anew (~3 ms of ~10 ms on CPU)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    patch_writer()
    plans = []
    for snap in job.parts:
        folder = job.folder(snap.name)
        if snap.common is not None:
            with open(os.path.join(folder, "common.pt"), "wb") as f:
                f.write(snap.common)
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(snap.sharded, True)  # main replicas only
        writer = FileSystemWriterAsync(folder, thread_count=1)
        layout = _layout(sharded) if cache is not None else None
        hit = cache.get(snap.name) if cache is not None else None
        if hit is not None and hit[0] == layout:
            _, planner, local_plan, template = hit
            writer.set_up_storage_writer(rank == 0)
            buckets = _refilled(template, folder, sharded)
        else:
            planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
            planner.set_up_planner(mcore_to_pyt_state_dict(sharded, False), is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0)
            local_plan = writer.prepare_local_plan(planner.create_local_plan())
            central = planner.create_decentralized_global_plan(local_plan)
            central = planner.finish_plan(writer.prepare_decentralized_global_plan(central))
            writer.prepare_write_data(central, planner)
            buckets, writer.write_buckets = writer.write_buckets, None
            if cache is not None:
                cache[snap.name] = (layout, planner, local_plan, buckets)
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []
        results = [r for i, b in enumerate(buckets) for r in write_bucket(transforms, i, on_host(b))]
        plans.append(PartPlan(snap.name, folder, planner, writer, local_plan, results))
    return plans


def _layout(sharded: dict) -> tuple:
    """What a plan depends on: every key, every tensor's metadata and where its data is (the plan's
    tensors are that memory), the objects' keys."""
    out = []
    for key, values in sharded.items():
        for v in values:
            data = v.data if torch.is_tensor(v.data) else None
            where = (
                (data.data_ptr(), data.dtype, tuple(data.shape), data.stride()) if data is not None else None
            )
            out.append((key, type(v).__name__, *(getattr(v, f, None) for f in _META), where))
    return tuple(out)


_META = (  # the fields of megatron's ShardedTensor / ShardedObject besides the data
    "key",
    "dtype",
    "local_shape",
    "global_shape",
    "global_offset",
    "axis_fragmentations",
    "replica_id",
    "prepend_axis_num",
    "allow_shape_mismatch",
    "flattened_range",
)


def _refilled(buckets: list, folder: str, sharded: dict) -> list:
    """A cached plan's buckets for this save: in this save's folder, with its objects serialized as
    megatron's conversion does (a list of the key's objects, torch.save'd); the tensor items are the
    snapshot's memory already."""
    out = []
    for _, name, (bytes_items, tensor_items) in buckets:
        fresh = []
        for item, _ in bytes_items:
            buf = io.BytesIO()
            torch.save([obj.data for obj in sharded[item.index.fqn]], buf)
            fresh.append((item, buf))
        out.append((os.path.join(folder, name), name, (fresh, tensor_items)))
    return out


def on_host(bucket: tuple) -> tuple:
    """A bucket whose tensors megatron's writer can write: it writes host tensors only (it asserts
    `is_cpu`), which a background save's snapshot already is, while a synchronous save on GPUs plans the
    live GPU tensors themselves. Copied one bucket at a time, just before it is written (a bucket is
    one file: a rank's shards of one part), so that the host holds one part's worth, not every part's."""
    path, name, (bytes_items, tensor_items) = bucket
    if all(t.is_cpu for _, t in tensor_items):
        return bucket
    return path, name, (bytes_items, [(item, t if t.is_cpu else t.to("cpu")) for item, t in tensor_items])


def write_bucket(transforms: list, index: int, bucket: tuple) -> list:
    """Write one bucket ((path, file name, (bytes items, tensor items))) as megatron's writer processes
    do (torch DCP items, fsync at the end); its DCP WriteResults. Module-level so that tests can slow it
    down or make it fail (async_checkpoint_check.hold_writes)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()  # its worker protocol: put the result, count.get + done
    count.put(index)
    FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, results, count, use_fsync=True)
    _, got = results.get_nowait()
    if isinstance(got, Exception):
        raise got
    return got


def prepare_folder(job: SaveJob, group: Any) -> None:
    """Rank 0 makes the job's temporary folder afresh, with the parts' sub-folders; then every rank may
    write into it (a barrier over `group`, None: the default group)."""
    if dist.get_rank() == 0:
        shutil.rmtree(job.tmp, ignore_errors=True)  # left by a kill during an earlier save of this version
        for snap in job.parts:
            os.makedirs(job.folder(snap.name))
    if dist.get_world_size() > 1:
        # over NCCL, on this rank's GPU: without device_ids NCCL guesses one from the rank, which is
        # another rank's GPU where every actor sees every GPU and the ranks are not on GPUs 0..n-1
        nccl = dist.get_backend(group) == "nccl"
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()] if nccl else None)


def sent(plans: list[PartPlan]) -> dict[str, tuple]:
    """What a rank tells the others of its shards: each part's (local plan, write results)."""
    return {p.name: (p.local_plan, p.results) for p in plans}


def finish(job: SaveJob, mine: dict | None, error: str | None, group: Any, commit_fn: Callable) -> None:
    """Step 3, every rank: `mine` (sent(), or None with `error`) gathered over `group` (None: the default
    group); rank 0 calls commit_fn(the ranks' sent() in rank order) unless a rank failed. Every rank
    reaches every collective whatever failed, and every rank raises CheckpointWriteError when any rank's
    write or the commit failed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    every = [(mine, error)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (mine, error), group=group)
    outcome = "; ".join(err for _, err in every if err) or None
    if rank == 0 and outcome is None:
        try:
            commit_fn([m for m, _ in every])
        except Exception as e:
            log.exception("checkpoint %s: the commit failed", job.name)
            outcome = f"rank 0's commit: {type(e).__name__}: {e}"
    if world > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=group)
        outcome = box[0]
    if outcome:
        raise CheckpointWriteError(
            f"checkpoint {job.path} was not saved ({outcome}); `latest` still names the previous one, "
            f"which a resume loads (the unfinished {job.tmp} is removed at the next save)"
        )
    log.info("checkpoint saved: %s (%.3fs after its snapshot)", job.path, time.monotonic() - job.started)


def run_job(job: SaveJob) -> None:
    """Steps 2 and 3 in the trainer's thread (a synchronous save); collective over the default group."""
    rank = dist.get_rank()
    prepare_folder(job, None)
    plans: list[PartPlan] = []
    try:
        plans, error = write_shards(job, rank), None
    except Exception as e:
        log.exception("checkpoint %s: rank %d could not write its shards", job.name, rank)
        error = f"rank {rank}: {type(e).__name__}: {e}"
    finish(job, sent(plans) if error is None else None, error, None, lambda every: commit(job, plans, every))


def commit(job: SaveJob, plans: list[PartPlan], every: list[dict[str, tuple]]) -> None:
    """Rank 0, once every rank's shards are on disk (`every`: the ranks' sent()): step 3 of the module
    docstring. Up to the replacement of `latest` the previous checkpoint stays the latest."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    for plan in plans:
        local_plans = [sent_by[plan.name][0] for sent_by in every]
        _, metadata = plan.planner.create_global_plan(local_plans)  # what the gather made on rank 0
        metadata.all_local_plans = local_plans  # as megatron keeps them (its reuse of a global metadata)
        plan.writer.finish(metadata, [sent_by[plan.name][1] for sent_by in every])  # .metadata
        save_config(CheckpointingConfig("torch_dist", 1), plan.folder)  # metadata.json, read at a load
    with open(os.path.join(job.tmp, "trainer_state.json"), "w") as f:
        json.dump(job.state, f)
    _fsync_tree(job.tmp)
    if os.path.exists(job.path):  # a folder of this version no `latest` names (a run that died after
        shutil.rmtree(job.path)  # its rename, resumed from an older one): this save replaces it
    os.rename(job.tmp, job.path)
    _fsync(job.root)
    tmp = os.path.join(job.root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(job.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(job.root, "latest"))
    _fsync(job.root)
    prune(job.root, job.keep)


def prune(root: str, keep: int) -> None:
    """Remove step_ folders but the newest `keep` (0: keep all), and every uncommitted .tmp- folder
    (at most one save is in flight, and the caller's is committed)."""
    for d in os.listdir(root):
        if d.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if keep > 0:
        steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for d in steps[:-keep]:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: str) -> None:
    """fsync every file and folder under `top` that is not yet (the shards and .metadata are when
    written; common.pt, metadata.json, trainer_state.json and the folders not), so that the rename
    publishes only data on disk."""
    for folder, _, files in os.walk(top, topdown=False):
        for name in files:
            if not (name.endswith(".distcp") or name == ".metadata"):  # fsync'd when written
                _fsync(os.path.join(folder, name))
        _fsync(folder)
