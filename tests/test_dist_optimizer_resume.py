"""trainer.distributed_optimizer=true (megatron's DistributedOptimizer: Adam state sharded over the
data-parallel ranks, experts' over the expert-data-parallel ones) resumes exactly: a run killed after 2
steps and resumed in a fresh process for 2 more equals the run that took all 4 (losses, gradient norms,
exported weights and the optimizer state of its last checkpoint), for a dense model at DP=2 and for a
Qwen3-MoE at EP=2. Its checkpoints reload at another DP size (megatron reshards them); a run without it
(or at dp=1, where it is off) refuses them with a message naming the setting, and a run with it refuses
those of a replicated optimizer.

Adam, not the parallel tests' SGD: what is checkpointed is Adam's moments and step count, and a step
count off by one changes every update through the bias correction."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from stages.trainer.testing import (
    assert_same_training,
    checkpoint_state,
    make_tiny_hf,
    run_parallel_check,
)

ADAM = ("--optimizer", "adam", "--lr", "0.01")
DIST = (*ADAM, "--distributed-optimizer")


def _last_checkpoint(out: str) -> str:
    with open(f"{out}/run/checkpoints/latest") as f:
        return f"{out}/run/checkpoints/{f.read().strip()}"


def _assert_same_optimizer_state(a_out: str, b_out: str, atol: float = 1e-5) -> None:
    """The last checkpoints of two runs hold the same weights and distributed-optimizer state (Adam's
    moments and fp32 weights per parameter, its step count in the param groups)."""
    import torch

    (ta, ca), (tb, cb) = checkpoint_state(_last_checkpoint(a_out)), checkpoint_state(_last_checkpoint(b_out))
    assert set(ta) == set(tb)
    assert any(".exp_avg_sq." in k for k in ta)  # Adam's state is in it
    for k in ta:
        assert torch.allclose(ta[k], tb[k], atol=atol), k
    opts = [ca["optimizer"]] if "param_state_sharding_type" in ca["optimizer"] else ca["optimizer"].values()
    assert all(o["param_state_sharding_type"] == "fully_reshardable" for o in opts)  # it was distributed
    steps = {g["step"] for o in opts for g in o["optimizer"]["param_groups"]}
    assert steps == {4.0}
    assert json.dumps(ca["optimizer"], default=str, sort_keys=True) == json.dumps(
        cb["optimizer"], default=str, sort_keys=True
    )


def _uninterrupted(path: str, out: str, *args: str):
    """4 steps in one run, checkpointing after steps 2 and 4 -> (metrics, weights)."""
    return run_parallel_check(path, out, 2, *args, "--steps", "4", "--checkpoint-every", "2")


def _killed_after_step2(full: str, out: str) -> str:
    """`full`'s run dir as a run killed after its checkpoint of step 2 leaves it (it saves at step 2
    what a run of 2 steps saves at its end), in `out`."""
    shutil.copytree(f"{full}/run", f"{out}/run")
    shutil.rmtree(f"{out}/run/checkpoints/step_000004")
    with open(f"{out}/run/checkpoints/latest", "w") as f:
        f.write("step_000002")
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny dense model and its uninterrupted 4 steps with the distributed optimizer at DP=2
    (checkpoints after steps 2 and 4, kept untouched: each test resumes a copy)."""
    d = tmp_path_factory.mktemp("dense")
    path = make_tiny_hf(str(d / "qwen2"), "qwen2")
    return path, d, _uninterrupted(path, str(d / "full"), *DIST)


def test_dense_dp2_resumes_exactly(dense):
    path, d, (full_m, full_w) = dense
    cut = _killed_after_step2(str(d / "full"), str(d / "resumed"))
    second, weights = run_parallel_check(path, cut, 2, *DIST, "--steps", "2")
    assert_same_training(full_m, full_w, full_m[:2] + second, weights)
    _assert_same_optimizer_state(str(d / "full"), cut)


@pytest.mark.slow  # ~30 s on 2 cores; the dense dp2 resume stays in the default suite
def test_moe_ep2_resumes_exactly(tmp_path):
    """Dense weights DP=2 (their Adam state sharded over both ranks), experts split over EP=2 (each
    rank's experts in an optimizer of their own, over expert-DP=1): both optimizers of the chain."""
    from stages.trainer.tiny_families import make_tiny

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    full_m, full_w = _uninterrupted(path, str(tmp_path / "full"), *DIST, "--ep", "2")
    cut = _killed_after_step2(str(tmp_path / "full"), str(tmp_path / "resumed"))
    second, weights = run_parallel_check(path, cut, 2, *DIST, "--ep", "2", "--steps", "2")
    assert_same_training(full_m, full_w, full_m[:2] + second, weights)
    _assert_same_optimizer_state(str(tmp_path / "full"), cut)


def test_a_distributed_checkpoint_refuses_a_replicated_optimizer(dense):
    """At dp=1 the distributed optimizer is off whatever the setting (and without it at DP=2 the same
    check refuses: the in-process tests below)."""
    path, d, _ = dense
    cut = _killed_after_step2(str(d / "full"), str(d / "replicated"))
    with pytest.raises(AssertionError) as e:
        run_parallel_check(path, cut, 1, *DIST, "--steps", "1")
    assert "saved with trainer.distributed_optimizer=true" in str(e.value)
    assert "Resume with trainer.distributed_optimizer=true at any dp > 1" in str(e.value)


class _Part:
    """A checkpoint part with only what load_latest asks before loading (the refusals)."""

    def __init__(self, fmt: str):
        self.fmt = fmt

    def optimizer_format(self) -> str:
        return self.fmt


def _fake_checkpoint(run_dir, **state) -> None:
    step = run_dir / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"version": 2, **state}))
    (run_dir / "checkpoints" / "latest").write_text("step_000002")


def test_a_replicated_checkpoint_refuses_the_distributed_optimizer(tmp_path):
    from stages.trainer.checkpoint import DISTRIBUTED, REPLICATED, ROOT, CheckpointManager

    _fake_checkpoint(tmp_path, optimizer_state=True, optimizer_format=REPLICATED)
    with pytest.raises(ValueError, match="this run has trainer.distributed_optimizer=true") as e:
        CheckpointManager(str(tmp_path)).load_latest({ROOT: _Part(DISTRIBUTED)})
    assert "Resume with trainer.distributed_optimizer=false" in str(e.value)


def test_the_format_of_a_checkpoint_from_before_it_was_recorded_is_read_from_megatrons_state(tmp_path):
    import torch

    from stages.trainer.checkpoint import DISTRIBUTED, REPLICATED, ROOT, CheckpointManager

    _fake_checkpoint(tmp_path, optimizer_state=True)
    common = tmp_path / "checkpoints" / "step_000002" / "common.pt"
    for saved, optimizer in (
        (DISTRIBUTED, {0: {"optimizer": {}, "param_state_sharding_type": "fully_reshardable"}, 1: {}}),
        (REPLICATED, {"optimizer": {"param_groups": []}}),
    ):
        torch.save({"optimizer": optimizer}, common)
        other = REPLICATED if saved == DISTRIBUTED else DISTRIBUTED
        with pytest.raises(ValueError, match="optimizer state was saved with") as e:
            CheckpointManager(str(tmp_path)).load_latest({ROOT: _Part(other)})
        assert ("saved with trainer.distributed_optimizer=true" in str(e.value)) == (saved == DISTRIBUTED)


@pytest.mark.slow
def test_a_dp2_checkpoint_resumes_at_dp4(dense):
    """megatron's fully_reshardable format: the DP=2 shards of the Adam state laid out again over 4
    ranks. Not bit-exact against the uninterrupted DP=2 run: DP=4 reduces gradients in another order,
    and Adam's g / sqrt(v) turns that rounding into weight differences of ~1e-5."""
    path, d, (full_m, full_w) = dense
    cut = _killed_after_step2(str(d / "full"), str(d / "dp4"))
    second, weights = run_parallel_check(path, cut, 4, *DIST, "--steps", "2")
    assert_same_training(full_m, full_w, full_m[:2] + second, weights, atol=1e-4)
    assert os.path.exists(f"{cut}/run/checkpoints/step_000004")
