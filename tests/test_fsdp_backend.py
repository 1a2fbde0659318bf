"""trainer.backend=fsdp (stages/trainer/fsdp_backend.py): on the same tiny model and batches as the
megatron backend it gives the same logprobs, losses, gradient norms and trained weights; two FSDP ranks
train as one; a run killed after its step-2 checkpoint and resumed equals the run that was not; and
the settings it does not implement are refused by key.

SGD with megatron's momentum 0.9 (parallel_check's optimizer): its momentum buffers are optimizer state
a resume must restore, and without Adam's g / sqrt(v) rounding differences stay rounding-sized."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stages.trainer.testing import assert_same_training, make_batch, make_tiny_hf, run_parallel_check

GSPO = ("--advantage", "gspo", "--correction", "seq_tis", "--steps", "4")
FSDP = ("--backend", "fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny Qwen2 (tied embeddings, qkv biases) trained 4 steps by: megatron on one rank, fsdp on one
    rank (both at once: one core each), fsdp on two ranks with checkpoints after steps 2 and 4."""
    d = tmp_path_factory.mktemp("fsdp")
    path = make_tiny_hf(str(d / "qwen2"), "qwen2")
    with ThreadPoolExecutor(2) as pool:
        meg = pool.submit(run_parallel_check, path, str(d / "meg"), 1, *GSPO)
        one = pool.submit(run_parallel_check, path, str(d / "fsdp1"), 1, *GSPO, *FSDP)
        meg, one = meg.result(), one.result()
    two = run_parallel_check(path, str(d / "fsdp2"), 2, *GSPO, *FSDP, "--checkpoint-every", "2")
    return path, d, meg, one, two


def test_fsdp_trains_as_megatron(runs):
    _, _, (meg_m, meg_w), (m, w), _ = runs
    assert_same_training(meg_m, meg_w, m, w)  # loss 1e-5, grad norm 1e-4 relative, weights 1e-5
    for a, b in zip(meg_m, m):
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        assert a["grad_norm"] > 0 and a["loss"] != 0


def test_two_fsdp_ranks_train_as_one(runs):
    _, _, _, (m, w), (m2, w2) = runs
    assert_same_training(m, w, m2, w2)


def test_resume_after_a_kill_equals_uninterrupted(runs):
    """The DP=2 run's folder as a kill after step 2 leaves it; two more steps in fresh processes."""
    from stages.trainer.testing import checkpoint_state

    path, d, _, _, (full_m, full_w) = runs
    cut = d / "resumed"
    shutil.copytree(d / "fsdp2" / "run", cut / "run")
    shutil.rmtree(cut / "run" / "checkpoints" / "step_000004")
    (cut / "run" / "checkpoints" / "latest").write_text("step_000002")
    tensors, _ = checkpoint_state(str(cut / "run" / "checkpoints" / "step_000002"))
    assert any(k.startswith("optimizer.momentum_buffer.model.layers.1.") for k in tensors)
    assert tensors["model.model.embed_tokens.weight"].shape == (512, 64)  # whole, from both ranks' rows
    second, weights = run_parallel_check(path, str(cut), 2, *GSPO[:-1], "2", *FSDP)
    assert_same_training(full_m, full_w, full_m[:2] + second, weights)


def test_logprobs_equal_megatron_in_fp32(runs, tmp_path):
    """Both backends in this process (a world of one) on the same batch: logprobs within 1e-5."""
    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.fsdp_backend import FsdpBackend
    from stages.trainer.megatron_backend import MegatronBackend
    from stages.trainer.packing import shard_samples, to_token_batch

    path = runs[0]
    tb = to_token_batch(make_batch(3, 4, seed=7, vocab=512))
    run = TrainerRun(run_dir=str(tmp_path), temperature=0.8)
    got = {}
    for name, cls in (("megatron", MegatronBackend), ("fsdp", FsdpBackend)):
        be = cls(TrainerConfig(backend=name, micro_batch_tokens=64, attention="sdpa"), run, path)
        got[name] = be.logprobs(tb, be.pack(tb, shard_samples(tb, 1)[0]))
    assert (got["fsdp"] != 0).all()
    assert torch.allclose(got["fsdp"], got["megatron"], atol=1e-5), (
        (got["fsdp"] - got["megatron"]).abs().max()
    )


def test_packed_varlen_rows_give_the_same_logprobs(runs, tmp_path):
    """trainer.attention=varlen without the flash-attn package: the fsdp backend packs one row per
    micro-batch and attends through hf_varlen (torch's FlashAttention varlen on a GPU, SDPA per sequence
    here); its logprobs equal the block-mask rows' of sdpa, and a row really holds several sequences."""
    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.fsdp_backend import FsdpBackend
    from stages.trainer.hf_varlen import VARLEN
    from stages.trainer.packing import shard_samples, to_token_batch

    tb = to_token_batch(make_batch(3, 4, seed=7, vocab=512))
    run = TrainerRun(run_dir=str(tmp_path), temperature=0.8)
    got = {}
    for attention in ("sdpa", "varlen"):
        be = FsdpBackend(
            TrainerConfig(backend="fsdp", micro_batch_tokens=256, attention=attention), run, runs[0]
        )
        mbs = be.pack(tb, shard_samples(tb, 1)[0])
        got[attention] = be.logprobs(tb, mbs)
    assert be.attn == VARLEN
    assert all(mb.tokens.shape[0] == 1 for mb in mbs) and len(mbs[0].cu_seqlens) > 2
    assert (got["varlen"] != 0).all()
    assert torch.allclose(got["varlen"], got["sdpa"], atol=1e-5), (got["varlen"] - got["sdpa"]).abs().max()


def test_compiled_layers_give_the_same_logprobs(runs, tmp_path):
    """trainer.fsdp_compile: each decoder layer under torch.compile (inductor) gives the uncompiled
    logprobs; the megatron backend refuses the key."""
    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.fsdp_backend import FsdpBackend
    from stages.trainer.packing import shard_samples, to_token_batch

    tb = to_token_batch(make_batch(3, 4, seed=7, vocab=512))
    run = TrainerRun(run_dir=str(tmp_path), temperature=0.8)
    got = {}
    for compiled in (False, True):
        be = FsdpBackend(
            TrainerConfig(backend="fsdp", micro_batch_tokens=256, fsdp_compile=compiled), run, runs[0]
        )
        got[compiled] = be.logprobs(tb, be.pack(tb, shard_samples(tb, 1)[0]))
    layer = be.policy.model.lm.model.layers[0]
    assert getattr(layer, "_compiled_call_impl", None) is not None  # nn.Module.compile took
    assert torch.allclose(got[True], got[False], atol=1e-5), (got[True] - got[False]).abs().max()
    with pytest.raises(ValueError, match="trainer.fsdp_compile is the fsdp backend's"):
        TrainerConfig(fsdp_compile=True)


@pytest.mark.parametrize(
    "key",
    [
        "tp",
        "pp",
        "cp",
        "ep",
        "sequence_parallel",
        "lora",
        "routing_replay",
        "distributed_optimizer",
        "layer_spec",
        "critic",
    ],
)
def test_unsupported_settings_are_refused_by_key(key):
    from stages.trainer.config import LoraConfig, LossConfig, TrainerConfig

    kw = {
        "tp": dict(tp=2),
        "pp": dict(pp=2),
        "cp": dict(cp=2),
        "ep": dict(ep=2, dp=2),
        "sequence_parallel": dict(tp=2, sequence_parallel=True),
        "lora": dict(lora=LoraConfig(rank=4)),
        "routing_replay": dict(routing_replay=True),
        "distributed_optimizer": dict(distributed_optimizer=True),
        "layer_spec": dict(layer_spec="te"),
        "critic": dict(loss=LossConfig(advantage="ppo")),
    }[key]
    TrainerConfig(**kw)  # the megatron backend takes it
    with pytest.raises(ValueError, match="trainer.backend=fsdp") as e:
        TrainerConfig(backend="fsdp", **kw)
    assert key.split("_")[0] in str(e.value)


def test_segment_positions_restart_per_sequence():
    from stages.trainer.fsdp_model import segment_positions

    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, -1, -1, -1]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]])
    assert torch.equal(segment_positions(seg), want)
