"""REINFORCE++ as the paper and slime define it: the token-level k1 KL to the reference in the reward,
discounted returns (trainer.loss.gamma), token whitening; hand-computed examples, and the trainer
building the reference and feeding the KL into the advantage."""

from __future__ import annotations

import math

import pytest
import torch

from stages.trainer import advantages as A
from stages.trainer.config import LossConfig

T = torch.tensor


def close(a, b, tol=1e-6):
    assert torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol), (a, b)


def test_discounted_returns_with_kl_in_the_reward():
    # one sample, reward 1, k1 = [.2, -.4, 1.0], coefficient .1: token rewards [-.02, .04, -.1 + 1]
    r, seq, mask, kl = T([1.0]), T([0, 0, 0]), T([1.0, 1.0, 1.0]), T([0.2, -0.4, 1.0])
    close(A.reinforce_pp_returns(r, seq, mask, 1.0), [1.0, 1.0, 1.0])  # gamma 1, no KL: today's G
    close(A.reinforce_pp_returns(r, seq, mask, 0.5), [0.25, 0.5, 1.0])
    close(A.reinforce_pp_returns(r, seq, mask, 1.0, kl=kl, kl_coef=0.1), [0.92, 0.94, 0.9])
    # gamma .5: G3 = .9, G2 = .04 + .5 * .9 = .49, G1 = -.02 + .5 * .49 = .225
    close(A.reinforce_pp_returns(r, seq, mask, 0.5, kl=kl, kl_coef=0.1), [0.225, 0.49, 0.9])


def test_masked_tokens_are_not_steps_and_carry_nothing():
    # trained tokens 0 and 2 of four; the masked ones hold a KL of 9 and inf (ignored). Reward 1 goes on
    # the last trained token: r = [-.02, 1 + .04]; gamma .5 over trained tokens: G = [-.02 + .52, 1.04]
    r, seq, mask = T([1.0]), T([0, 0, 0, 0]), T([1.0, 0.0, 1.0, 0.0])
    kl = T([0.2, 9.0, -0.4, math.inf])
    close(A.reinforce_pp_returns(r, seq, mask, 0.5, kl=kl, kl_coef=0.1), [0.5, 0.0, 1.04, 0.0])
    # a FAILED sample (valid False) gets neither reward nor KL
    got = A.reinforce_pp_returns(T([1.0, 7.0]), T([0, 1, 1]), T([1.0, 1.0, 1.0]), 0.5, valid=T([True, False]))
    close(got, [1.0, 0.0, 0.0])


def test_token_advantages_whiten_the_discounted_kl_returns():
    # sample A: 1 token, reward 1, k1 0; sample B: 3 tokens, reward 0, k1 [0, 0, .4]; coef .5, gamma .5:
    # B's rewards [0, 0, -.2] -> G_B = [-.05, -.1, -.2]; G = [1, -.05, -.1, -.2], mean .1625,
    # deviations [.8375, -.2125, -.2625, -.3625], squares sum .946875, Bessel var .946875 / 3 = .315625
    r, g, seq, mask = T([1.0, 0.0]), T([0, 1]), T([0, 1, 1, 1]), torch.ones(4)
    kl = T([0.0, 0.0, 0.0, 0.4])
    cfg = LossConfig(advantage="reinforce_pp", gamma=0.5, kl_in_reward_coef=0.5)
    sd = math.sqrt(0.315625 + 1e-8)
    close(
        A.token_advantages(r, g, seq, mask, cfg, kl=kl),
        [0.8375 / sd, -0.2125 / sd, -0.2625 / sd, -0.3625 / sd],
    )
    with pytest.raises(ValueError, match="kl_in_reward_coef"):  # the coefficient without the KL: refused
        A.token_advantages(r, g, seq, mask, cfg)


def test_baseline_subtracts_the_token_kl_undiscounted():
    # rewards [1, 0] in one group -> r - mean = [.5, -.5]; lengths [1, 2]; coef .5, k1 [.2, .4, -.2]:
    # G = [.5 - .1, -.5 - .2, -.5 + .1] = [.4, -.7, -.4], mean -7/30, deviations [19, -14, -5] / 30,
    # squares sum 582/900, Bessel var 582/1800
    r, g, seq, mask = T([1.0, 0.0]), T([0, 0]), T([0, 1, 1]), torch.ones(3)
    cfg = LossConfig(advantage="reinforce_pp_baseline", kl_in_reward_coef=0.5)
    sd = math.sqrt(582 / 1800 + 1e-8)
    got = A.token_advantages(r, g, seq, mask, cfg, kl=T([0.2, 0.4, -0.2]))
    close(got, [19 / 30 / sd, -14 / 30 / sd, -5 / 30 / sd])


def test_discounted_suffix_sum_matches_the_step_by_step_scan():
    x = torch.randn(3, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for w in (0.0, 0.97, 1.0):
        want, run = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(x.shape[1])):  # crosses chunk borders (128)
            run = x[:, t] + w * run
            want[:, t] = run
        close(A.discounted_suffix_sum(x, w), want, tol=1e-9)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(gamma=0.9), "gamma"),  # grpo has no per-token return
        (dict(advantage="gspo", kl_in_reward_coef=0.1), "kl_coef"),
        (
            dict(advantage="reinforce_pp", gamma=0.9, reinforce_pp_whiten="sample"),
            "reinforce_pp_whiten=token",
        ),
        (dict(advantage="reinforce_pp", lambd=0.9), "lambd"),
        (dict(advantage="reinforce_pp", gamma=1.5), r"\[0, 1\]"),
    ],
)
def test_combinations_without_a_meaning_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kw)


def test_trainer_feeds_the_reference_kl_into_the_advantage(tmp_path):
    """kl_in_reward_coef > 0 builds the reference. At the first step the policy is the reference, so the
    KL and the step equal those without it; at the second the policy has moved, kl/value > 0 and the
    advantages differ."""
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.testing import ListSource, make_batch, make_tiny_hf

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    batch = make_batch(2, 4, seed=7)
    out = {}
    for coef in (0.0, 1.0):
        cfg = RunConfig()
        cfg.trainer.batch_groups, cfg.trainer.lr = 2, 1e-2
        cfg.trainer.loss.advantage, cfg.trainer.loss.kl_in_reward_coef = "reinforce_pp", coef
        tr = make_trainer(cfg, ListSource([]), path, str(tmp_path / f"run{coef}"))
        assert (tr.backend.ref is not None) == (coef > 0)
        out[coef] = [tr.train_on_batch(batch) for _ in range(2)]
    (a1, a2), (b1, b2) = out[0.0], out[1.0]
    assert b1["kl/value"] == pytest.approx(0.0, abs=1e-6)
    assert b1["adv/abs_mean"] == pytest.approx(a1["adv/abs_mean"], rel=1e-6)
    assert b1["loss"] == pytest.approx(a1["loss"], rel=1e-5)
    assert b2["kl/value"] > 1e-4
    assert abs(b2["adv/abs_mean"] - a2["adv/abs_mean"]) > 1e-4
