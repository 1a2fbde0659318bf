"""Context and sequence parallelism on GPUs: two NCCL ranks (as torchrun starts them), bf16, the varlen
layout (FlashAttention over a packed row; under CP each rank's query runs attend to the whole row's keys
with a bottom-right causal mask). Training matches one rank on the same data to bf16 rounding. Needs 2
GPUs; marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.testing import run_parallel_check as _run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from stages.trainer.testing import make_tiny_hf

    d = tmp_path_factory.mktemp("cpgpu")
    # head dim 64 (FlashAttention), GQA 4:2; random weights large enough that attention matters
    path = make_tiny_hf(
        str(d / "qwen2"),
        "qwen2",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=4096,
        initializer_range=0.1,
    )
    args = ("--precision", "bf16", "--layout", "varlen")
    return path, d, args, _run(path, str(d / "one"), 1, *args)


@pytest.mark.parametrize("layout", [("--cp", "2"), ("--tp", "2", "--sp")], ids=["cp2", "tp2-sp"])
def test_gpu_parallel_layout_matches_one_rank(model, layout):
    path, d, args, (ref_m, _) = model
    m, _ = _run(path, str(d / "-".join(layout)), 2, *args, *layout)
    for a, b in zip(ref_m, m, strict=True):
        print("METRIC", {k: (a[k], b[k]) for k in ("loss", "entropy", "logp/abs_diff_train_rollout")})
        assert a["tokens/trained"] == b["tokens/trained"]
        # a query seeing the wrong keys moves every logprob; bf16 rounding moves them by ~1e-3
        assert b["logp/abs_diff_train_rollout"] == pytest.approx(a["logp/abs_diff_train_rollout"], rel=5e-3)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=5e-3)
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(1.0, abs(a["loss"]))
