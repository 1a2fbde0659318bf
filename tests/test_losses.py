"""Advantages, surrogate losses and off-policy corrections against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from stages.trainer import advantages as A
from stages.trainer import losses as L
from stages.trainer.config import LossConfig

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol), (a, b)


def test_grpo_advantages():
    # population std (grpo_std=population, before #16): group 0: rewards 1, 0 -> mean .5, std .5 -> +1, -1;
    # group 1: 2, 2, 5 -> mean 3, std sqrt(2)
    adv = A.advantages(T([1.0, 0.0, 2.0, 2.0, 5.0]), T([0, 0, 1, 1, 1]), "grpo", std="population")
    s = math.sqrt(2.0)
    close(adv, [1.0, -1.0, -1 / s, -1 / s, 2 / s])
    # unbiased (the default, slime / verl): group 0 std sqrt(.5); group 1 var (1 + 1 + 4) / 2 = 3
    adv = A.advantages(T([1.0, 0.0, 2.0, 2.0, 5.0]), T([0, 0, 1, 1, 1]), "grpo")
    s = math.sqrt(3.0)
    close(adv, [1 / math.sqrt(2.0), -1 / math.sqrt(2.0), -1 / s, -1 / s, 2 / s])
    close(
        A.advantages(T([1.0, 0.0, 2.0, 2.0, 5.0]), T([0, 0, 1, 1, 1]), "grpo", std_norm=False),
        [0.5, -0.5, -1.0, -1.0, 2.0],
    )
    close(A.advantages(T([3.0, 3.0]), T([0, 0]), "grpo"), [0.0, 0.0])  # equal rewards: no signal, no NaN


def test_reinforce_pp_advantages():
    # the per-sample convention (reinforce_pp_whiten=sample, before #16), population std
    # no baseline: whiten [1, 0, 0, 3] (mean 1, std sqrt(1.5))
    s = math.sqrt(1.5)
    close(A.advantages(T([1.0, 0.0, 0.0, 3.0]), T([0, 0, 1, 1]), "reinforce_pp"), [0, -1 / s, -1 / s, 2 / s])
    # group baseline first: [.5, -.5, -1.5, 1.5] -> mean 0, std sqrt(1.25)
    s = math.sqrt(1.25)
    close(
        A.advantages(T([1.0, 0.0, 0.0, 3.0]), T([0, 0, 1, 1]), "reinforce_pp_baseline"),
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
        A.advantages(T([]), T([]), "grpo")


def test_failed_samples_do_not_move_their_group_baseline():
    # group 0: three real rewards of 1 and a verifier crash (placeholder 0); group 1: 0 and 1
    r, g = T([1.0, 1.0, 1.0, 0.0, 0.0, 1.0]), T([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False, True, True])
    close(A.advantages(r, g, "grpo", valid=valid, std="population"), [0.0, 0.0, 0.0, 0.0, -1.0, 1.0])
    h = 1 / math.sqrt(2.0)
    close(A.advantages(r, g, "grpo", valid=valid), [0.0, 0.0, 0.0, 0.0, -h, h])
    close(A.advantages(r, g, "grpo", std_norm=False, valid=valid), [0.0, 0.0, 0.0, 0.0, -0.5, 0.5])
    # without the mask the crash would reward the three correct answers (the bug this guards against)
    assert float(A.advantages(r, g, "grpo", std="population")[0]) > 0.5
    # reinforce_pp: whitened over the valid samples only (4 ones and a zero), the failed one gets 0
    adv = A.advantages(r, g, "reinforce_pp", valid=valid)
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
    assert A.advantages(r, g, std="population").tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert A.advantages(r, g, std="unbiased").tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    with pytest.raises(ValueError, match="grpo_std"):
        A.advantages(r, g, std="sample")


# -- conventions (issue #16): each key's default is slime's, the old behaviour is one key away -------
def test_convention_defaults_are_slimes():
    cfg = LossConfig()
    assert (cfg.grpo_std, cfg.reinforce_pp_whiten, cfg.aggregation, cfg.sample_mean_denominator) == (
        "unbiased",
        "token",
        "auto",
        "all",
    )
    assert L.aggregation_mode(cfg) == "token"
    assert L.aggregation_mode(LossConfig(advantage="gspo")) == "sample"
    assert L.aggregation_mode(LossConfig(advantage="gspo", aggregation="token")) == "token"
    assert L.aggregation_mode(LossConfig(aggregation="sample")) == "sample"


def test_token_advantages_grpo_broadcasts_the_unbiased_group_advantage():
    # rewards [1, 0] in one group, lengths [1, 3]: +-1/sqrt(2) on every token (population: +-1)
    r, g, seq, mask = T([1.0, 0.0]), T([0, 0]), T([0, 1, 1, 1]), T([1.0, 1.0, 1.0, 1.0])
    h = 1 / math.sqrt(2.0)
    close(A.token_advantages(r, g, seq, mask, LossConfig()), [h, -h, -h, -h])
    close(A.token_advantages(r, g, seq, mask, LossConfig(grpo_std="population")), [1.0, -1.0, -1.0, -1.0])
    # a masked token gets 0 (it is not trained on)
    close(A.token_advantages(r, g, seq, T([1.0, 1.0, 0.0, 1.0]), LossConfig()), [h, -h, 0.0, -h])


def test_reinforce_pp_token_whitening_issue_example():
    # rewards [1, 0], lengths [1, 3]: token returns [1, 0, 0, 0], mean .25, squared deviations
    # .5625 + 3 * .0625 = .75, Bessel var .75 / 3 = .25, std .5 -> [1.5, -.5, -.5, -.5]
    r, g, seq, mask = T([1.0, 0.0]), T([0, 1]), T([0, 1, 1, 1]), T([1.0, 1.0, 1.0, 1.0])
    cfg = LossConfig(advantage="reinforce_pp")
    close(A.token_advantages(r, g, seq, mask, cfg), [1.5, -0.5, -0.5, -0.5])
    # the per-sample convention: two samples, mean .5, population std .5 -> +-1 on every token
    old = LossConfig(advantage="reinforce_pp", reinforce_pp_whiten="sample")
    close(A.token_advantages(r, g, seq, mask, old), [1.0, -1.0, -1.0, -1.0])


def test_reinforce_pp_token_whitening_masks_and_invalid_samples():
    # a masked token and a FAILED sample (reward 5, two tokens) leave the statistics as in the issue example
    r, g = T([1.0, 0.0, 5.0]), T([0, 1, 2])
    seq, mask = T([0, 1, 1, 1, 1, 2, 2]), T([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    valid = torch.tensor([True, True, False])
    adv = A.token_advantages(r, g, seq, mask, LossConfig(advantage="reinforce_pp"), valid=valid)
    close(adv, [1.5, -0.5, 0.0, -0.5, -0.5, 0.0, 0.0])
    # one trained token: no Bessel correction, variance 0, advantage 0 (not NaN)
    one = A.token_advantages(T([3.0]), T([0]), T([0]), T([1.0]), LossConfig(advantage="reinforce_pp"))
    close(one, [0.0])


def test_reinforce_pp_baseline_token_whitening():
    # rewards [1, 0 | 0, 3] in two groups -> r - mean_group = [.5, -.5, -1.5, 1.5]; lengths [2, 1, 1, 2]:
    # token returns [.5, .5, -.5, -1.5, 1.5, 1.5], mean 2/6 = 1/3, deviations [1, 1, -5, -11, 7, 7] / 6,
    # squared sum 246/36, Bessel var 246/36/5 = 41/30
    r, g = T([1.0, 0.0, 0.0, 3.0]), T([0, 0, 1, 1])
    seq, mask = T([0, 0, 1, 2, 3, 3]), torch.ones(6)
    adv = A.token_advantages(r, g, seq, mask, LossConfig(advantage="reinforce_pp_baseline"))
    sd = math.sqrt(41 / 30)
    close(adv, [1 / 6 / sd, 1 / 6 / sd, -5 / 6 / sd, -11 / 6 / sd, 7 / 6 / sd, 7 / 6 / sd])


def _grad(cfg, adv, seq, n, mask=None, logp_ref=None):
    """Gradient of loss = num / den at ratio 1 (logp = logp_old = logp_rollout = 0) and the (num, den)."""
    t = len(seq)
    logp = torch.zeros(t, requires_grad=True)
    mask = torch.ones(t) if mask is None else mask
    num, den, st = L.policy_loss(
        logp, torch.zeros(t), torch.zeros(t), adv, mask, seq, n, cfg, logp_ref=logp_ref
    )
    (num / den).backward()
    return logp.grad, num.detach(), den, st


def test_gspo_aggregates_per_sequence_by_default():
    """The issue's numbers: lengths [1, 3], A = 1, ratio 1. Per sequence (GSPO paper, verl, slime):
    each sequence weighs 1/2, spread over its tokens -> [-.5, -1/6, -1/6, -1/6]; the token mean
    (aggregation=token, before #16) gives every token 1/4."""
    seq, adv = T([0, 1, 1, 1]), torch.ones(4)
    grad, num, den, _ = _grad(LossConfig(advantage="gspo", correction="none"), adv, seq, 2)
    close(grad, [-0.5, -1 / 6, -1 / 6, -1 / 6])
    close(num / den, -1.0)
    grad, *_ = _grad(LossConfig(advantage="gspo", correction="none", aggregation="token"), adv, seq, 2)
    close(grad, [-0.25, -0.25, -0.25, -0.25])
    # grpo keeps the token mean under auto
    grad, *_ = _grad(LossConfig(correction="none"), adv, seq, 2)
    close(grad, [-0.25, -0.25, -0.25, -0.25])


def test_sample_mean_denominator():
    # samples: 0 = two tokens (losses 1, 3), 1 = one token (10), 2 = one fully masked token
    per_tok, mask, seq = T([1.0, 3.0, 10.0, 7.0]), T([1.0, 1.0, 1.0, 0.0]), T([0, 0, 1, 2])
    num, den = L.aggregate(per_tok, mask, seq, 3, "sample", "all")  # slime: every sample of the step
    close((num, den), (12.0, 3.0))
    num, den = L.aggregate(per_tok, mask, seq, 3, "sample", "unmasked")  # before #16
    close((num, den), (12.0, 2.0))
    # through policy_loss at ratio 1 (loss = -A per token): gradient -A_t / #tokens of its sample / count
    adv = T([1.0, 1.0, -1.0, 5.0])
    grad, _, den, _ = _grad(LossConfig(aggregation="sample", correction="none"), adv, seq, 3, mask)
    close(den, 3.0)
    close(grad, [-1 / 6, -1 / 6, 1 / 3, 0.0])
    cfg = LossConfig(aggregation="sample", sample_mean_denominator="unmasked", correction="none")
    grad, _, den, _ = _grad(cfg, adv, seq, 3, mask)
    close(den, 2.0)
    close(grad, [-0.25, -0.25, 0.5, 0.0])
    with pytest.raises(ValueError, match="sample_mean_denominator"):
        L.aggregate(per_tok, mask, seq, 3, "sample", "some")


# -- numerical safety -----------------------------------------------------------------------------------
def test_low_var_kl_gradient_is_finite_for_extreme_log_ratios():
    # d = logp - ref = [-100, 100, -2]: exp(-d) overflows fp32 at d = -100 (the value clamp then gave a
    # NaN gradient); clamped to +-10 with zero gradient; d = -2: e^2 - 3, gradient 1 - e^2
    logp = torch.zeros(3, requires_grad=True)
    kl = L.kl_penalty(logp, T([100.0, -100.0, 2.0]), "low_var_kl")
    kl.sum().backward()
    close(kl, [10.0, 10.0, math.exp(2.0) - 3.0])
    close(logp.grad, [0.0, 0.0, 1.0 - math.exp(2.0)])
    # where nothing saturates low_var_kl equals k3 (value and gradient)
    x = torch.zeros(1, requires_grad=True)
    L.kl_penalty(x, T([2.0]), "k3").backward()
    close(L.kl_penalty(torch.zeros(1), T([2.0]), "k3"), [math.exp(2.0) - 3.0])
    close(x.grad, [1.0 - math.exp(2.0)])


INF = math.inf


@pytest.mark.parametrize(
    "old_m, roll_m, ref_m",
    [
        (-INF, -INF, -INF),  # masked token: PPO log-ratio logp - old = +inf, rollout logprob -inf
        (-1.0, -INF, -1.0),  # only the engine's logprob is -inf (off-policy log-ratio +inf)
        (-INF, -1.0, -1.0),  # only the PPO / KL log-ratios are +inf
    ],
)
@pytest.mark.parametrize("advantage", ["grpo", "gspo"])
@pytest.mark.parametrize("correction", ["none", "tis", "mis", "seq_tis", "seq_mis", "decoupled"])
def test_masked_extreme_token_leaves_loss_and_gradient_finite(old_m, roll_m, ref_m, advantage, correction):
    """Token 1 is masked and holds inf log-ratios. Tokens 0 and 2 (samples 0, 1) are at ratio 1 with
    A = [1, -1] and no KL (logp = ref) or entropy signal: loss -1 + 1 = 0 over 2 tokens or 2 samples,
    gradient [-1/2, 0, 1/2]. Before #16: inf * 0 = NaN in the loss."""
    cfg = LossConfig(
        advantage=advantage,
        correction=correction,
        kl_coef=0.1,
        kl_type="low_var_kl",
        entropy_coef=0.01,
        mis_low=0.5,
        mis_high=2.0,
    )
    logp = T([-1.0, -1.0, -2.0]).requires_grad_()
    old, roll, ref = T([-1.0, old_m, -2.0]), T([-1.0, roll_m, -2.0]), T([-1.0, ref_m, -2.0])
    mask, seq, adv = T([1.0, 0.0, 1.0]), T([0, 0, 1]), T([1.0, 1.0, -1.0])
    num, den, st = L.policy_loss(
        logp, old, roll, adv, mask, seq, 2, cfg, logp_ref=ref, entropy=torch.zeros(3)
    )
    (num / den).backward()
    close(num / den, 0.0)
    close(logp.grad, [-0.5, 0.0, 0.5])
    assert all(torch.isfinite(v).all() for v in st.values()), st
    close(st["sum/kl"], 0.0)
    close(st["sum/abs_logp_diff"], 0.0)


def test_masked_extreme_token_with_k3_and_dual_clip():
    cfg = LossConfig(kl_coef=0.5, kl_type="k3", dual_clip=3.0)
    logp = T([-1.0, 0.0]).requires_grad_()
    num, den, _ = L.policy_loss(
        logp,
        T([-1.0, -INF]),
        T([-1.0, -INF]),
        T([-1.0, -1.0]),
        T([1.0, 0.0]),
        T([0, 1]),
        2,
        cfg,
        logp_ref=T([-1.0, INF]),
    )
    (num / den).backward()
    close(num / den, 1.0)  # token 0 alone: -r A = 1
    close(logp.grad, [1.0, 0.0])


# -- metrics --------------------------------------------------------------------------------------------
def test_kl_value_stat_sums_the_estimate_over_trained_tokens():
    # d = logp - ref = [ln 2, (masked), 0]: k1 sums to ln 2, low_var_kl to .5 + ln 2 - 1; logged whatever
    # kl_coef is (the loss only carries it when kl_coef > 0)
    d = math.log(2.0)
    logp, ref = T([math.log(0.5), -3.0, -1.0]), T([math.log(0.25), -INF, -1.0])
    mask, seq, z = T([1.0, 0.0, 1.0]), T([0, 0, 1]), torch.zeros(3)
    for kind, want in (("k1", d), ("low_var_kl", 0.5 + d - 1.0)):
        cfg = LossConfig(kl_type=kind, correction="none")
        _, _, st = L.policy_loss(logp, logp, logp, z, mask, seq, 2, cfg, logp_ref=ref)
        close(st["sum/kl"], want)
        cfg = LossConfig(kl_type=kind, kl_coef=2.0, correction="none")
        num, den, _ = L.policy_loss(logp, logp, logp, z, mask, seq, 2, cfg, logp_ref=ref)
        close(num / den, 2.0 * want / 2)  # kl_coef * sum / 2 trained tokens
    _, _, st = L.policy_loss(logp, logp, logp, z, mask, seq, 2, LossConfig())
    assert "sum/kl" not in st


def test_trainer_sample_mean_counts_every_sample_and_logs_kl(tmp_path):
    """Through the CPU trainer at lr 0 (ratio 1, policy = reference): with sample-mean aggregation and no
    correction the loss is -sum_i A_i / #samples; `all` counts the ABORTED sample without response
    tokens (in no micro-batch), `unmasked` does not. kl/value is logged and 0 (policy = reference)."""
    import msgspec
    from trainer_setup import make_trainer

    from buffer.record import Status, samples_to_batch
    from pipeline.config import RunConfig
    from stages.trainer.packing import to_token_batch
    from stages.trainer.testing import ListSource, make_samples, make_tiny_hf

    samples = make_samples(2, 3, seed=3)
    samples[2] = msgspec.structs.replace(
        samples[2], response_ids=b"", rollout_logprobs=b"", versions=b"", loss_mask=b"", status=Status.ABORTED
    )
    batch = samples_to_batch(samples)
    cfg = RunConfig()
    cfg.trainer.batch_groups = 2
    cfg.trainer.loss = LossConfig(
        advantage="reinforce_pp", aggregation="sample", correction="none", kl_coef=0.1
    )
    cfg.trainer.lr = 0.0
    tr = make_trainer(cfg, ListSource([]), make_tiny_hf(str(tmp_path / "m")), str(tmp_path / "run"))
    tb = to_token_batch(batch)
    adv = A.token_advantages(
        tb.rewards, A.group_ids_to_index(tb.group_ids), tb.seq, tb.mask, cfg.trainer.loss, valid=tb.trainable
    )
    # every packed sample has trained tokens (make_samples masks at most the last one); A is constant
    # over a sample's tokens here (no KL in the reward, gamma 1), so its sample mean is A_i
    per_sample = torch.zeros(tb.n).index_add(0, tb.seq, adv * tb.mask) / torch.bincount(
        tb.seq, weights=tb.mask, minlength=tb.n
    ).clamp(min=1.0)
    assert tb.n == 6 and abs(float(per_sample.sum())) > 0.1  # /6 and /5 differ by far more than 1e-4
    m = tr.train_on_batch(batch)
    assert m["loss"] == pytest.approx(-float(per_sample.sum()) / 6, rel=1e-4, abs=1e-6)
    assert m["kl/value"] == pytest.approx(0.0, abs=1e-6)
    tr.tc.loss.sample_mean_denominator = "unmasked"
    m = tr.train_on_batch(batch)
    assert m["loss"] == pytest.approx(-float(per_sample.sum()) / 5, rel=1e-4, abs=1e-6)
