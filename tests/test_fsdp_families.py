"""trainer.backend=fsdp trains families the megatron mapping (stages/trainer/hf_mapping.py) lacks: tiny
random models from transformers' own config classes (gemma2 with its logit soft-capping, gemma3 text
with sliding-window layers, phi3 with fused qkv / gate_up, olmo2 with post-norms and qk-norm, granite
with its logits scaling) train a step through the Trainer, and the backend's logprobs of packed rows
equal a plain HF forward of each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.trainer import hf_mapping
from stages.trainer.testing import TINY, ListSource, make_batch

SMALL = {k: v for k, v in TINY.items() if k != "rms_norm_eps"}
FAMILIES = {
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=16, final_logit_softcapping=3.0, query_pre_attn_scalar=16, sliding_window=4),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(pad_token_id=0)),
    "granite": (
        "GraniteConfig",
        dict(logits_scaling=2.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2),
    ),
}


def make_family(path: str, kind: str) -> str:
    import transformers as tf

    cls_name, extra = FAMILIES[kind]
    cfg = getattr(tf, cls_name)(**SMALL, **extra)
    torch.manual_seed(3)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # HF starts norms at 1 (gemma: 0) and biases at 0: random, so they matter
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def _trainer(path: str, run_dir: str, batches):
    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.trainer import Trainer

    tc = TrainerConfig(backend="fsdp", batch_groups=2, micro_batch_tokens=48, optimizer="sgd", lr=0.5)
    tc.loss.entropy_coef = 0.01
    run = TrainerRun(run_dir=run_dir, temperature=0.7)
    return Trainer(tc, run, ListSource(batches), path)


def _hf_logprobs(path: str, tb, temperature: float) -> torch.Tensor:
    """Each sample alone through transformers' own forward (eager attention, its own logits)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = torch.zeros(len(tb.rollout_logprobs))
    for i in range(tb.n):
        p = tb.prompt_ids[tb.prompt_off[i] : tb.prompt_off[i + 1]]
        y = tb.response_ids[tb.response_off[i] : tb.response_off[i + 1]]
        full = torch.from_numpy(np.concatenate([p, y]).astype(np.int64))[None]
        with torch.no_grad():
            logits = m(full).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits / temperature, -1).gather(
            1, torch.as_tensor(y, dtype=torch.long)[:, None]
        )
        out[tb.response_off[i] : tb.response_off[i + 1]] = lp.squeeze(1)
    return out


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_trains_and_matches_hf(tmp_path, kind):
    from stages.trainer.packing import shard_samples, to_token_batch

    path = make_family(str(tmp_path / kind), kind)
    with pytest.raises(ValueError):  # megatron refuses it: the point of the fsdp backend
        from transformers import AutoConfig

        hf_mapping.check_supported(AutoConfig.from_pretrained(path))
    batches = [make_batch(2, 4, seed=i, vocab=TINY["vocab_size"]) for i in range(2)]
    tr = _trainer(path, str(tmp_path / "run"), batches)
    tb = to_token_batch(batches[0])
    be = tr.backend
    got = be.logprobs(tb, be.pack(tb, shard_samples(tb, 1)[0]))
    want = _hf_logprobs(path, tb, 0.7)
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    from stages.trainer.fsdp_model import local

    before = {n: local(p).detach().clone() for n, p in be.policy.model.lm.named_parameters()}
    m = tr.step()
    assert m["optimizer/skipped"] == 0 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    moved = [
        n for n, p in be.policy.model.lm.named_parameters() if not torch.equal(local(p).detach(), before[n])
    ]
    assert len(moved) == len(before)  # every parameter trained
    assert m["version"] == 1
