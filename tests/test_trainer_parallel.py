"""TP=2, PP=2, DP=2, CP=2 and TP=2 with sequence parallelism (two gloo processes, as torchrun starts
them) reproduce the TP=1 losses, gradient norms and trained weights on the same data and initial weights.

The layouts train GSPO with the sequence-level TIS weight: besides the per-token terms, its sequence
ratio, the seq_tis weight and the per-sequence mean need each sequence's sums over every rank holding
its tokens (CP) and must not be counted twice (TP copies), so one run checks all of them. The model's
vocabulary (259) is not a multiple of TP: the padded row must take no probability mass and the export
must trim it."""

from __future__ import annotations

import pytest

from stages.trainer.testing import assert_same_training, make_tiny_hf
from stages.trainer.testing import run_parallel_check as _run

GSPO = ("--advantage", "gspo", "--correction", "seq_tis")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    # vocab 259: at TP=2 megatron holds 260 rows, one zero padding row left out of every softmax
    path = make_tiny_hf(str(d / "qwen2"), "qwen2", vocab_size=259)
    return path, d, _run(path, str(d / "tp1"), 1, *GSPO)


@pytest.mark.parametrize(
    "layout",
    [("--tp", "2"), ("--pp", "2"), (), ("--cp", "2"), ("--tp", "2", "--sp")],
    ids=["tp2", "pp2", "dp2", "cp2", "tp2-sp"],
)
def test_parallel_layout_matches_tp1(baseline, layout):
    path, d, (ref_m, ref_w) = baseline
    name = "-".join(layout) or "dp2"
    m, w = _run(path, str(d / name), 2, *GSPO, *layout)
    assert_same_training(ref_m, ref_w, m, w)
    for a, b in zip(ref_m, m):  # a padding row with probability mass would move the entropy
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert w["model.embed_tokens.weight"].shape[0] == 259  # exported trimmed to the real vocabulary


@pytest.mark.slow
def test_tp2_sp_cp2_on_four_ranks(baseline):
    path, d, (ref_m, ref_w) = baseline
    m, w = _run(path, str(d / "tp2-sp-cp2"), 4, *GSPO, "--tp", "2", "--sp", "--cp", "2")
    assert_same_training(ref_m, ref_w, m, w)
