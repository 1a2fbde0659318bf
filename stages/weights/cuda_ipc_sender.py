"""CUDA IPC weight transport into SGLang servers (colocated: trainer and engine share one GPU), the push
sequence of sglang_transport.py with a bucket delivered as CUDA IPC handles.

Each bucket is serialized with SGLang's MultiprocessingSerializer (CUDA IPC handles, no copy) and sent
as POST /update_weights_from_tensor. The GPU tensors must stay alive until the server answered, which
the push thread guarantees.
"""

from __future__ import annotations

import time

import torch

import stages.weights.sglang_protocol as proto
from stages.weights.buckets import check_flat_layout
from stages.weights.sglang_transport import _SGLangSender


class CudaIpcSGLangSender(_SGLangSender):
    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        check_flat_layout(group)

        t0 = time.monotonic()
        dev = torch.device("cuda", torch.cuda.current_device())
        # a packed bucket (a direct push) is on this GPU, back to back in its flat buffer already. The
        # buffer is refilled by the next bucket once the server answered: SGLang copies the weights out
        # of the mapped memory in its load, before it answers
        tensors = (
            group
            if getattr(group, "flat", None) is not None
            else [(n, t.to(dev).contiguous()) for n, t in group]
        )
        for url in urls:
            body, flat = proto.ipc_bucket_body(
                tensors, self.tp_of[url], dev
            )  # alive until the server answered
            self._post(url, proto.LOAD_TENSOR, proto.with_version(body, version), self.timeout_s)
            del flat
        return time.monotonic() - t0  # IPC: the handles travel, the engine maps and copies the bytes
