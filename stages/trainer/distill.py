"""On-policy distillation (`trainer.distill`): the student (the policy) learns a teacher's per-token
distribution on the student's own samples, the recipe of Agarwal et al. (GKD) and Thinking Machines'
on-policy distillation that slime users reach for when a larger model of the same tokenizer exists.

The trainer computes the teacher's logprobs of every sampled token itself, in the slot the KL's reference
model has (trainer.ref_load): one frozen model beside the policy, built with the policy's parallel layout,
no server of its own. The two modes are the two places the per-token reverse KL
KL_t = log pi_student(y_t) - log pi_teacher(y_t) can go:

- `reverse_kl`: coef x KL_t is a loss term beside the policy gradient (trainer.loss.kl_coef with the
  teacher as the reference; its estimator is trainer.loss.kl_type). Works with every estimator; with equal
  task rewards (or none) it is pure distillation.
- `reward`: -coef x KL_t is a per-token reward (trainer.loss.kl_in_reward_coef), so the policy gradient
  itself carries the teacher's signal, as in Thinking Machines' write-up; the reinforce_pp estimators
  are the ones with per-token returns.

A teacher too large to sit beside the policy is served instead (`server`: an SGLang server of the teacher,
launched by the user as slime's teacher is): each generator asks it for the teacher's logprobs of every
sample it makes (stages/rollout/teacher.py) and stores them in the sample (Sample.teacher_logprobs), and
the trainer takes them as the KL's reference logprobs with no teacher model of its own. SGLang scores at
temperature 1 (its prefill logprobs are not temperature-scaled), so a served teacher needs
rollout.sampling.temperature 1, as the trainer's own reference forward then computes.

`apply_distill` writes those keys when the config is loaded, so the resolved config.yaml of a run shows
what the trainer does; loading that file again is a no-op (the keys already agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    import torch

    from stages.trainer.packing import TokenBatch


class DistillConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    teacher: str = ""  # the teacher's HF folder (the policy's vocabulary); "" = no distillation
    # an SGLang server of the teacher (http://host:port) the generators ask for its logprobs of each
    # sample; "" = the trainer holds the teacher itself. With a server, `teacher` only names it
    server: str = ""
    coef: float = 0.0  # weight of the reverse KL to the teacher
    mode: Literal["reverse_kl", "reward"] = "reverse_kl"


_PER_TOKEN_RETURNS = ("reinforce_pp", "reinforce_pp_baseline")


def apply_distill(tc) -> None:
    """Point the trainer's KL reference at the teacher and its KL weight at `coef` (tc: TrainerConfig).
    Raises ValueError naming the keys when they say something else."""
    d = tc.distill
    if not d.teacher and not d.server and not d.coef:
        return
    if not (d.teacher or d.server) or d.coef <= 0:
        raise ValueError(
            "trainer.distill needs both teacher (the teacher's HF folder, or server: an SGLang server of it) "
            f"and coef > 0 (got teacher={d.teacher!r}, server={d.server!r}, coef={d.coef})"
        )
    if d.server and not d.server.startswith(("http://", "https://")):
        raise ValueError(
            f"trainer.distill.server={d.server!r}: an SGLang server's URL, e.g. http://10.0.0.5:30010"
        )
    if d.server and tc.ref_load:
        raise ValueError(
            f"trainer.distill.server with trainer.ref_load={tc.ref_load!r}: the KL's reference is the served "
            "teacher, so the trainer loads no reference model; drop trainer.ref_load"
        )
    if not d.server and tc.ref_load and tc.ref_load != d.teacher:
        raise ValueError(
            f"trainer.distill.teacher={d.teacher!r} and trainer.ref_load={tc.ref_load!r}: the trainer holds one "
            "reference model and distillation uses it for the teacher; drop trainer.ref_load"
        )
    key, other = (
        ("kl_coef", "kl_in_reward_coef") if d.mode == "reverse_kl" else ("kl_in_reward_coef", "kl_coef")
    )
    if getattr(tc.loss, key) not in (0.0, d.coef) or getattr(tc.loss, other):
        raise ValueError(
            f"trainer.distill sets trainer.loss.{key}={d.coef} (mode {d.mode}), but trainer.loss.kl_coef="
            f"{tc.loss.kl_coef} and kl_in_reward_coef={tc.loss.kl_in_reward_coef}: the KL's reference is the "
            "teacher, so drop the trainer.loss KL keys"
        )
    if d.mode == "reward" and tc.loss.advantage not in _PER_TOKEN_RETURNS:
        raise ValueError(
            f"trainer.distill.mode=reward makes -coef x KL a per-token reward, which only the per-token "
            f"returns of trainer.loss.advantage={' or '.join(_PER_TOKEN_RETURNS)} carry (not "
            f"{tc.loss.advantage!r}); set one of those, or trainer.distill.mode=reverse_kl"
        )
    if not d.server:  # a served teacher's logprobs come with the samples (served_teacher_logprobs)
        tc.ref_load = d.teacher
    setattr(tc.loss, key, d.coef)


def served_teacher_logprobs(tb: TokenBatch, device) -> torch.Tensor:
    """The KL's reference logprobs [T] from a served teacher (trainer.distill.server): the samples' own.
    Raises ValueError naming a trained sample that has none (its generator did not ask the teacher)."""
    import numpy as np
    import torch

    scored = tb.rl_rows() & tb.trainable & torch.from_numpy(np.diff(tb.response_off) > 0)
    missing = scored & ~tb.taught if tb.taught is not None else scored
    if missing.any():
        i = int(missing.nonzero()[0][0])
        raise ValueError(
            f"trainer.distill.server is set, but sample {i} of the batch (group {tb.group_ids[i]}) carries no "
            "teacher_logprobs: its generator ran without the teacher (start the rollout stage with the same "
            "trainer.distill section, which tells the generators the server)"
        )
    if tb.teacher_logprobs is None:  # nothing to score: every sample failed, or no response has a token
        return torch.zeros(len(tb.rollout_logprobs), device=device)
    return tb.teacher_logprobs.to(device)
