"""Offline conversion (issue #41, slime's convert_hf_to_torch_dist / convert_torch_dist_to_hf): an HF model
to the trainer's megatron checkpoint and back is bit-exact across layouts, a run starts from a converted
or another run's checkpoint (trainer.load, ckpt_step, finetune), and bad arguments are named."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from stages.trainer.testing import make_tiny_hf, run_parallel_check


def _convert(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "stages.trainer.convert", *args], check=True, timeout=600)


@pytest.mark.parametrize(
    "there,back",
    [
        # ~25 s of the default suite's time on 2 cores: one layout in the default suite, the other slow
        pytest.param(("--tp", "2"), (), marks=pytest.mark.slow, id="tp2-to-tp1"),
        pytest.param((), ("--pp", "2"), id="tp1-to-pp2"),
    ],
)
def test_hf_to_megatron_and_back_is_bit_exact_across_layouts(tmp_path, there, back):
    hf = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2", vocab_size=259)
    _convert("hf-to-megatron", "--hf", hf, "--out", str(tmp_path / "ckpt"), *there)
    _convert(
        "megatron-to-hf", "--load", str(tmp_path / "ckpt"), "--hf", hf, "--out", str(tmp_path / "back"), *back
    )
    before, after = load_file(f"{hf}/model.safetensors"), load_file(f"{tmp_path}/back/model.safetensors")
    assert set(before) == set(after)
    for k in before:
        assert torch.equal(before[k].to(after[k].dtype), after[k]), k


def test_a_run_starts_from_another_runs_checkpoint_at_its_version_or_fresh_with_finetune(tmp_path):
    hf = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    first = str(tmp_path / "first")
    m, w = run_parallel_check(hf, first, 1, "--steps", "4", "--checkpoint-every", "2")
    # the 2 steps after step 2 of `first`, in a run of its own that loads first's step 2
    args = ["--steps", "2", "--load", f"{first}/run", "--ckpt-step", "2"]
    m2, w2 = run_parallel_check(hf, str(tmp_path / "second"), 1, *args)
    for a, b in zip(m[2:], m2):
        assert abs(a["loss"] - b["loss"]) < 1e-5
    for k in w:
        assert torch.allclose(w[k], w2[k], atol=1e-6), k
    tuned, _ = run_parallel_check(
        hf, str(tmp_path / "tuned"), 1, "--steps", "1", "--load", f"{first}/run", "--finetune"
    )
    assert tuned[0]["version"] == 1  # weights of step 4, the version counted from 0
    assert abs(tuned[0]["loss"] - m[0]["loss"]) > 1e-6  # not the initial weights


def test_bad_load_arguments_are_named(tmp_path):
    from stages.trainer.checkpoint import resolve_checkpoint

    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        resolve_checkpoint(str(tmp_path))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.trainer.convert",
            "megatron-to-hf",
            "--hf",
            str(tmp_path),
            "--out",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--load" in out.stderr


def test_a_checkpoint_of_the_other_backend_is_refused_naming_both(tmp_path):
    import json

    from stages.trainer.checkpoint import CheckpointManager

    step = tmp_path / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"version": 3, "backend": "fsdp"}))
    with pytest.raises(ValueError, match="trainer.backend=fsdp, this run is trainer.backend=megatron"):
        CheckpointManager(str(tmp_path)).load({}, str(step), backend="megatron")
    (step / "trainer_state.json").write_text(json.dumps({"version": 3}))  # before the key: megatron's
    with pytest.raises(ValueError, match="trainer.backend=megatron, this run is trainer.backend=fsdp"):
        CheckpointManager(str(tmp_path)).load({}, str(step), backend="fsdp")
