"""Model families beyond Llama / Qwen2 / Qwen3: Llama-3.1 RoPE scaling and GLM4 (dense). The megatron
policy's logits match transformers' (fp32, CPU), export -> HF reproduces the source weights, and what
the mapping cannot express is refused at load time naming the model type."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.tiny_families import make_tiny


def make_llama31(path: str) -> str:
    return make_tiny(path, "llama3.1")


def make_glm4(path: str) -> str:
    return make_tiny(path, "glm4")


MAKERS = {"llama3.1": make_llama31, "glm4": make_glm4}


def _logits_diff(path: str, attention: str, seq: int = 120) -> float:
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m = unwrap(build_policy(path, ddp=False, attention=attention).model).eval()
    toks = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(toks).logits
        out = m(toks, torch.arange(seq)[None].expand(2, -1), causal_block_mask(torch.zeros_like(toks)))
    return (out - ref).abs().max().item()


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("kind", ["llama3.1", "glm4"])
def test_logits_match_hf(tmp_path, dist1, kind, attention):
    path = MAKERS[kind](str(tmp_path / kind))
    assert _logits_diff(path, attention) <= 1e-4


def test_llama3_inverse_frequencies_are_transformers(tmp_path, dist1):
    """The scaled frequencies equal transformers' own, and differ from both plain RoPE and megatron's
    built-in llama3 scaling (which fixes the original context at 8192)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, unwrap

    path = make_llama31(str(tmp_path / "l"))
    ours = unwrap(build_policy(path, ddp=False).model).rotary_pos_emb.inv_freq
    theirs = AutoModelForCausalLM.from_pretrained(path).model.rotary_emb.inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    plain = RotaryEmbedding(16, 1.0, use_cpu_initialization=True).inv_freq
    builtin = RotaryEmbedding(
        16, 1.0, rope_scaling=True, rope_scaling_factor=8.0, use_cpu_initialization=True
    )
    for other in (plain, builtin.inv_freq):
        assert (ours - other).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama3.1", "glm4"])
def test_export_round_trip(tmp_path, dist1, kind):
    from stages.trainer.testing import assert_export_round_trips

    assert_export_round_trips(MAKERS[kind](str(tmp_path / kind)), str(tmp_path / "out"))


def test_unmapped_architectures_are_refused_by_name():
    import transformers as tf

    from stages.trainer.hf_mapping import check_supported

    with pytest.raises(ValueError, match=r"'deepseek_v3' is not supported.*supported: llama, .*glm4"):
        check_supported(tf.DeepseekV3Config())
    yarn = tf.Qwen2Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    with pytest.raises(ValueError, match=r"qwen2: rope type 'yarn' is not mapped.*default, llama3"):
        check_supported(yarn)
    partial = tf.LlamaConfig(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is mapped for glm4 only"):
        check_supported(partial)


@pytest.mark.slow
def test_glm4_tp2_sequence_parallel_matches_tp1(tmp_path):
    """GLM4's post-norms see whole hidden vectors under TP and this rank's positions under sequence
    parallelism (their gradients then summed over TP): TP=2 + SP trains like one rank."""
    from stages.trainer.testing import run_parallel_check

    path = make_glm4(str(tmp_path / "glm4"))
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "tp1"), 1)
    m, w = run_parallel_check(path, str(tmp_path / "tp2"), 2, "--tp", "2", "--sp")
    for a, b in zip(ref_m, m, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"])
    assert set(w) == set(ref_w)
    for k in ref_w:
        assert torch.allclose(w[k], ref_w[k], atol=1e-5), k
