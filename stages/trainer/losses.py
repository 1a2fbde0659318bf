"""Policy-gradient and value losses and off-policy corrections as pure torch functions (the advantages
they take come from stages/trainer/advantages.py).

Token tensors are flat over all response tokens of a (micro-)batch: shape [T], with `seq` [T] giving
each token's sample index in [0, n). Sample tensors have shape [n]. `mask` is 1.0 on trained tokens and
0.0 elsewhere; masked tokens may carry any value, +-inf included (an engine's logprob of a token it was
forced to emit, FAILED samples), and never reach the loss or its gradient: they are replaced with
`torch.where` before any exp, since `x * 0` is NaN for x = inf and a `where` after the exp still
leaks 0 * inf = NaN into the backward pass (AReaL masks with `where` for the same reason).

Conventions that differ between frameworks are keys of trainer.loss (docs/algorithms.md has the table);
their defaults are slime's.

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
import torch.distributed as dist

from stages.trainer.config import LossConfig

EPS = 1e-6


def check_tokens(allow_empty: bool = False, **tensors):
    """Same-length 1-D tensors; empty only where `allow_empty` (a context-parallel rank may hold none of
    a micro-batch's response tokens, and still joins the group's collectives)."""
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
    if n == 0 and not allow_empty:
        raise ValueError(f"empty input ({', '.join(tensors)} have no entries): nothing to train on")


def seg_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq, x)


def seq_total(x: torch.Tensor, seq: torch.Tensor, n: int, group=None) -> torch.Tensor:
    """Per-sequence sums [n] of a quantity that needs no gradient, over every rank holding tokens of
    the sequences: under context parallelism (`group`: the CP group) a sequence's tokens are spread
    over the group's ranks, and GSPO's ratio, the sequence-level corrections and sample means need the
    whole sequence's sums."""
    out = seg_sum(x.detach(), seq, n)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


# -- off-policy correction -----------------------------------------------------------------------------
def correction_weights(logp_old, logp_rollout, mask, seq, n: int, cfg: LossConfig, cp_group=None):
    """Detached per-token weights [T] correcting rollout-policy -> trainer-old-policy mismatch.

    tis:       w = clamp(exp(old - rollout), tis_low, tis_cap)
    mis:       w = exp(old - rollout) inside [mis_low, mis_high], else 0 (IcePop)
    seq_tis:   the sequence ratio exp(sum_t (old - rollout)) clamped to [tis_low, tis_cap], per token
    seq_mis:   the sequence ratio, or 0 for every token of a sequence outside [mis_low, mis_high]
    decoupled: AReaL's behaviour weight pi_prox / pi_behav; tokens above tis_cap are dropped (w = 0)
    none:      w = 1
    Returns (w, outside) where `outside` marks tokens whose weight was clipped or zeroed.
    """
    check_tokens(cp_group is not None, logp_old=logp_old, logp_rollout=logp_rollout, mask=mask, seq=seq)
    with torch.no_grad():
        on = mask > 0  # where, not * mask: a masked -inf rollout logprob would give inf * 0 = NaN
        log_ratio = torch.where(on, logp_old - logp_rollout, torch.zeros_like(logp_old)).float()
        kind = cfg.correction
        if kind in ("seq_tis", "seq_mis"):
            # sum of token log-ratios = log of the product of ratios; clamped so exp stays finite
            log_ratio = seq_total(log_ratio, seq, n, cp_group).clamp(-20.0, 20.0)[seq]
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
        outside = (w != ratio) & on
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


def gspo_surrogate(logp, logp_old, adv, mask, seq, n: int, eps_low: float, eps_high: float, cp_group=None):
    """GSPO: sequence ratio s_i = exp(mean_t (logp - old)) clipped per sequence, spread over tokens.

    Token form s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) gives each token the gradient of s_i / |y_i|
    while the forward value equals s_i (GSPO paper, eq. 11).
    """
    on = mask > 0
    ntok = seq_total(mask, seq, n, cp_group).clamp(min=1.0)
    tok_log = torch.where(on, logp - logp_old.detach(), torch.zeros_like(logp))  # no inf * 0 on masked
    seq_log = seq_total(tok_log, seq, n, cp_group) / ntok
    s_tok = torch.exp(seq_log.detach())[seq] * torch.exp(logp - logp.detach())
    unclipped = s_tok * adv
    clipped = s_tok.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def kl_penalty(logp, logp_ref, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators on samples from pi (Schulman's k1/k2/k3), d = logp - logp_ref:

    k1 = d    k2 = d^2 / 2    k3 = exp(-d) + d - 1
    low_var_kl = clamp(k3(clamp(d, -20, 20)), -10, 10)   (verl's form)
    The log-ratio clamp changes no value (k3 is past 10 well before |d| = 20) but keeps the gradient
    finite: exp(-d) overflows fp32 at d < -88, and the value clamp's zero gradient times that inf is
    NaN. slime clamps only the value, k3 is unclamped in both.
    """
    if kind not in ("k1", "k2", "k3", "low_var_kl"):
        raise ValueError(f"unknown kl_type {kind!r} (k1, k2, k3, low_var_kl)")
    d = logp - logp_ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    return torch.exp(-d) + d - 1.0


def aggregation_mode(cfg: LossConfig) -> str:
    """trainer.loss.aggregation in force: "auto" is "sample" for gspo (the GSPO paper's, verl's and
    slime's per-sequence mean) and "token" for every other estimator."""
    if cfg.aggregation != "auto":
        return cfg.aggregation
    return "sample" if cfg.advantage == "gspo" else "token"


def aggregate(
    per_token, mask, seq, n: int, mode: str, denominator: str = "all", cp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the loss, kept apart so micro-batches and DP ranks can be summed
    before dividing:
        token:   sum_t l_t / #trained tokens
        sample:  sum_i (sum_t l_it / #trained tokens of i) / #samples
    `denominator` (trainer.loss.sample_mean_denominator) picks #samples for "sample": "all" counts every
    sample present in `seq`, fully masked ones too (slime divides by the step's whole batch),
    "unmasked" only those with a trained token (verl's seq-mean-token-mean).
    Under context parallelism (`cp_group`) the token counts are the whole sequences' and the sample count
    is given by the group's first rank only, since the trainer sums numerators and denominators over it.
    """
    on = mask > 0
    loss = torch.where(on, per_token, torch.zeros_like(per_token))
    if mode == "token":
        return loss.sum(), mask.sum()
    if mode == "sample":
        ntok = seq_total(mask, seq, n, cp_group)
        per_seq = seg_sum(loss, seq, n) / ntok.clamp(min=1.0)
        if denominator == "all":
            count = seq_total(torch.ones_like(mask), seq, n, cp_group) > 0
        elif denominator == "unmasked":
            count = ntok > 0
        else:
            raise ValueError(f"unknown sample_mean_denominator {denominator!r} (all, unmasked)")
        count = count.sum() if cp_group is None or dist.get_rank(cp_group) == 0 else count.new_zeros(())
        return per_seq.sum(), count.to(per_token.dtype)
    raise ValueError(f"unknown aggregation {mode!r} (token, sample)")


def policy_loss(
    logp,
    logp_old,
    logp_rollout,
    adv_tok,
    mask,
    seq,
    n: int,
    cfg: LossConfig,
    logp_ref=None,
    entropy=None,
    cp_group=None,
    sft_mask=None,
):
    """The full per-batch objective. Returns (loss_sum, loss_count, stats) — loss = sum / count.

    per token: w_t * pg_t + kl_coef * KL_t - entropy_coef * H_t, aggregated by `aggregation_mode(cfg)`.
    `sft_mask`: tokens of SFT rows (stages/trainer/sft.py), outside `mask`: their per-token loss is the NLL
    -sft_coef * logp_t instead, aggregated with the RL tokens (one token or sample mean over both).
    With `logp_ref`, stats carry "sum/kl" (the KL estimate summed over trained tokens, whatever kl_coef).
    `cp_group`: the context-parallel group whose ranks hold the other tokens of these sequences.
    """
    check_tokens(
        allow_empty=cp_group is not None,
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
    on = mask > 0
    raw_logp = logp

    def safe(x):  # masked tokens -> 0 before any exp: finite loss and gradient whatever they hold
        return None if x is None else torch.where(on, x, torch.zeros_like(x))

    logp, logp_old, logp_rollout, adv_tok = safe(logp), safe(logp_old), safe(logp_rollout), safe(adv_tok)
    logp_ref, entropy = safe(logp_ref), safe(entropy)
    w, outside = correction_weights(logp_old, logp_rollout, mask, seq, n, cfg, cp_group)
    if cfg.advantage == "gspo":
        pg, clipped = gspo_surrogate(
            logp, logp_old, adv_tok, mask, seq, n, cfg.eps_clip, cfg.eps_clip_high, cp_group
        )
    else:
        pg, clipped = ppo_surrogate(logp, logp_old, adv_tok, cfg.eps_clip, cfg.eps_clip_high, cfg.dual_clip)
    per_token = w * pg
    kl = None
    if logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, cfg.kl_type)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coef and entropy is not None:
        per_token = per_token - cfg.entropy_coef * entropy
    trained = mask
    if sft_mask is not None:
        sft_on = sft_mask > 0
        nll = -torch.where(sft_on, raw_logp, torch.zeros_like(raw_logp))
        per_token = torch.where(sft_on, cfg.sft_coef * nll, per_token)
        trained = mask + sft_mask.float()
    num, den = aggregate(
        per_token, trained, seq, n, aggregation_mode(cfg), cfg.sample_mean_denominator, cp_group
    )
    stats = token_stats(logp_old, logp_rollout, w, outside, clipped, mask, entropy)
    if sft_mask is not None:
        stats["sum/sft_nll"] = (nll.detach() * sft_mask).sum().float()
        stats["sum/sft_tokens"] = sft_mask.sum().float()
    if kl is not None:  # logged as kl/value: the token mean of the estimate over trained tokens
        stats["sum/kl"] = (kl.detach() * mask).sum().float()
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
        "sum/abs_logp_diff": torch.where(on, (logp_old - logp_rollout).abs(), torch.zeros_like(w)).sum(),
    }
    if entropy is not None:
        st["sum/entropy"] = (entropy.detach() * mask).sum()
    return {k: v.detach().float() for k, v in st.items()}


# -- critic ----------------------------------------------------------------------------------------------
def value_loss(values, old_values, returns, mask, seq, n: int, cfg: LossConfig, cp_group=None):
    """PPO's clipped value loss per token, as slime's value_loss_function (no 1/2 factor):
        l_t = max((V_t - R_t)^2, (V_old_t + clamp(V_t - V_old_t, -c, c) - R_t)^2),  c = value_clip
    aggregated like the policy loss (`aggregation_mode`). `values` [T] with gradient; `old_values` the
    critic's values before this update (no gradient); `returns` the GAE targets. Returns (num, den,
    stats) with "sum/value_clipped": tokens whose |V - V_old| > c (where the clipped term can act)."""
    check_tokens(
        allow_empty=cp_group is not None,
        values=values,
        old_values=old_values,
        returns=returns,
        mask=mask,
        seq=seq,
    )
    mask = mask.float()
    on = mask > 0
    zero = torch.zeros_like(values)
    values = torch.where(on, values, zero)
    old = torch.where(on, old_values.detach().to(values.dtype), zero)
    ret = torch.where(on, returns.detach().to(values.dtype), zero)
    c = cfg.value_clip
    clipped = old + (values - old).clamp(-c, c)
    per_token = torch.maximum((values - ret) ** 2, (clipped - ret) ** 2)
    num, den = aggregate(
        per_token, mask, seq, n, aggregation_mode(cfg), cfg.sample_mean_denominator, cp_group
    )
    stats = {
        "sum/value_loss_num": num.detach().float(),
        "sum/value_loss_den": den.detach().float(),
        "sum/value_clipped": ((values.detach() - old).abs() > c).logical_and(on).float().sum(),
        "sum/value_tokens": mask.sum(),
    }
    return num, den, stats
