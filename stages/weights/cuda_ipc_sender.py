"""CUDA IPC weight transport into SGLang servers (colocated: trainer and engines share the GPUs), the push
sequence of sglang_transport.py with a bucket delivered as CUDA IPC handles.

Each bucket is serialized with SGLang's MultiprocessingSerializer (CUDA IPC handles, no copy) and sent
as POST /update_weights_from_tensor. The GPU tensors must stay alive until the server answered, which
the push thread guarantees.
"""

from __future__ import annotations

import time

import torch

import stages.weights.sglang_protocol as proto
from stages.weights.base import WeightPushError
from stages.weights.buckets import check_flat_layout
from stages.weights.sglang_transport import _SGLangSender


def on_device(group, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors on `device`: as they are where they lie there already (a packed bucket stays
    packed), else copied there (a GPU-to-GPU copy within this process)."""
    if all(t.device == device for _, t in group):
        return group
    return [(n, t.to(device).contiguous()) for n, t in group]


class CudaIpcSGLangSender(_SGLangSender):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._gpu_of: dict[str, int] = {}  # server URL -> the GPU it runs on, asked once

    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        check_flat_layout(group)

        t0 = time.monotonic()
        dev = torch.device("cuda", torch.cuda.current_device())
        # a packed bucket (a direct push) is on this GPU, back to back in its flat buffer already. The
        # buffer is refilled by the next bucket once the server answered: SGLang copies the weights out
        # of the mapped memory in its load, before it answers
        tensors = on_device(group, dev)
        copied = False
        for url in urls:
            # a server on another GPU (colocated with another trainer rank) gets a copy on its own GPU
            there = self._server_device(url, dev)
            mine = tensors if there == dev else on_device(tensors, there)
            copied |= there != dev
            body, flat = proto.ipc_bucket_body(mine, self.tp_of[url], there)  # alive until answered
            self._post(url, proto.LOAD_TENSOR, proto.with_version(body, version), self.timeout_s)
            del flat, mine
        # blocks of earlier buckets that a server let go of only after this process freed them: torch keeps
        # those until ipc_collect (a 7B push's 15.2 GB buffer stayed through generation so; host_copy.py)
        torch.cuda.ipc_collect()
        if copied:  # the copies' blocks back to that GPU: its other trainer rank and server need them
            torch.cuda.empty_cache()
        return time.monotonic() - t0  # IPC: the handles travel, the engine maps and copies the bytes

    def _server_device(self, url: str, default: torch.device) -> torch.device:
        """The GPU the server at `url` runs on (its --base-gpu-id; the pipeline's processes all see every
        GPU, so ordinals agree), asked once. The server must map memory of its own GPU: its cross-GPU copy
        out of mapped memory into its weights failed ('CUDA error: invalid argument', 2 H200s, the 7B
        colocated offload config, 2026-11-28) and killed it."""
        gpus = self._gpu_of
        if url not in gpus:
            import requests

            try:
                info = requests.get(url + proto.SERVER_INFO, timeout=self.timeout_s).json()
                gpus[url] = int(info["base_gpu_id"])
            except (requests.RequestException, ValueError, KeyError, TypeError) as e:
                err = WeightPushError(f"SGLang server {url}{proto.SERVER_INFO}: no base_gpu_id ({e})")
                # a server gone meanwhile is left out of the push as any unreachable one is
                err.unreachable, err.url = isinstance(e, requests.ConnectionError), url
                raise err from e
        return torch.device("cuda", gpus[url]) if gpus[url] != default.index else default
