"""The weight updates of an SGLang server (SGLangEngine's, which inherits them): pause, load (CUDA IPC
tensors, NCCL broadcast, or disk), set the version, continue, each phase timed; and the host copy of
pushed tensors that a restart() relaunches from. Uses the engine's HTTP calls (`_post`) and state."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

import stages.weights.sglang_protocol as proto
from stages.rollout.sglang_lora import adapter_config, adapter_name, split_adapter_push, write_adapter_folder
from stages.rollout.sglang_process import EngineError

log = logging.getLogger("stages.rollout.sglang_engine")  # the engine's own log, as before the split


class SGLangWeightUpdates:
    """Mixed into SGLangEngine: expects its cfg, name, gpu_id, dtype, log_dir, _post, _update_lock, _version,
    cache_namespace (the radix cache's namespace of new requests) and _cache_key_for, restarts, lora and
    served (LoRA serving: sglang_lora.LoraServing or None, and its ServedAdapters),
    the held-copy fields (_base, _disk, _held, _held_version, _held_pending), last_update, _stats and
    _unloads (the thread of the last adapter push's unloads, or None)."""

    # -- weight updates --------------------------------------------------------------------------
    def pause_generation(self, mode: str | None = None) -> None:
        self._post(proto.PAUSE, proto.pause_body(mode or self.cfg.pause_mode))

    def continue_generation(self) -> None:
        self._post(proto.CONTINUE, {})

    pause, resume = pause_generation, continue_generation

    @contextlib.contextmanager
    def updating(self, version: int, *, resume_on_failed_load: bool = False):
        """Pause -> (the caller loads weights) -> set `version` -> continue; timings in last_update.

        For transports that load in several calls (buckets): `with engine.updating(v): load...`.
        If a load fails, the server may hold partly loaded weights, which belong to no version: it
        stays paused and EngineError says to restart() it (as the trainer-side senders do). Only with
        `resume_on_failed_load` (a disk load, which SGLang rolls back itself) does generation go on,
        on the old version. A failed version call also leaves it paused: its weights are new by then.
        """
        with self._update_lock:
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            # before the pause: what is sent from now on is served by the new weights, and must match
            # no prefix cached under the old ones (a failed load leaves an empty namespace: misses only)
            self.cache_namespace = self._cache_key_for(version)
            self.pause_generation()
            t["pause_s"] = time.perf_counter() - t0
            try:
                yield t
            except Exception as e:  # (a KeyboardInterrupt ends the run: no resume, no relabel)
                if self._held_pending:  # the host copy holds the failed push: restart() must not use it
                    self._held.clear()
                    self._held_version, self._held_pending = None, False
                if resume_on_failed_load:
                    self._resume_after_failure()
                    raise
                raise EngineError(
                    f"{self.name}: loading weights v{version} failed ({e}); the server is left paused with "
                    "partly loaded weights: restart() it (or the run) before generating again"
                ) from e
            t1 = time.perf_counter()
            try:
                self._post(proto.SET_VERSION, proto.version_body(version))
            except EngineError as e:
                raise EngineError(
                    f"{e}; the server is left paused with the weights of v{version} under an older version "
                    "label: restart() it (or the run) before generating again"
                ) from e
            self._version = version
            if self._held_pending:
                self._held_version, self._held_pending = version, False
            t["version_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            self.continue_generation()
            t["continue_s"] = time.perf_counter() - t2
            self._updated(t, t0, f"weights v{version} applied")

    def _updated(self, t: dict[str, float], t0: float, what: str) -> None:
        """An update is done: its phase timings `t` (started at `t0`) become last_update and the stats."""
        t["total_s"] = time.perf_counter() - t0
        self.last_update = t
        self._stats["updates"] += 1
        self._stats["update_s"] += t["total_s"]
        log.info("%s: %s: %s", self.name, what, {k: round(v, 4) for k, v in t.items()})

    def _resume_after_failure(self) -> None:
        try:
            self.continue_generation()
        except EngineError as e:  # the load's own error is the one to raise
            log.warning("%s: could not resume after a failed weight load: %s", self.name, e)

    def _load(self, t: dict, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        t["load_s"] = t.get("load_s", 0.0) + time.perf_counter() - t0
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """The Engine interface: colocated push by CUDA IPC; returns the phase timings. With LoRA serving
        (trainer.lora.push=adapter) the push is the adapters, loaded under a new name."""
        if self.lora is not None:
            return self.load_adapters(named_tensors, version)
        return self.update_weights_from_tensor(named_tensors, version=version)

    @property
    def serves_adapters(self) -> bool:
        """Whether pushes are LoRA adapters this server applies over its base (sglang_lora.py)."""
        return self.lora is not None

    def load_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """An adapter push: load the adapters as a new adapter, send new requests under it as `version`,
        then (in a thread: `_unload_unused`) unload the adapters no request of ours uses any more.
        Generation is not paused: requests in flight finish under the adapter they were sent with
        (sglang_lora.py says why)."""
        adapters = split_adapter_push([(n, t.detach()) for n, t in named_tensors])
        with self._update_lock:
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            name = adapter_name(version, self.restarts)
            config = adapter_config(adapters, self.lora.rank)
            folder = write_adapter_folder(adapters, config, getattr(torch, self.dtype))
            t["write_s"] = time.perf_counter() - t0
            try:  # the server has the adapter in its host memory once it answers: the folder can go
                self._load(t, self._post, proto.LOAD_LORA, proto.lora_load_body(name, folder))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            self.cache_namespace = self._cache_key_for(version)
            self.served.switch(version, name)
            self._post(proto.SET_VERSION, proto.version_body(version))  # the label /model_info reports
            self._version = version
            self._updated(t, t0, f"adapter {name} (v{version}) loaded")
        # the push is done once new requests go to the new adapter; the unloads (10-13 ms of an H200
        # server's time, a fifth of an idle push) need not hold it up. Under the update lock, the next
        # push (a step later) or a relaunch waits for them.
        self._unloads = threading.Thread(target=self._unload_unused, name=f"{self.name}-unload", daemon=True)
        self._unloads.start()
        return t

    def _unload_unused(self) -> None:
        """Unload the adapters no request of ours uses any more; one that cannot be unloaded yet is tried
        again after the next push. Its time: last_unload_s."""
        with self._update_lock:
            t0 = time.perf_counter()
            for old in self.served.unused():
                try:
                    self._post(proto.UNLOAD_LORA, {"lora_name": old})
                    self.served.unloaded(old)
                except EngineError as e:  # the push itself worked: try this one again at the next
                    if "does not exist" in str(e):  # an earlier unload that timed out had done it
                        self.served.unloaded(old)
                    else:
                        log.warning("%s: could not unload adapter %s yet (%s)", self.name, old, e)
            self.last_unload_s = time.perf_counter() - t0

    def finish_unloads(self, timeout_s: float = 60.0) -> None:
        """Wait up to `timeout_s` for the unloads the last adapter push started (close(), tests, benches)."""
        if self._unloads is not None:
            self._unloads.join(timeout_s)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        bucket_mb: int = 512,
    ) -> dict:
        """Push HF-named tensors by CUDA IPC (the server maps this process's GPU memory; no copy over
        the host). CPU tensors are first copied to this engine's GPU. With `version`, runs the whole
        pause/load/version/continue protocol; without it, only loads (call inside `updating`)."""
        named = [(n, t.detach()) for n, t in named_tensors]
        if version is None:
            t: dict[str, float] = {}
            self._load(t, self._push_ipc, named, bucket_mb)
            return t
        with self.updating(version) as t:
            self._load(t, self._push_ipc, named, bucket_mb)
        return t

    def _push_ipc(self, named: list[tuple[str, torch.Tensor]], bucket_mb: int) -> None:
        dev = torch.device("cuda", self.gpu_id)
        limit, bucket, size = bucket_mb << 20, [], 0
        buckets = []
        for n, x in named:
            bucket.append((n, x if x.is_cuda else x.to(dev)))
            size += x.numel() * x.element_size()
            if size >= limit:
                buckets.append(bucket)
                bucket, size = [], 0
        buckets += [bucket] if bucket else []
        if self.cfg.keep_weights_copy:  # taken before the push, so a failed push leaves it unset
            self._held.update({n: x.to("cpu", copy=True) for n, x in named})
            self._held_pending = True
        for b in buckets:
            body, _keep = proto.ipc_bucket_body(b, self.cfg.tp_size, dev)
            self._post(proto.LOAD_TENSOR, body)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "slipstream-weights",
        backend: str = "nccl",
    ) -> dict:
        """Join the trainer's NCCL group as ranks rank_offset.. rank_offset+tp_size-1. Blocks until the
        trainer side (rank 0) joins too, so call it from a thread while rank 0 initialises."""
        body = proto.join_group_body(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return self._post(proto.JOIN_GROUP, body)

    def destroy_weights_update_group(self, group_name: str = "slipstream-weights") -> dict:
        return self._post(proto.LEAVE_GROUP, {"group_name": group_name})

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "slipstream-weights",
        *,
        version: int | None = None,
    ) -> dict:
        """Receive tensors that trainer rank 0 broadcasts (in this order) over the group. Blocks until all
        arrive: call it from a thread while rank 0 broadcasts. With `version`: the whole protocol."""
        body = proto.distributed_body(names, dtypes, shapes, group_name, flat=False)
        # the host copy is older from now on; restart() falls back to disk / base (and says so)
        self._held.clear()
        self._held_version, self._held_pending = None, False
        if version is None:
            t: dict[str, float] = {}
            self._load(t, self._post, proto.LOAD_DISTRIBUTED, body)
            return t
        with self.updating(version) as t:
            self._load(t, self._post, proto.LOAD_DISTRIBUTED, body)
        return t

    def update_weights_from_disk(self, model_path: str | Path, version: int) -> dict:
        """Fallback transport: load an HF folder the trainer wrote. It is also restart()'s source."""
        body = proto.disk_body(str(model_path))
        with self.updating(version, resume_on_failed_load=True) as t:
            self._load(t, self._post, proto.LOAD_DISK, body)
        self._disk = (str(model_path), version)
        return t

    def _resync_source(self) -> tuple[str, int]:
        newest = [s for s in (self._base, self._disk) if s is not None]
        if self._held and self._held_version is not None:
            newest.append((None, self._held_version))
        path, version = max(newest, key=lambda s: s[1])
        return (path or self._write_held_checkpoint()), version

    def _write_held_checkpoint(self) -> str:
        """The base model's files with the held tensors laid over its weights, as one HF folder."""
        from safetensors.torch import load_file, save_file

        out, tmp = self.log_dir / f"{self.name}-resync", self.log_dir / f"{self.name}-resync.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(self._base[0]).iterdir()):
            if f.name.endswith(".safetensors"):
                state.update(load_file(f))
            elif f.is_file() and not f.name.endswith(".safetensors.index.json"):
                shutil.copy(f, tmp / f.name)
        state.update(self._held)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", {"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return str(out)
