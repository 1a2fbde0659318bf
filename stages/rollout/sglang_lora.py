"""Adapter pushes into SGLang's LoRA serving (trainer.lora.push=adapter with rollout.engine=sglang, issue
#37): the server keeps one copy of the base model, each push loads the trained adapters under a new name,
and requests name the adapter they are to be served by.

Why a new name per version rather than one adapter updated in place: SGLang binds a request to its
adapter when the request is admitted, so the requests in flight at a push go on under the adapter they
were sent with, and every token of a request comes from one version (the request's version is its
adapter's: exact, with no pause of generation and no relabelled chunk). An adapter is unloaded once no
request of ours uses it any more (at the next push: unloading waits for the server's requests under it).

The server is launched with LoRA serving on (`LoraServing.launch_args`) and each push is written as a PEFT
folder in shared memory (/dev/shm, `write_adapter_folder`) that /load_lora_adapter reads. SGLang keeps
loaded adapters in host memory until a batch uses them, and an adapter push reaches the generator in host
memory (weights.transport=cpu): loading the tensors by CUDA IPC instead copied each of them to the GPU
here and back to the host there, a blocking copy per tensor on each side (392 tensors at 7B), and took
4.6-5.0 s a push on an idle H200 server (bench/RESULTS.md, GPU session of 2026-11-28, 11:05); from a
folder the load makes no CUDA call. The adapter tensors arrive as the trainer sends them (lora_peft.adapter_push_state):
`<HF module>.lora_A.weight` / `.lora_B.weight` with alpha/r folded into B, so the adapter is announced with
lora_alpha = r (SGLang's scaling alpha/r is then 1), in the dtype of the trainer's weights (bf16 when it
trains in bf16: cast on its GPU, so that here they are written as they come).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.rollout import safetensors_write
from stages.rollout.engine import LORA_A, is_adapter

if TYPE_CHECKING:  # annotations only: RolloutRun (run.py) imports LoraServing without torch
    import torch

PEFT_PREFIX = "base_model.model."  # how PEFT (and SGLang's adapter loader) names an adapter's tensors


@dataclass(frozen=True)
class LoraServing:
    """What a server needs to serve the trainer's adapters: trainer.lora's rank and target modules, and
    how many adapters (versions) one batch may mix."""

    rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int = 4

    def launch_args(self) -> list[str]:
        """sglang.launch_server's arguments for LoRA serving with no adapter loaded at start."""
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.rank),
            "--lora-target-modules",
            *self.target_modules,
            "--max-loras-per-batch",
            str(self.max_loras_per_batch),
        ]


def adapter_name(version: int, relaunches: int) -> str:
    """The adapter's name on the server: unique per version and per relaunch of the server (a catch-up
    push after a relaunch loads the same version again into a server that never had it)."""
    return f"slipstream-v{version}.r{relaunches}"


def split_adapter_push(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors of an adapter push by PEFT's names. Anything else (a module trained whole)
    would change the base under every adapter in use: refused, naming it."""
    others = [n for n, _ in named if not is_adapter(n)]
    if others:
        raise ValueError(
            f"an adapter push to SGLang carries {others[:3]} besides the adapters: SGLang's LoRA serving "
            "applies adapters over a base it keeps; train no modules whole (trainer.lora.modules_to_save: "
            "[]) or use trainer.lora.push=merge"
        )
    return {PEFT_PREFIX + n: t for n, t in named}


def adapter_config(tensors: dict[str, torch.Tensor], rank: int) -> dict:
    """The PEFT adapter_config SGLang reads: the modules the tensors adapt, rank r, and lora_alpha = r
    (alpha/r is folded into B already)."""
    modules = sorted({n[: -len(LORA_A)].rsplit(".", 1)[-1] for n in tensors if n.endswith(LORA_A)})
    return {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": modules, "bias": "none"}


SHM = "/dev/shm"


def adapter_folder_root(nbytes: int) -> str:
    """Where an adapter folder of `nbytes` is written: shared memory (the servers run on the generator's
    host) when it has room for twice that (a container's /dev/shm is often 64 MB, and Ray's object store
    lives there too), else the temporary directory."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= 2 * nbytes:
        return SHM
    return tempfile.gettempdir()


# ATen runs an elementwise op on fewer elements than its GRAIN_SIZE (32768) in the calling thread; a larger
# one starts an OpenMP team of a thread per core and waits for the slowest of them.
SERIAL_PIECE = 32767


def host_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a contiguous host tensor of `dtype`. A host tensor is cast in pieces that ATen runs in this
    thread: cast whole, each adapter (37k-100k elements) started a team of 64 threads, which on a busy
    host waits for cores other jobs hold (a 4x H200 host running three other benches, 2026-11-28: 7 ms a
    cast, 3.0 s for the 420 of a 135M model's rank-64 adapters, where the 2-core CI box takes 9 ms for
    all of them; in pieces ~25 ms there, loaded or not). A device tensor is cast on its device, then
    copied to the host."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        return t.to(dtype).to("cpu").contiguous()
    if t.dtype == dtype and t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=dtype)
    src, dst = t.reshape(-1), out.view(-1)
    for start in range(0, src.numel(), SERIAL_PIECE):
        dst[start : start + SERIAL_PIECE].copy_(src[start : start + SERIAL_PIECE])
    return out


def write_adapter_folder(
    tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype, root: str | None = None
) -> str:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors in `dtype`) of `tensors`
    under `root` (default: adapter_folder_root); the caller removes it once the server has loaded it.
    A write that fails leaves nothing behind and says how large the push was and where it went.
    Tensors that come in `dtype` (the trainer casts them on its GPU: export.PolicyExport.weights_dtype)
    are written from their own memory (safetensors_write: no copy but the kernel's, where safetensors'
    save_file made two, 20 ms of a 135M rank-64 push on an H200 host)."""
    host = {n: host_cast(t, dtype) for n, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    folder = tempfile.mkdtemp(prefix="slipstream-adapter-", dir=root or adapter_folder_root(nbytes))
    try:
        safetensors_write.save(host, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise OSError(
            e.errno,
            f"an adapter push ({nbytes / 2**20:.0f} MB) could not be written to {folder} for the SGLang "
            f"server to load ({e.strerror or e}): free space there, or point TMPDIR at a disk with room "
            f"({SHM} is used when it has twice the push free)",
        ) from e
    return folder


class ServedAdapters:
    """Which adapter new requests are sent under, and how many of our requests each loaded adapter still
    serves. Thread-safe: requests start and end on the generator's event loop, pushes come on the weight
    receiver's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: tuple[int, str] | None = None  # (version, name); None: the base model serves
        self.loaded: list[str] = []
        self._in_flight: collections.Counter[str] = collections.Counter()

    def acquire(self) -> tuple[int, str] | None:
        """For a request about to be sent: the (version, name) to send it under, counted until release()."""
        with self._lock:
            if self.current is not None:
                self._in_flight[self.current[1]] += 1
            return self.current

    def release(self, name: str) -> None:
        with self._lock:
            self._in_flight[name] -= 1
            if self._in_flight[name] <= 0:
                del self._in_flight[name]

    def switch(self, version: int, name: str) -> None:
        """`name` (just loaded) serves new requests from now on, as `version`."""
        with self._lock:
            self.loaded.append(name)
            self.current = (version, name)

    def unused(self) -> list[str]:
        """Loaded adapters that no request of ours uses and new ones will not: the ones to unload."""
        with self._lock:
            current = self.current[1] if self.current else None
            return [n for n in self.loaded if n != current and not self._in_flight[n]]

    def unloaded(self, name: str) -> None:
        with self._lock:
            self.loaded.remove(name)

    def forget(self) -> None:
        """The server was relaunched: it holds no adapter, and serves the base until the next push."""
        with self._lock:
            self.current, self.loaded = None, []
