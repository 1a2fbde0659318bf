"""Which memory the engines hand back at each hand-over of colocated offload (pipeline/orchestration/
handover.py): both weights and KV cache, except SGLang under LoRA, whose released weights would come back
empty while LoRA pushes leave the unadapted tensors (embeddings, norms, LM head) out, so it keeps them."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.orchestration.handover import Handover, engine_tags
from pipeline.orchestration.turns import Turn

OFFLOAD = ["run.mode=sync", "cluster.offload.train=true", "cluster.offload.rollout=true"]


class _Method:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, tags):
        self.calls.append((self.name, list(tags)))
        return Turn(0.0, 10, 1)


class _Generator:
    def __init__(self, calls: list):
        self.release_memory = _Method(calls, "release")
        self.resume_memory = _Method(calls, "resume")


class _Generators:
    def __init__(self, calls: list):
        self.actors = [_Generator(calls)]

    def name(self, i: int) -> str:
        return f"generator {i}"


class _Calls:
    def wait(self, ref, name, on_death=None, timeout_s=None):
        return ref


class _Healer:
    def on_ranks(self, step, method):
        return {}


def _handover(overrides: list[str]) -> tuple[Handover, list]:
    calls: list = []
    cfg = load_config(None, [*OFFLOAD, *overrides])
    return Handover(cfg, _Calls(), _Healer(), _Generators(calls)), calls


@pytest.mark.parametrize("overrides", [[], ["trainer.lora.rank=4"]])
def test_the_torch_engine_releases_weights_and_cache(overrides):
    """With LoRA too: the torch engine's release keeps a host copy of the weights."""
    h, calls = _handover(overrides)
    h.release_engines()
    h.to_generate(1)
    assert calls == [("release", ["weights", "kv_cache"]), ("resume", ["weights"]), ("resume", ["kv_cache"])]


def test_sglang_under_lora_keeps_its_weights_and_releases_only_the_kv_cache():
    cfg = load_config(None, OFFLOAD)
    cfg.rollout.engine = "sglang"
    assert engine_tags(cfg) == ["weights", "kv_cache"]  # full pushes rewrite every weight
    cfg.trainer.lora.rank = 8
    assert engine_tags(cfg) == ["kv_cache"]
    h = Handover(cfg, _Calls(), _Healer(), _Generators(calls := []))
    h.release_engines()
    h.to_generate(1)
    assert calls == [("release", ["kv_cache"]), ("resume", []), ("resume", ["kv_cache"])]


def test_without_rollout_offload_the_engines_release_nothing():
    cfg = load_config(None, ["run.mode=sync", "cluster.offload.train=true"])
    assert engine_tags(cfg) == []
