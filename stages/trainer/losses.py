"""Policy-gradient losses, advantages and off-policy corrections as pure torch functions.

Token tensors are flat over all response tokens of a (micro-)batch: shape [T], with `seq` [T] giving
each token's sample index in [0, n). Sample tensors have shape [n]. `mask` is 1.0 on trained tokens.

Three log-probabilities meet here (names follow AReaL/slime):
  logp          current trainer weights, with gradient
  logp_old      the trainer's weights before this update (no gradient; the PPO anchor)
  logp_rollout  the engine's sampling logprobs stored in the sample; never recomputed, since
                recomputing them with trainer weights would silently turn the correction off
Off-policy weights w = f(logp_old - logp_rollout) are detached and multiply the per-token term.

Statistics come back as {"sum/x": ..., "min/x": ..., "max/x": ...} tensors so that micro-batches and
ranks can be reduced exactly (sums add, mins/maxes reduce) before dividing by counts.
"""

from __future__ import annotations

import torch

from stages.trainer.config import LossConfig

EPS = 1e-6


def _check(**tensors):
    n = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.ndim != 1:
            raise ValueError(f"{name} must be 1-D (flat over tokens or samples), got shape {tuple(t.shape)}")
        if n is not None and len(t) != n:
            raise ValueError(
                f"length mismatch: {name} has {len(t)} entries, expected {n} ({', '.join(tensors)})"
            )
        n = len(t)
    if n == 0:
        raise ValueError(f"empty input ({', '.join(tensors)} have no entries): nothing to train on")


def seg_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq, x)


# -- advantages ----------------------------------------------------------------------------------------
def group_ids_to_index(group_ids: list[str]) -> torch.Tensor:
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(g, len(first)) for g in group_ids], dtype=torch.long)


def advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    kind: str = "grpo",
    std_norm: bool = True,
    valid: torch.Tensor | None = None,
    std: str = "population",
) -> torch.Tensor:
    """Sample-level advantages [n] from rewards [n] and group indices [n].

    grpo / gspo:            (r - mean_group) / (std_group + eps)   (std division optional)
    reinforce_pp:           r whitened over the batch (REINFORCE++, no baseline)
    reinforce_pp_baseline:  (r - mean_group), then whitened over the batch
    `std`: "population" (correction 0, this project's default) or "unbiased" (Bessel-corrected, as
    slime's and verl's torch.std): rewards [1, 0] give +-1.0 and +-0.707.
    `valid` [n] bool: samples whose reward is real (not FAILED / ABORTED). Only they enter the group and
    batch statistics, and the others get advantage 0: a verifier crash's placeholder reward of 0 must
    not move its group's baseline.
    """
    _check(rewards=rewards, groups=groups)
    r = rewards.double()
    g = groups.long()
    w = torch.ones_like(r) if valid is None else valid.to(r.dtype)
    r = r * w  # a placeholder reward must not leak through 0 * inf
    ng = int(g.max()) + 1
    cnt = torch.zeros(ng, dtype=r.dtype).index_add(0, g, w).clamp(min=1.0)
    mean = torch.zeros(ng, dtype=r.dtype).index_add(0, g, r) / cnt
    if kind in ("grpo", "gspo"):
        centred = (r - mean[g]) * w
        if not std_norm:
            return centred.float()
        if std not in ("population", "unbiased"):
            raise ValueError(f"std must be 'population' or 'unbiased' (trainer.loss.grpo_std), got {std!r}")
        dof = cnt - 1.0 if std == "unbiased" else cnt
        var = torch.zeros(ng, dtype=r.dtype).index_add(0, g, centred**2) / dof.clamp(min=1.0)
        return (centred / (var.sqrt()[g] + EPS)).float()
    if kind == "reinforce_pp":
        base = r
    elif kind == "reinforce_pp_baseline":
        base = (r - mean[g]) * w
    else:
        raise ValueError(
            f"unknown advantage estimator {kind!r} (grpo, gspo, reinforce_pp, reinforce_pp_baseline)"
        )
    m = max(float(w.sum()), 1.0)
    mu = (base * w).sum() / m
    std = (((base - mu) * w) ** 2).sum().div(m).sqrt() if m > 1 else torch.zeros((), dtype=r.dtype)
    return ((base - mu) * w / (std + EPS)).float()


# -- off-policy correction -----------------------------------------------------------------------------
def correction_weights(logp_old, logp_rollout, mask, seq, n: int, cfg: LossConfig):
    """Detached per-token weights [T] correcting rollout-policy -> trainer-old-policy mismatch.

    tis:       w = clamp(exp(old - rollout), tis_low, tis_cap)
    mis:       w = exp(old - rollout) inside [mis_low, mis_high], else 0 (IcePop)
    seq_tis:   the sequence ratio exp(sum_t (old - rollout)) clamped to [tis_low, tis_cap], per token
    seq_mis:   the sequence ratio, or 0 for every token of a sequence outside [mis_low, mis_high]
    decoupled: AReaL's behaviour weight pi_prox / pi_behav; tokens above tis_cap are dropped (w = 0)
    none:      w = 1
    Returns (w, outside) where `outside` marks tokens whose weight was clipped or zeroed.
    """
    _check(logp_old=logp_old, logp_rollout=logp_rollout, mask=mask, seq=seq)
    with torch.no_grad():
        log_ratio = (logp_old - logp_rollout).float() * mask
        kind = cfg.correction
        if kind in ("seq_tis", "seq_mis"):
            # sum of token log-ratios = log of the product of ratios; clamped so exp stays finite
            log_ratio = seg_sum(log_ratio, seq, n).clamp(-20.0, 20.0)[seq]
        ratio = torch.exp(log_ratio)
        if kind == "none":
            w = torch.ones_like(ratio)
        elif kind in ("tis", "seq_tis"):
            w = ratio.clamp(min=cfg.tis_low, max=cfg.tis_cap)
        elif kind in ("mis", "seq_mis"):
            w = torch.where((ratio >= cfg.mis_low) & (ratio <= cfg.mis_high), ratio, torch.zeros_like(ratio))
        elif kind == "decoupled":
            w = torch.where(ratio <= cfg.tis_cap, ratio, torch.zeros_like(ratio))
        else:
            raise ValueError(f"unknown correction {kind!r}")
        outside = (w != ratio) & (mask > 0)
    return w, outside


# -- policy losses -------------------------------------------------------------------------------------
def ppo_surrogate(logp, logp_old, adv, eps_low: float, eps_high: float, dual_clip: float = 0.0):
    """Per-token clipped surrogate loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old).

    `dual_clip` c > 1 (dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c): for A < 0 the loss is also
    capped at -c A, so a token whose ratio ran far up cannot dominate the batch (A = -1, r = e^3:
    20.09 without, 3 with c = 3). 0 = off. Returns (loss [T], clipped [T] bool: a clip was active).
    """
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip:
        capped = torch.minimum(loss, -dual_clip * adv)
        dual = (adv < 0) & (capped < loss)
        loss = torch.where(adv < 0, capped, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.detach()


def gspo_surrogate(logp, logp_old, adv, mask, seq, n: int, eps_low: float, eps_high: float):
    """GSPO: sequence ratio s_i = exp(mean_t (logp - old)) clipped per sequence, spread over tokens.

    Token form s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) gives each token the gradient of s_i / |y_i|
    while the forward value equals s_i (GSPO paper, eq. 11).
    """
    ntok = seg_sum(mask, seq, n).clamp(min=1.0)
    seq_log = seg_sum((logp - logp_old.detach()) * mask, seq, n) / ntok
    s_tok = torch.exp(seq_log.detach())[seq] * torch.exp(logp - logp.detach())
    unclipped = s_tok * adv
    clipped = s_tok.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def kl_penalty(logp, logp_ref, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators on samples from pi (Schulman's k1/k2/k3)."""
    d = logp - logp_ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    k3 = torch.exp(-d) + d - 1.0
    if kind == "k3":
        return k3
    if kind == "low_var_kl":  # k3 clamped for stability (verl's low_var_kl)
        return k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_type {kind!r} (k1, k2, k3, low_var_kl)")


def aggregate(per_token, mask, seq, n: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the loss: token-mean = sum / #tokens; sample-mean = sum of sample
    means / #samples. Kept apart so micro-batches and DP ranks can be summed before dividing."""
    if mode == "token":
        return (per_token * mask).sum(), mask.sum()
    if mode == "sample":
        ntok = seg_sum(mask, seq, n)
        per_seq = seg_sum(per_token * mask, seq, n) / ntok.clamp(min=1.0)
        return per_seq.sum(), (ntok > 0).sum().to(per_token.dtype)
    raise ValueError(f"unknown aggregation {mode!r} (token, sample)")


def policy_loss(
    logp, logp_old, logp_rollout, adv_tok, mask, seq, n: int, cfg: LossConfig, logp_ref=None, entropy=None
):
    """The full per-batch objective. Returns (loss_sum, loss_count, stats) — loss = sum / count."""
    _check(
        logp=logp,
        logp_old=logp_old,
        logp_rollout=logp_rollout,
        adv=adv_tok,
        mask=mask,
        seq=seq,
        logp_ref=logp_ref,
        entropy=entropy,
    )
    mask = mask.float()
    w, outside = correction_weights(logp_old, logp_rollout, mask, seq, n, cfg)
    if cfg.advantage == "gspo":
        pg, clipped = gspo_surrogate(logp, logp_old, adv_tok, mask, seq, n, cfg.eps_clip, cfg.eps_clip_high)
    else:
        pg, clipped = ppo_surrogate(logp, logp_old, adv_tok, cfg.eps_clip, cfg.eps_clip_high, cfg.dual_clip)
    per_token = w * pg
    if cfg.kl_coef and logp_ref is not None:
        per_token = per_token + cfg.kl_coef * kl_penalty(logp, logp_ref, cfg.kl_type)
    if cfg.entropy_coef and entropy is not None:
        per_token = per_token - cfg.entropy_coef * entropy
    num, den = aggregate(per_token, mask, seq, n, cfg.aggregation)
    stats = token_stats(logp_old, logp_rollout, w, outside, clipped, mask, entropy)
    stats["sum/loss_num"] = num.detach()
    stats["sum/loss_den"] = den.detach()
    return num, den, stats


def token_stats(logp_old, logp_rollout, w, outside, clipped, mask, entropy=None) -> dict:
    on = mask > 0
    wm = w[on] if on.any() else w.new_ones(1)
    st = {
        "sum/tokens": mask.sum(),
        "sum/tis_weight": (w * mask).sum(),
        "min/tis_weight": wm.min(),
        "max/tis_weight": wm.max(),
        "sum/tis_clipped": (outside & on).float().sum(),
        "sum/ppo_clipped": (clipped & on).float().sum(),
        "sum/abs_logp_diff": ((logp_old - logp_rollout).abs() * mask).sum(),
    }
    if entropy is not None:
        st["sum/entropy"] = (entropy.detach() * mask).sum()
    return {k: v.detach().float() for k, v in st.items()}
