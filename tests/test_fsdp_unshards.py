"""The fsdp backend on one rank gathers (and, on a GPU, casts to bf16) each layer's weights once per pass
over a step's micro-batches, not twice per micro-batch: FSDP2's default resharding made the 1.5B backend
host-bound on an H200 (bench/RESULTS.md, GPU session of 2026-11-28, 11:05). After every pass the module
holds its sharded masters again, which the optimizer, the exports and the checkpoints read."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.testing import make_batch, make_tiny_hf


@pytest.fixture
def unshards(monkeypatch):
    """How many times an FSDP parameter group really unshards (an all-gather into unsharded weights)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    count = {"n": 0}
    real = FSDPParamGroup.unshard

    def counting(self, async_op: bool = False):
        if self._all_gather_result is None and not self.is_unsharded:
            count["n"] += 1
        return real(self, async_op)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    return count


def test_one_rank_unshards_each_layer_once_per_pass(tmp_path, unshards):
    from torch.distributed.tensor import DTensor

    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.fsdp_backend import FsdpBackend
    from stages.trainer.packing import shard_samples, to_token_batch

    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    tb = to_token_batch(make_batch(3, 4, seed=7, vocab=512))
    be = FsdpBackend(
        TrainerConfig(backend="fsdp", micro_batch_tokens=64, attention="sdpa"),
        TrainerRun(run_dir=str(tmp_path), temperature=0.8),
        path,
    )
    mbs = be.pack(tb, shard_samples(tb, 1)[0])
    assert len(mbs) >= 3  # several micro-batches: the case resharding between them costs
    groups = sum(1 for m in be.policy.model.modules() if hasattr(m, "_get_fsdp_state")) or 1

    old = be.logprobs(tb, mbs)
    assert unshards["n"] == groups  # one pass: each group once, whatever the micro-batch count
    unshards["n"] = 0
    adv = torch.linspace(-1.0, 1.0, len(old))
    stats, _ = be.train(tb, mbs, adv, old, None, lr=1e-3, version=0)
    assert stats["sum/skipped"] == 0
    assert unshards["n"] == groups  # forwards and backwards of every micro-batch share the gather
    # after the step the parameters are the sharded masters again: the optimizer stepped those
    params = list(be.policy.model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)

    unshards["n"] = 0
    after = be.logprobs(tb, mbs)  # the updated weights are gathered again, not the step's old copies
    assert unshards["n"] == groups
    assert not torch.allclose(after, old)
