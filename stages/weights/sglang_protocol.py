"""The request bodies of SGLang's weight-update endpoints, shared by the trainer's senders
(stages/weights/sglang_transport.py) and SGLangEngine (stages/rollout/sglang_engine.py), so that
neither imports the other.
"""

from __future__ import annotations

import torch


def ipc_bucket_body(
    bucket: list[tuple[str, torch.Tensor]], tp_size: int, device
) -> tuple[dict, torch.Tensor]:
    """The /update_weights_from_tensor body for one bucket of GPU tensors, and the flat tensor the server
    maps by CUDA IPC: the caller keeps it alive until the server answered."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # IPC handles name the device by UUID: right GPU whatever each sees
    flat = FlattenedTensorBucket(named_tensors=bucket)  # one IPC handle per bucket, not per tensor
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    ser = MultiprocessingSerializer.serialize(data, output_str=True)
    torch.cuda.synchronize(device)  # the bucket is written before the server maps it
    # flush_cache=False: flushing asserts while paused requests hold KV (in_place or retracted); in-flight
    # sequences keep their old-weight KV (in_place) by design; see SGLangConfig.radix_cache
    body = {
        "serialized_named_tensors": [ser] * tp_size,
        "load_format": "flattened_bucket",
        "flush_cache": False,
    }
    return body, data["flattened_tensor"]
