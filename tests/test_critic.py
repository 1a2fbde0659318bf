"""advantage=ppo: GAE and the clipped value loss against hand-computed examples, and the critic trained
beside the policy (its value loss falls, it is checkpointed and resumed, unsupported layouts refused)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import RunConfig
from stages.trainer import advantages as A
from stages.trainer import losses as L
from stages.trainer.config import LossConfig, TrainerConfig
from stages.trainer.testing import ListSource, make_batch, make_tiny_hf

T = torch.tensor


def close(a, b, tol=1e-6):
    assert torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol), (a, b)


def test_gae_over_a_masked_sequence():
    # sample 0: tokens 0, 1, 3 trained (token 2 masked, its value 100 and reward never enter), reward 1 on
    # the last; V = [.5, .6, .8]; gamma .9, lambda .8 (gamma * lambda = .72):
    #   delta = [.9 * .6 - .5, .9 * .8 - .6, 1 - .8] = [.04, .12, .2]
    #   A = [.04 + .72 * .264, .12 + .72 * .2, .2] = [.23008, .264, .2];  R = A + V = [.73008, .864, 1.0]
    # sample 1: two tokens, reward 0, V = [.1, -.2]: delta = [.9 * -.2 - .1, .2] = [-.28, .2],
    #   A = [-.28 + .72 * .2, .2] = [-.136, .2];  R = [-.036, 0]
    seq = T([0, 0, 0, 0, 1, 1])
    mask = T([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    values = T([0.5, 0.6, 100.0, 0.8, 0.1, -0.2])
    reward = A.token_rewards(T([1.0, 0.0]), seq, mask)
    close(reward, [0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    adv, ret = A.gae(reward, values, seq, mask, 2, gamma=0.9, lambd=0.8)
    close(adv, [0.23008, 0.264, 0.0, 0.2, -0.136, 0.2])
    close(ret, [0.73008, 0.864, 0.0, 1.0, -0.036, 0.0])
    # gamma = lambda = 1 (slime's defaults): A_t = reward - V_t, R_t = reward on every trained token
    adv, ret = A.gae(reward, values, seq, mask, 2, gamma=1.0, lambd=1.0)
    close(adv, [0.5, 0.4, 0.0, 0.2, -0.1, 0.2])
    close(ret, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])


def test_ppo_advantages_with_kl_in_the_reward_and_whitening():
    # one sample, 2 tokens, reward 1, k1 [.5, -.5], coef .2: r = [-.1, 1.1]; V = [.3, .4], gamma = lambda = 1:
    # A = [-.1 + 1.1 - .3, 1.1 - .4] = [.7, .7]; R = [1.0, 1.1]
    seq, mask, values = T([0, 0]), T([1.0, 1.0]), T([0.3, 0.4])
    cfg = LossConfig(advantage="ppo", kl_in_reward_coef=0.2)
    adv, ret = A.ppo_advantages(T([1.0]), seq, mask, values, cfg, kl=T([0.5, -0.5]))
    close(adv, [0.7, 0.7])
    close(ret, [1.0, 1.1])
    # ppo_whiten=token: A = [.1, .6] -> mean .35, Bessel var .125 -> -+ .25 / sqrt(.125)
    cfg = LossConfig(advantage="ppo", ppo_whiten="token")
    adv, _ = A.ppo_advantages(T([1.0]), seq, mask, T([0.9, 0.4]), cfg)
    close(adv, [-0.25 / (0.125 + 1e-8) ** 0.5, 0.25 / (0.125 + 1e-8) ** 0.5])


def test_clipped_value_loss_and_gradient():
    # old values .5 everywhere, value_clip .2, returns [2, 2, 0]:
    #   V = 1.0: clipped .7 -> max((1 - 2)^2, (.7 - 2)^2) = 1.69, from the clipped term: gradient 0
    #   V = 0.0: clipped .3 -> max(4, 2.89) = 4, the unclipped term: gradient 2 (V - R) = -4
    #   V = 0.5: unclipped -> .25, gradient 2 (.5 - 0) = 1;   token mean 5.94 / 3 = 1.98
    values = T([1.0, 0.0, 0.5], requires_grad=True)
    cfg = LossConfig(advantage="ppo", value_clip=0.2)
    num, den, st = L.value_loss(
        values, T([0.5, 0.5, 0.5]), T([2.0, 2.0, 0.0]), torch.ones(3), T([0, 0, 1]), 2, cfg
    )
    assert float(num / den) == pytest.approx(1.98)
    (num / den).backward()
    close(values.grad, [0.0, -4 / 3, 1 / 3])
    assert float(st["sum/value_clipped"]) == 2.0  # |V - V_old| = .5 > .2 on the first two tokens
    # a masked token holding inf changes nothing
    v2 = T([1.0, 0.0, 0.5, float("inf")], requires_grad=True)
    num2, den2, _ = L.value_loss(
        v2, T([0.5] * 4), T([2.0, 2.0, 0.0, 0.0]), T([1.0, 1.0, 1.0, 0.0]), T([0, 0, 1, 1]), 2, cfg
    )
    assert float(num2 / den2) == pytest.approx(1.98)
    (num2 / den2).backward()
    close(v2.grad, [0.0, -4 / 3, 1 / 3, 0.0])


@pytest.mark.parametrize("kw", [dict(pp=2), dict(cp=2), dict(tp=2, sequence_parallel=True)])
def test_unsupported_critic_layouts_are_refused(kw):
    with pytest.raises(ValueError, match="advantage=ppo trains a critic"):
        TrainerConfig(loss=LossConfig(advantage="ppo"), **kw)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _ppo_cfg(**trainer):
    cfg = RunConfig()
    cfg.trainer.batch_groups = 2
    cfg.trainer.loss.advantage = "ppo"
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def test_critic_learns_the_returns(model_path, tmp_path):
    """Eight steps on one batch: the critic starts at V = 0 (so the first advantages are the rewards and
    the value loss is the share of tokens rewarded 1) and its value loss falls steadily."""
    from trainer_setup import make_trainer

    batch = make_batch(2, 4, seed=7)
    tr = make_trainer(_ppo_cfg(critic_lr=1e-3), ListSource([]), model_path, str(tmp_path))
    ms = [tr.train_on_batch(batch) for _ in range(8)]
    rewards = torch.tensor(batch.column("reward").to_pylist())
    lens = torch.tensor([sum(m) for m in batch.column("loss_mask").to_pylist()], dtype=torch.float32)
    rewarded = float((rewards * lens).sum() / lens.sum())  # token share of reward-1 samples
    assert ms[0]["critic/value_mean"] == 0.0
    assert ms[0]["critic/value_loss"] == pytest.approx(rewarded, rel=1e-5)
    assert ms[0]["adv/abs_mean"] == pytest.approx(rewarded, rel=1e-5)
    losses = [m["critic/value_loss"] for m in ms]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.7 * losses[0], losses
    assert ms[-1]["critic/value_mean"] > 0.05  # values moved toward the (non-negative) returns
    assert all(m["critic/skipped"] == 0.0 and m["critic/grad_norm"] > 0 for m in ms)


def test_critic_updates_per_mini_batch_and_clips(model_path, tmp_path):
    """ppo_epochs 2 x mini_batches 2: four critic updates per batch against the values from before the
    first, so from the second on values move away from V_old and the clip acts (clip_frac > 0)."""
    from trainer_setup import make_trainer

    cfg = _ppo_cfg(critic_lr=1e-2, ppo_epochs=2, mini_batches=2)
    cfg.trainer.loss.value_clip, cfg.trainer.loss.gamma, cfg.trainer.loss.lambd = 0.02, 0.9, 0.95
    tr = make_trainer(cfg, ListSource([]), model_path, str(tmp_path))
    batch = make_batch(2, 4, seed=7)
    ms = [tr.train_on_batch(batch) for _ in range(3)]
    assert tr.version == 3
    assert all(0.0 < m["critic/clip_frac"] < 1.0 for m in ms), [m["critic/clip_frac"] for m in ms]
    assert ms[-1]["critic/value_loss"] < ms[0]["critic/value_loss"]


def test_critic_is_checkpointed_and_resumed(model_path, tmp_path):
    """A trainer resumed from a checkpoint continues with the critic (weights and Adam state) it saved:
    the next step's values and value loss equal the uninterrupted trainer's."""
    from trainer_setup import make_trainer

    batches = [make_batch(2, 4, seed=s) for s in (1, 2, 3)]
    a = make_trainer(_ppo_cfg(), ListSource(batches[:]), model_path, str(tmp_path / "a"))
    a.step(), a.step()
    a.save_checkpoint()
    want = a.step()
    b = make_trainer(_ppo_cfg(), ListSource(batches[2:]), model_path, str(tmp_path / "a"))
    assert b.version == 2
    got = b.step()
    for k in ("critic/value_mean", "critic/value_loss", "loss"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    # a checkpoint without a critic cannot resume a ppo run
    c = make_trainer(_ppo_cfg(), ListSource([]), model_path, str(tmp_path / "c"))
    c.tc.loss.advantage = "grpo"
    c.critic = None
    c.save_checkpoint()
    with pytest.raises(ValueError, match="has no critic"):
        make_trainer(_ppo_cfg(), ListSource([]), model_path, str(tmp_path / "c"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("--tp", "2")], ids=["dp2", "tp2"])
def test_critic_under_dp2_and_tp2_matches_one_rank(tmp_path, layout):
    """Two gloo ranks (DP=2, or TP=2) train the policy and the critic as one rank does: the same policy
    loss, value loss, values after the first critic update, critic gradient norm and policy weights."""
    from stages.trainer.testing import run_parallel_check

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, "--advantage", "ppo")
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, "--advantage", "ppo", *layout)
    for a, b in zip(ref_m, m, strict=True):
        for k in ("loss", "critic/value_loss", "critic/value_mean"):
            assert abs(a[k] - b[k]) <= 1e-5, (k, a[k], b[k])
        assert b["critic/grad_norm"] == pytest.approx(a["critic/grad_norm"], rel=1e-4)
    assert ref_m[1]["critic/value_mean"] != 0.0  # the critic did move between the two steps
    for k in ref_w:
        assert torch.allclose(w[k], ref_w[k], atol=1e-5), k


@pytest.mark.slow  # ~30 s: a whole pipeline run
def test_a_ppo_pipeline_run_completes_and_its_value_loss_falls(tmp_path):
    """bin/run-pipeline with advantage=ppo: the critic trains inside the real pipeline (async, Ray,
    buffer, torch engine) and its value loss at the end is well below the first step's."""
    import json
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "trainer.loss.advantage=ppo", "run.steps=12", f"run.dir={run_dir}"]
        + ["eval.every_steps=0", "metrics.tensorboard=false"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    vl = [row["critic/value_loss"] for row in rows if "critic/value_loss" in row]
    assert len(vl) == 12
    assert sum(vl[-4:]) / 4 < 0.5 * vl[0], vl
