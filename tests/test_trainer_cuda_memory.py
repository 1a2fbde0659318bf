"""The trainer process's allocator setting (stages/trainer/cuda_memory.py): expandable segments for a
CUDA trainer whose weights leave without CUDA IPC, and nothing otherwise."""

from __future__ import annotations

import os

import pytest

from stages.trainer.config import TrainerConfig
from stages.trainer.cuda_memory import EXPANDABLE, choose_allocator
from stages.weights.config import WeightsConfig


def _cfg(device: str, transport: str) -> tuple[TrainerConfig, WeightsConfig]:
    trainer, weights = TrainerConfig(), WeightsConfig()
    trainer.device, weights.transport = device, transport
    return trainer, weights


@pytest.mark.parametrize(
    ("device", "transport", "expected"),
    [
        ("cuda", "nccl", EXPANDABLE),  # the 7B trainer: fragmentation ran its push out of memory
        ("cuda", "cpu", EXPANDABLE),
        ("cuda", "cuda_ipc", None),  # the push buffers go to the server by CUDA IPC
        ("cuda", "auto", None),  # may become cuda_ipc
        ("cpu", "nccl", None),
    ],
)
def test_expandable_segments_only_where_no_cuda_ipc_reads_the_trainers_memory(device, transport, expected):
    env: dict[str, str] = {}
    assert choose_allocator(*_cfg(device, transport), env) == expected
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == expected


@pytest.mark.parametrize("key", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_allocator_setting_is_kept(key):
    env = {key: "max_split_size_mb:512"}
    assert choose_allocator(*_cfg("cuda", "nccl"), env) is None
    assert env == {key: "max_split_size_mb:512"}


def test_the_processs_allocator_is_told_too(monkeypatch):
    """Newer torch may read PYTORCH_CUDA_ALLOC_CONF when it is imported (a Ray worker imports it before
    the trainer is set up): for this process the setting also goes to the allocator itself."""
    import torch

    told = []
    monkeypatch.setattr(os, "environ", {})  # this process's environment, as the function sees it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    assert choose_allocator(*_cfg("cuda", "nccl")) == EXPANDABLE
    assert told == [EXPANDABLE] and os.environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
