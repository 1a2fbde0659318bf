"""TP=2, PP=2 and DP=2 (two gloo processes under torchrun) reproduce the TP=1 losses, gradient norms
and trained weights on the same data and initial weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from stages.trainer.testing import make_tiny_hf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model_path: str, out: str, nproc: int, *args: str) -> tuple[list[dict], dict]:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_free_port()}",
        "-m",
        "stages.trainer.parallel_check",
        "--model-path",
        model_path,
        "--out",
        out,
        *args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    from safetensors.torch import load_file

    return json.load(open(f"{out}/metrics.json")), load_file(f"{out}/weights.safetensors")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    path = make_tiny_hf(str(d / "qwen2"), "qwen2")
    return path, d, _run(path, str(d / "tp1"), 1)


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ()], ids=["tp2", "pp2", "dp2"])
def test_parallel_layout_matches_tp1(baseline, layout):
    path, d, (ref_m, ref_w) = baseline
    name = "-".join(layout) or "dp2"
    m, w = _run(path, str(d / name), 2, *layout)
    for a, b in zip(ref_m, m):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"])
        assert a["tokens/trained"] == b["tokens/trained"]
    assert set(w) == set(ref_w)
    for k in ref_w:
        assert torch.allclose(w[k], ref_w[k], atol=1e-5), k


def test_tp2_pads_a_vocabulary_tp_does_not_divide(tmp_path):
    """vocab 259 at TP=2: megatron holds 260 rows (one zero padding row, left out of every softmax);
    losses, gradient norms and the exported (trimmed) weights equal TP=1's."""
    path = make_tiny_hf(str(tmp_path / "odd"), "qwen2", vocab_size=259)
    ref_m, ref_w = _run(path, str(tmp_path / "tp1"), 1)
    m, w = _run(path, str(tmp_path / "tp2"), 2, "--tp", "2")
    for a, b in zip(ref_m, m):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"])
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert w["model.embed_tokens.weight"].shape[0] == 259
    for k in ref_w:
        assert torch.allclose(w[k], ref_w[k], atol=1e-5), k
