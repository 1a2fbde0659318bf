"""slime's knobs that a user porting a script looks for (issue #41), trainer side: a reference model of its
own for the KL (--ref-load), recompute granularity/method (--recompute-*), and DAPO's overlong reward
shaping and truncated-sample masking."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from buffer.record import Status, samples_to_batch
from stages.trainer.config import LossConfig, TrainerConfig
from stages.trainer.packing import to_token_batch
from stages.trainer.shaping import overlong_penalty, shape_batch
from stages.trainer.testing import (
    ListSource,
    assert_same_training,
    make_batch,
    make_samples,
    make_tiny_hf,
    run_parallel_check,
)


def test_the_overlong_penalty_is_daposs_at_its_two_lengths():
    # L = 20, B = 8: nothing up to 12 tokens, linear to -factor at 20, flat beyond
    lengths = torch.tensor([5, 12, 13, 16, 20, 30])
    got = overlong_penalty(lengths, max_len=20, buffer_len=8, factor=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5, -0.5]))


def _truncated_batch():
    samples = make_samples(2, 4, seed=3, response_len=(4, 12))
    for s in samples[:3]:
        s.status = Status.TRUNCATED
    return samples, to_token_batch(samples_to_batch(samples))


def test_mask_truncated_trains_none_of_their_tokens_and_keeps_their_rewards():
    samples, tb = _truncated_batch()
    shaped = shape_batch(tb, LossConfig(mask_truncated=True), max_new_tokens=12)
    trunc_tokens = tb.truncated[tb.seq]
    assert trunc_tokens.any() and (~trunc_tokens).any()
    assert shaped.mask[trunc_tokens].sum() == 0
    assert torch.equal(shaped.mask[~trunc_tokens], tb.mask[~trunc_tokens])
    assert torch.equal(shaped.rewards, tb.rewards)  # their rewards still count in the group statistics
    assert shape_batch(tb, LossConfig(), max_new_tokens=12) is tb  # off: untouched


def test_the_overlong_length_defaults_to_max_new_tokens():
    _, tb = _truncated_batch()
    lengths = torch.from_numpy(np.diff(tb.response_off))
    shaped = shape_batch(tb, LossConfig(overlong_buffer_len=4), max_new_tokens=10)
    assert torch.allclose(shaped.rewards - tb.rewards, overlong_penalty(lengths, 10, 4, 1.0))
    with pytest.raises(ValueError, match="overlong_max_len"):
        shape_batch(tb, LossConfig(overlong_buffer_len=16), max_new_tokens=10)


def test_a_trainer_step_reports_the_tasks_reward_and_trains_fewer_tokens_with_truncated_masked(tmp_path):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    samples, tb = _truncated_batch()
    metrics = {}
    for name, loss in (("plain", {}), ("dapo", {"mask_truncated": True, "overlong_buffer_len": 4})):
        cfg = RunConfig()
        cfg.trainer.batch_groups = 2
        cfg.trainer.loss = msgspec.convert({**msgspec.to_builtins(cfg.trainer.loss), **loss}, LossConfig)
        cfg.rollout.sampling.max_new_tokens = 10
        tr = make_trainer(cfg, ListSource([samples_to_batch(samples)]), path, str(tmp_path / name))
        metrics[name] = tr.step()
        tr.close()
    plain, dapo = metrics["plain"], metrics["dapo"]
    assert dapo["reward/mean"] == pytest.approx(plain["reward/mean"])  # the task's reward, unshaped
    assert dapo["reward/shaped_mean"] < plain["reward/mean"]  # responses of 7+ tokens lost some
    trunc_tokens = float(tb.mask[tb.truncated[tb.seq]].sum())
    assert dapo["tokens/trained"] == pytest.approx(plain["tokens/trained"] - trunc_tokens)


def test_ref_load_takes_the_kl_reference_from_another_model(tmp_path):
    from trainer_setup import make_trainer
    from transformers import AutoModelForCausalLM

    from pipeline.config import RunConfig
    from stages.trainer.packing import pack

    path = make_tiny_hf(str(tmp_path / "policy"), "qwen2", seed=1)
    ref_path = make_tiny_hf(str(tmp_path / "ref"), "qwen2", seed=2)
    batch = make_batch(2, 4, seed=5)
    tb = to_token_batch(batch)
    refs = {}
    for name, ref_load in (("initial", ""), ("loaded", ref_path)):
        cfg = RunConfig()
        cfg.trainer.batch_groups, cfg.trainer.loss.kl_coef, cfg.trainer.ref_load = 2, 0.1, ref_load
        tr = make_trainer(cfg, ListSource([batch]), path, str(tmp_path / name))
        refs[name] = tr.backend.logprobs(tb, pack(tb, list(range(tb.n)), 4096), reference=True)
        tr.close()
    hf = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    want = torch.cat([_hf_logprobs(hf, tb, i) for i in range(tb.n)])
    assert (refs["loaded"] - want).abs().max().item() < 1e-4
    assert (refs["initial"] - want).abs().max().item() > 1e-2  # another model than the initial weights


def _hf_logprobs(hf, tb, i: int) -> torch.Tensor:
    p = tb.prompt_ids[tb.prompt_off[i] : tb.prompt_off[i + 1]].tolist()
    y = tb.response_ids[tb.response_off[i] : tb.response_off[i + 1]].tolist()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([p + y])).logits[0].float(), -1)
    return lp[len(p) - 1 : -1].gather(-1, torch.tensor(y)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def no_recompute(tmp_path_factory):
    d = tmp_path_factory.mktemp("recompute")
    path = make_tiny_hf(str(d / "qwen2"), "qwen2")
    return path, d, run_parallel_check(path, str(d / "none"), 1)


@pytest.mark.parametrize("how", ["selective", "block"])
def test_recompute_granularity_and_method_train_as_without_recompute(no_recompute, how):
    path, d, (ref_m, ref_w) = no_recompute
    m, w = run_parallel_check(path, str(d / how), 1, "--recompute", how)
    assert_same_training(ref_m, ref_w, m, w)


def test_recompute_settings_reach_megatron():
    tc = TrainerConfig(
        recompute=True, recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    )
    assert tc.megatron_recompute() == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
    }
    assert TrainerConfig(recompute=True, recompute_granularity="selective").megatron_recompute() == {
        "recompute_granularity": "selective"
    }
    assert TrainerConfig().megatron_recompute() == {}


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"ref_load": "/some/model"}, "no KL uses a reference"),
        ({"loss": {"overlong_buffer_len": 64, "overlong_max_len": 32}}, "overlong_buffer_len=64"),
        ({"recompute_num_layers": 0}, "recompute_num_layers"),
    ],
    ids=["ref-load-without-kl", "overlong-buffer-past-max", "recompute-layers"],
)
def test_a_knob_set_in_a_way_that_cannot_work_is_refused_with_its_key(raw, match):
    base = msgspec.to_builtins(TrainerConfig())
    base.update({k: ({**base[k], **v} if isinstance(v, dict) else v) for k, v in raw.items()})
    with pytest.raises((ValueError, msgspec.ValidationError), match=match):
        msgspec.convert(base, TrainerConfig)


def _teacher_gap_before_and_after_one_step(tmp_path, trainer_raw: dict) -> tuple[float, float]:
    """A student (seed 1) and a teacher (seed 2) of the same tiny shape; the trainer section `trainer_raw`
    (with "{teacher}" standing for the teacher's folder) takes one SGD step on samples of equal rewards
    (zero task advantages). Returns the mean |logp_student - logp_teacher| over the batch's response
    tokens before and after it."""
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.packing import pack

    student = make_tiny_hf(str(tmp_path / "student"), "qwen2", seed=1)
    teacher = make_tiny_hf(str(tmp_path / "teacher"), "qwen2", seed=2)
    samples = make_samples(2, 4, seed=7)
    for s in samples:
        s.reward = 1.0
    batch = samples_to_batch(samples)
    tb = to_token_batch(batch)
    raw = msgspec.json.decode(msgspec.json.encode(trainer_raw).replace(b"{teacher}", teacher.encode()))
    base = {"batch_groups": 2, "optimizer": "sgd", "lr": 0.3}
    cfg = RunConfig()
    cfg.trainer = msgspec.convert({**base, **raw}, TrainerConfig)  # as a loaded config: distill applied
    tr = make_trainer(cfg, ListSource([batch]), student, str(tmp_path / "run"))
    mbs = pack(tb, list(range(tb.n)), 4096)

    def gap() -> float:
        return float(
            (tr.backend.logprobs(tb, mbs) - tr.backend.logprobs(tb, mbs, reference=True)).abs().mean()
        )

    before = gap()
    tr.step()
    after = gap()
    tr.close()
    return before, after


def test_on_policy_distillation_as_a_kl_to_a_loaded_teacher_moves_the_student_toward_it(tmp_path):
    """On-policy distillation = trainer.ref_load=<teacher> with the KL term (the reverse KL's k3 estimate
    as a loss): with no reward signal (equal rewards: zero advantages) one step brings the student's
    logprobs of the sampled tokens toward the teacher's."""
    loss = {"kl_coef": 1.0, "kl_type": "k3", "correction": "none"}
    before, after = _teacher_gap_before_and_after_one_step(tmp_path, {"ref_load": "{teacher}", "loss": loss})
    assert after < 0.9 * before, (before, after)


def test_distill_points_the_kl_reference_at_the_teacher_and_reloads_as_it_was():
    """trainer.distill writes what the trainer does into the keys it reads: the teacher is the KL's
    reference (ref_load) and coef the KL weight, in the loss (reverse_kl) or in the per-token rewards
    (reward); the resolved config loads again unchanged."""
    tc = msgspec.convert({"distill": {"teacher": "/teacher", "coef": 0.5}}, TrainerConfig)
    assert (tc.ref_load, tc.loss.kl_coef, tc.loss.kl_in_reward_coef) == ("/teacher", 0.5, 0.0)
    again = msgspec.convert(msgspec.to_builtins(tc), TrainerConfig)
    assert (again.ref_load, again.loss.kl_coef) == ("/teacher", 0.5)
    tc = msgspec.convert(
        {"distill": {"teacher": "/t", "coef": 0.2, "mode": "reward"}, "loss": {"advantage": "reinforce_pp"}},
        TrainerConfig,
    )
    assert (tc.ref_load, tc.loss.kl_coef, tc.loss.kl_in_reward_coef) == ("/t", 0.0, 0.2)


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"distill": {"coef": 0.5}}, "needs both teacher"),
        ({"distill": {"teacher": "/t"}}, "needs both teacher"),
        ({"distill": {"teacher": "/t", "coef": 1.0}, "ref_load": "/other"}, "drop trainer.ref_load"),
        (
            {"distill": {"teacher": "/t", "coef": 1.0}, "loss": {"kl_coef": 0.3}},
            "drop the trainer.loss KL keys",
        ),
        ({"distill": {"teacher": "/t", "coef": 1.0, "mode": "reward"}}, "advantage=reinforce_pp"),
        ({"distill": {"teacher": "/t", "coef": 1.0, "mode": "forward_kl"}}, "mode"),
    ],
    ids=["no-teacher", "no-coef", "another-ref-load", "another-kl-coef", "reward-with-grpo", "unknown-mode"],
)
def test_a_distill_setting_that_cannot_work_is_refused_naming_its_keys(raw, match):
    base = msgspec.to_builtins(TrainerConfig())
    base.update({k: ({**base[k], **v} if isinstance(v, dict) else v) for k, v in raw.items()})
    with pytest.raises((ValueError, msgspec.ValidationError), match=match):
        msgspec.convert(base, TrainerConfig)


@pytest.mark.parametrize("mode,advantage", [("reverse_kl", "grpo"), ("reward", "reinforce_pp_baseline")])
def test_distill_moves_the_student_toward_the_teacher_in_either_mode(tmp_path, mode, advantage):
    """With no task signal (equal rewards) a step of either mode brings the student's logprobs of its
    sampled tokens toward the teacher's; with coef 0 nothing would move (the loss has no other term)."""
    raw = {
        "distill": {"teacher": "{teacher}", "coef": 1.0, "mode": mode},
        "loss": {"advantage": advantage, "kl_type": "k3", "correction": "none"},
    }
    before, after = _teacher_gap_before_and_after_one_step(tmp_path, raw)
    assert after < 0.9 * before, (before, after)
