"""The fused LM head (stages/trainer/lm_head.py) and the packed-row layout, on CPU: logprobs, entropy
and every gradient against a float64 full-logits reference; the trainer's entropy metric against an
HF forward when a micro-batch is one packed row (megatron's cross entropy overwrote its input there);
and the packed row with cu_seqlens against the block-mask rows on the same tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.trainer.lm_head import head_logprobs


def _reference(h, w, y, temperature):
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ls = torch.log_softmax((hr @ wr.T) / temperature, -1)
    return hr, wr, ls.gather(1, y[:, None]).squeeze(1), -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_head_matches_full_logits(dtype, chunk):
    torch.manual_seed(0)
    t, d, v, temperature = 37, 16, 101, 0.7
    h = torch.randn(t, d).to(dtype).requires_grad_()
    w = torch.randn(v, d).to(dtype).requires_grad_()
    y = torch.randint(0, v, (t,))
    g_lp, g_ent = torch.randn(t), torch.randn(t)
    lp, ent = head_logprobs(h, w, y, temperature=temperature, entropy=True, entropy_grad=True, chunk=chunk)
    (lp * g_lp + ent * g_ent).sum().backward()
    hr, wr, ref_lp, ref_ent = _reference(h, w, y, temperature)
    (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32  # fp32 logprobs even from bf16 inputs
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradients are rounded to bf16
    for got, want in ((h.grad, hr.grad), (w.grad, wr.grad)):
        assert float((got.double() - want).norm() / want.norm()) < tol


def test_entropy_without_grad_and_logprob_only():
    torch.manual_seed(1)
    h, w = torch.randn(9, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (9,))
    lp, ent = head_logprobs(h, w, y, entropy=True, entropy_grad=False, chunk=4)
    assert not ent.requires_grad  # a metric: no graph, no gradient
    lp.sum().backward()
    hr, wr, ref_lp, _ = _reference(h, w, y, 1.0)
    ref_lp.sum().backward()
    assert torch.allclose(h.grad.double(), hr.grad, atol=1e-5)
    assert torch.allclose(w.grad.double(), wr.grad, atol=1e-5)
    lp2, none = head_logprobs(h, w, y)
    assert none is None and torch.allclose(lp2, lp)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden"):
        head_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        head_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), chunk=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from stages.trainer.testing import make_tiny_hf

    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _one_group(n_samples: int, seed: int):
    from buffer.record import Sample

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 512, 5)
    return [
        Sample.build(
            uid=f"u{seed}-{i}",
            group_id=f"g{seed}",
            group_index=i,
            group_size=n_samples,
            prompt_ids=prompt,
            response_ids=rng.integers(0, 512, 6),
            rollout_logprobs=-np.full(6, 5.0),
            versions=np.zeros(6),
            loss_mask=np.ones(6, np.uint8),
            reward=float(i % 2),
        )
        for i in range(n_samples)
    ]


def test_entropy_metric_of_a_one_row_micro_batch_is_the_real_entropy(model_path, tmp_path):
    """A micro-batch of one packed row: the entropy metric equals HF's softmax entropy (megatron's
    vocab_parallel_cross_entropy used to overwrite the logits in place there, giving the entropy of
    the probabilities instead: ~6.2 where the answer was ~1.3-2.6)."""
    from trainer_setup import make_trainer
    from transformers import AutoModelForCausalLM

    from buffer.record import samples_to_batch
    from pipeline.config import RunConfig
    from stages.trainer.testing import ListSource

    samples = _one_group(2, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ents = []
    with torch.no_grad():
        for s in samples:
            p, y = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
            ls = torch.log_softmax(hf(torch.tensor([p + y])).logits[0], -1)[len(p) - 1 : -1]
            ents.append(-(ls.exp() * ls).sum(-1))
    want = float(torch.cat(ents).mean())
    cfg = RunConfig()
    # 16-token rows, one row per micro-batch: the case where the transpose of [1, s, V] is contiguous
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens, cfg.trainer.lr = 1, 16, 0.0
    tr = make_trainer(cfg, ListSource([samples_to_batch(samples)]), model_path, str(tmp_path))
    got = tr.step()["entropy"]
    assert 0 < want < math.log(512)
    assert got == pytest.approx(want, rel=1e-4)


def test_packed_row_matches_block_mask_rows(model_path):
    """The varlen layout (one row, cu_seqlens; on CPU each segment through causal SDPA) and the
    block-mask rows give the same logprobs on the same tokens."""
    from buffer.record import samples_to_batch
    from stages.trainer.attention import VarlenAttention
    from stages.trainer.model import (
        build_policy,
        causal_block_mask,
        head_weight,
        init_distributed,
        packed_row_params,
    )
    from stages.trainer.packing import pack, to_token_batch
    from stages.trainer.testing import make_samples

    init_distributed()
    tb = to_token_batch(
        samples_to_batch(make_samples(3, 3, seed=9, prompt_len=(3, 20), response_len=(2, 30)))
    )
    everyone = list(range(tb.n))
    out = {}
    for attention in ("sdpa", "varlen"):
        policy = build_policy(model_path, attention="sdpa", output_hidden=True, ddp=False)
        if attention == "varlen":  # the CPU has no varlen kernel: put the varlen module in by hand
            for layer in policy.model.decoder.layers:
                old = layer.self_attention.core_attention
                new = VarlenAttention(
                    config=old.config,
                    layer_number=old.layer_number,
                    attn_mask_type=old.attn_mask_type,
                    attention_type="self",
                )
                layer.self_attention.core_attention = new
        mbs = pack(tb, everyone, 64, packed_row=attention == "varlen")
        lp = torch.zeros(len(tb.rollout_logprobs))
        with torch.no_grad():
            for mb in mbs:
                pos = torch.arange(mb.tokens.shape[1])[None].expand_as(mb.tokens)
                if attention == "varlen":
                    assert mb.tokens.shape[0] == 1 and mb.cu_seqlens[-1] == mb.tokens.shape[1]
                    h = policy.model(
                        mb.tokens, pos, None, packed_seq_params=packed_row_params(mb, "varlen", "cpu")
                    )
                else:
                    h = policy.model(mb.tokens, pos, causal_block_mask(mb.segments))
                pick = mb.resp_pos
                lp[mb.tok_index] = head_logprobs(
                    h.reshape(-1, h.shape[-1])[pick], head_weight(policy.model), mb.targets.reshape(-1)[pick]
                )[0]
        out[attention] = (lp, len(mbs))
    assert out["varlen"][1] < out["sdpa"][1] * 2  # rows filled up to the budget, not one per sequence
    assert torch.allclose(out["varlen"][0], out["sdpa"][0], atol=1e-5)
