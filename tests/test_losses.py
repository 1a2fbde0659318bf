"""Advantages, surrogate losses and off-policy corrections against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from stages.trainer import losses as L
from stages.trainer.config import LossConfig

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol), (a, b)


def test_grpo_advantages():
    # group 0: rewards 1, 0 -> mean .5, std .5 -> +1, -1; group 1: 2, 2, 5 -> mean 3, std sqrt(2)
    adv = L.advantages(T([1.0, 0.0, 2.0, 2.0, 5.0]), T([0, 0, 1, 1, 1]), "grpo")
    s = math.sqrt(2.0)
    close(adv, [1.0, -1.0, -1 / s, -1 / s, 2 / s])
    close(
        L.advantages(T([1.0, 0.0, 2.0, 2.0, 5.0]), T([0, 0, 1, 1, 1]), "grpo", std_norm=False),
        [0.5, -0.5, -1.0, -1.0, 2.0],
    )
    close(L.advantages(T([3.0, 3.0]), T([0, 0]), "grpo"), [0.0, 0.0])  # equal rewards: no signal, no NaN


def test_reinforce_pp_advantages():
    # no baseline: whiten [1, 0, 0, 3] (mean 1, std sqrt(1.5))
    s = math.sqrt(1.5)
    close(L.advantages(T([1.0, 0.0, 0.0, 3.0]), T([0, 0, 1, 1]), "reinforce_pp"), [0, -1 / s, -1 / s, 2 / s])
    # group baseline first: [.5, -.5, -1.5, 1.5] -> mean 0, std sqrt(1.25)
    s = math.sqrt(1.25)
    close(
        L.advantages(T([1.0, 0.0, 0.0, 3.0]), T([0, 0, 1, 1]), "reinforce_pp_baseline"),
        [0.5 / s, -0.5 / s, -1.5 / s, 1.5 / s],
    )


def test_ppo_surrogate_and_clip():
    logp = T([math.log(1.5), math.log(0.5), math.log(1.1)])
    old = T([0.0, 0.0, 0.0])
    loss, clipped = L.ppo_surrogate(logp, old, T([1.0, -1.0, 1.0]), 0.2, 0.28)
    # r=1.5, A=1: min(1.5, 1.28) = 1.28; r=.5, A=-1: min(-.5, -.8) = -.8; r=1.1: 1.1
    close(loss, [-1.28, 0.8, -1.1])
    assert clipped.tolist() == [True, True, False]


def test_token_tis_and_mis():
    old, roll = T([0.0, 0.0, 0.0, 0.0]), T([0.0, math.log(4.0), -math.log(3.0), -math.log(1.5)])
    mask, seq = T([1.0, 1.0, 1.0, 0.0]), T([0, 0, 1, 1])
    # ratios exp(old - rollout): 1, 0.25, 3, 1.5
    w, out = L.correction_weights(old, roll, mask, seq, 2, LossConfig(correction="tis", tis_cap=2.0))
    close(w[:3], [1.0, 0.25, 2.0])
    assert out.tolist() == [False, False, True, False]
    w, _ = L.correction_weights(
        old, roll, mask, seq, 2, LossConfig(correction="tis", tis_cap=2.0, tis_low=0.5)
    )
    close(w[:3], [1.0, 0.5, 2.0])
    w, out = L.correction_weights(
        old, roll, mask, seq, 2, LossConfig(correction="mis", mis_low=0.5, mis_high=2.0)
    )
    close(w[:3], [1.0, 0.0, 0.0])
    assert out.tolist() == [False, True, True, False]
    w, _ = L.correction_weights(old, roll, mask, seq, 2, LossConfig(correction="decoupled", tis_cap=2.0))
    close(w[:3], [1.0, 0.25, 0.0])  # above the cap: dropped, not clamped


def test_sequence_level_corrections():
    old = T([0.0, 0.0, 0.0])
    roll = T([-math.log(2.0), -math.log(1.5), math.log(2.0)])  # token ratios 2, 1.5 | 0.5
    mask, seq = T([1.0, 1.0, 1.0]), T([0, 0, 1])
    w, _ = L.correction_weights(old, roll, mask, seq, 2, LossConfig(correction="seq_tis", tis_cap=2.0))
    close(w, [2.0, 2.0, 0.5])  # seq 0 ratio 3 capped at 2
    w, _ = L.correction_weights(
        old, roll, mask, seq, 2, LossConfig(correction="seq_mis", mis_low=0.4, mis_high=2.0)
    )
    close(w, [0.0, 0.0, 0.5])


def test_kl_estimators():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    d = math.log(2.0)
    close(L.kl_penalty(logp, ref, "k1"), [d])
    close(L.kl_penalty(logp, ref, "k2"), [0.5 * d * d])
    close(L.kl_penalty(logp, ref, "k3"), [0.5 + d - 1.0])
    close(L.kl_penalty(T([0.0]), T([20.0]), "low_var_kl"), [10.0])


def test_aggregation_token_vs_sample():
    per_tok, mask, seq = T([1.0, 3.0, 10.0]), T([1.0, 1.0, 1.0]), T([0, 0, 1])
    num, den = L.aggregate(per_tok, mask, seq, 2, "token")
    close(num / den, 14.0 / 3)
    num, den = L.aggregate(per_tok, mask, seq, 2, "sample")
    close(num / den, (2.0 + 10.0) / 2)


def test_policy_loss_tis_gradient_and_stats():
    cfg = LossConfig(correction="tis", tis_cap=2.0, eps_clip=0.2, eps_clip_high=0.2)
    logp = T([-1.0, -2.0]).requires_grad_()
    old = logp.detach().clone()  # single PPO epoch: ratio 1
    roll = T([-1.0 - math.log(3.0), -2.0 + math.log(2.0)])  # TIS ratios 3 -> 2 (capped), 0.5
    num, den, st = L.policy_loss(logp, old, roll, T([1.0, -1.0]), T([1.0, 1.0]), T([0, 1]), 2, cfg)
    (num / den).backward()
    # d/dlogp of -w r A at r=1 is -w A: [-2 * 1, -0.5 * -1] / 2 tokens
    close(logp.grad, [-1.0, 0.25])
    close(st["sum/tis_weight"], 2.5)
    close(st["min/tis_weight"], 0.5)
    close(st["max/tis_weight"], 2.0)
    close(st["sum/tis_clipped"], 1.0)
    close(st["sum/abs_logp_diff"], math.log(3.0) + math.log(2.0))


def test_gspo_sequence_ratio():
    logp = T([math.log(2.0), 0.0, 0.0]).requires_grad_()
    old = T([0.0, 0.0, 0.0])
    loss, clipped = L.gspo_surrogate(
        logp, old, T([1.0, 1.0, 1.0]), T([1.0, 1.0, 1.0]), T([0, 0, 1]), 2, 0.5, 0.5
    )
    s = math.sqrt(2.0)  # geometric mean of the token ratios (2, 1)
    close(loss, [-s, -s, -1.0])
    assert not clipped.any()
    loss[:2].sum().backward()
    close(logp.grad[:2], [-s / 2 * 2, -s / 2 * 2])  # each token: d s/d logp_t = s / |y|, two tokens


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="length mismatch"):
        L.policy_loss(T([0.0]), T([0.0, 0.0]), T([0.0]), T([0.0]), T([1.0]), T([0]), 1, LossConfig())
    with pytest.raises(ValueError, match="empty"):
        L.advantages(T([]), T([]), "grpo")


def test_failed_samples_do_not_move_their_group_baseline():
    # group 0: three real rewards of 1 and a verifier crash (placeholder 0); group 1: 0 and 1
    r, g = T([1.0, 1.0, 1.0, 0.0, 0.0, 1.0]), T([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False, True, True])
    close(L.advantages(r, g, "grpo", valid=valid), [0.0, 0.0, 0.0, 0.0, -1.0, 1.0])
    close(L.advantages(r, g, "grpo", std_norm=False, valid=valid), [0.0, 0.0, 0.0, 0.0, -0.5, 0.5])
    # without the mask the crash would reward the three correct answers (the bug this guards against)
    assert float(L.advantages(r, g, "grpo")[0]) > 0.5
    # reinforce_pp: whitened over the valid samples only (4 ones and a zero), the failed one gets 0
    adv = L.advantages(r, g, "reinforce_pp", valid=valid)
    assert float(adv[3]) == 0.0
    close(adv[[0, 1, 2, 4, 5]], [0.5, 0.5, 0.5, -2.0, 0.5])


def test_dual_clip_caps_negative_advantage_tokens():
    """The issue's numbers: A = -1 and ratio e^3 give a loss of e^3 = 20.09; dual-clip c = 3 caps it
    at 3. Positive advantages and in-range ratios are untouched."""
    old = torch.zeros(3)
    logp = torch.tensor([3.0, 3.0, 0.05])
    adv = torch.tensor([-1.0, 1.0, -1.0])
    plain, _ = L.ppo_surrogate(logp, old, adv, 0.2, 0.28)
    dual, clipped = L.ppo_surrogate(logp, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert plain[0].item() == pytest.approx(math.exp(3.0), rel=1e-6) and dual[0].item() == pytest.approx(3.0)
    assert dual[1] == plain[1] and dual[2] == plain[2]
    assert clipped.tolist() == [True, True, False]


def test_grpo_std_conventions():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    assert L.advantages(r, g, std="population").tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert L.advantages(r, g, std="unbiased").tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    with pytest.raises(ValueError, match="grpo_std"):
        L.advantages(r, g, std="sample")
