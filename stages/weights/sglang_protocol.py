"""SGLang's weight-update protocol, in one place for both sides that speak it: the trainer's senders
(stages/weights/sglang_transport.py, several servers) and SGLangEngine (stages/rollout/sglang_engine.py,
one server). Neither imports the other; both build their requests here.

The sequence of an update, against a server that keeps generating around it:
    PAUSE (pause_body)          in_place keeps running sequences and their KV; retract re-queues them
    LOAD_* one or more times    tensors by CUDA IPC, by an NCCL broadcast from trainer rank 0, or a folder
    the version                 `weight_version` in the last load's body (senders), or SET_VERSION
                                (engine) - never before every load has succeeded: a partly loaded server
                                must not label its weights with the new version
    CONTINUE
A failed pause resumes what was paused; a failed load leaves the server paused (its weights belong to
no version) and the caller says to restart it. Each side adds its own timing and retries.

Both ends of an NCCL push (the trainer's process and every SGLang server) also need one NCCL setting:
`align_nccl_env`, which stages/trainer/model.py calls too.
"""

from __future__ import annotations

import os

import torch

PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
SET_VERSION = "/update_weight_version"
LOAD_TENSOR = "/update_weights_from_tensor"
LOAD_DISTRIBUTED = "/update_weights_from_distributed"
LOAD_DISK = "/update_weights_from_disk"
JOIN_GROUP = "/init_weights_update_group"
LEAVE_GROUP = "/destroy_weights_update_group"
HEALTH = "/health"  # 200 once the server serves
MODEL_INFO = "/model_info"  # {"weight_version": ...}: the version the server runs
SERVER_INFO = "/server_info"  # the server's arguments (base_gpu_id: the GPU it runs on) and state
# LoRA serving (trainer.lora.push=adapter): adapters loaded and unloaded by name, the base untouched
LOAD_LORA = "/load_lora_adapter"  # from a PEFT folder the server reads on its CPU (sglang_lora.py says why)
UNLOAD_LORA = "/unload_lora_adapter"


def align_nccl_env(env=None):
    """Give NCCL one cuMem setting in every process of ours (`env` defaults to os.environ); returns env.

    NCCL's cuMem allocator must be on or off in all processes of a communicator. torch leaves it on,
    SGLang's server turns it off unless NCCL_CUMEM_ENABLE is set: a trainer and a server with
    different settings form the weight-push group, and then the server's first receive fails with
    "Cuda failure 'invalid argument'" (seen on 2 GPUs). Called before the trainer's first NCCL
    communicator and on the environment every SGLang server is launched with; a value the user set
    is kept (and then holds on both sides).
    """
    env = os.environ if env is None else env
    env.setdefault("NCCL_CUMEM_ENABLE", "0")
    return env


def pause_body(mode: str) -> dict:
    return {"mode": mode}


def version_body(version: int) -> dict:
    # abort_all_requests defaults to true on this route: the requests paused in place must survive
    return {"new_version": str(version), "abort_all_requests": False}


def with_version(body: dict, version: int | None) -> dict:
    """A load's body that also sets the server's weight version once it has loaded (the last load)."""
    return body if version is None else {**body, "weight_version": str(version)}


def describe(group) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtypes (as SGLang spells them) and shapes of tensors [(name, tensor)], in order."""
    return (
        [n for n, _ in group],
        [str(t.dtype).removeprefix("torch.") for _, t in group],
        [list(t.shape) for _, t in group],
    )


def distributed_body(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    *,
    flat: bool,
    flush_cache: bool = False,
    version: int | None = None,
) -> dict:
    """LOAD_DISTRIBUTED for tensors that rank 0 broadcasts in this order: each alone, or (`flat`) all
    of them as one FlattenedTensorBucket byte tensor."""
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
    body["flush_cache"] = flush_cache
    if flat:
        body["load_format"] = "flattened_bucket"
    return with_version(body, version)


def disk_body(model_path: str) -> dict:
    return {"model_path": str(model_path), "flush_cache": False, "abort_all_requests": False}


def join_group_body(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def flat_metadata(bucket: list[tuple[str, torch.Tensor]]) -> list:
    """SGLang's per-tensor metadata of a flattened bucket: each tensor's bytes back to back, in order."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    out, start = [], 0
    for name, t in bucket:
        n = t.numel() * t.element_size()
        out.append(
            FlattenedTensorMetadata(
                name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + n, numel=n
            )
        )
        start += n
    return out


def ipc_bucket_body(
    bucket: list[tuple[str, torch.Tensor]], tp_size: int, device
) -> tuple[dict, torch.Tensor]:
    """The /update_weights_from_tensor body for one bucket of GPU tensors, and the flat tensor the server
    maps by CUDA IPC: the caller keeps it alive until the server answered."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # IPC handles name the device by UUID: right GPU whatever each sees
    packed = getattr(bucket, "flat", None)  # a PackedBucket's tensors already lie back to back in it
    if packed is not None:
        flat = FlattenedTensorBucket(flattened_tensor=packed, metadata=flat_metadata(bucket))
    else:
        flat = FlattenedTensorBucket(named_tensors=bucket)  # one IPC handle per bucket, not per tensor
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    ser = MultiprocessingSerializer.serialize(data, output_str=True)
    torch.cuda.current_stream(device).synchronize()  # the bucket is written before the server maps it
    # flush_cache=False: flushing asserts while paused requests hold KV (in_place or retracted); in-flight
    # sequences keep their old-weight KV (in_place) by design; see SGLangConfig.radix_cache
    body = {
        "serialized_named_tensors": [ser] * tp_size,
        "load_format": "flattened_bucket",
        "flush_cache": False,
    }
    return body, data["flattened_tensor"]


def lora_load_body(name: str, folder: str) -> dict:
    """The /load_lora_adapter body: adapter `name` from the PEFT folder `folder` (adapter_config.json and
    adapter_model.safetensors), which the server reads into its host memory before it answers."""
    return {"lora_name": name, "lora_path": folder}
