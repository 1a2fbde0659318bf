"""Policy-gradient losses, advantages and off-policy corrections as pure torch functions.

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


def _check(allow_empty: bool = False, **tensors):
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


# -- advantages ----------------------------------------------------------------------------------------
def group_ids_to_index(group_ids: list[str]) -> torch.Tensor:
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(g, len(first)) for g in group_ids], dtype=torch.long)


def _group_mean(r, g, w):
    """Per-group mean of the valid rewards (r and w in float64) and each group's count of them."""
    ng = int(g.max()) + 1
    cnt = torch.zeros(ng, dtype=r.dtype).index_add(0, g, w).clamp(min=1.0)
    return torch.zeros(ng, dtype=r.dtype).index_add(0, g, r) / cnt, cnt


def advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    kind: str = "grpo",
    std_norm: bool = True,
    valid: torch.Tensor | None = None,
    std: str = "unbiased",
) -> torch.Tensor:
    """Sample-level advantages [n] from rewards [n] and group indices [n].

    grpo / gspo:            (r - mean_group) / (std_group + 1e-6)   (std division optional)
    reinforce_pp:           r whitened over the batch's samples (no baseline)
    reinforce_pp_baseline:  (r - mean_group), then whitened over the batch's samples
    The two reinforce_pp lines are the per-sample convention (trainer.loss.reinforce_pp_whiten =
    "sample", population std); the token-level default is `token_advantages`.
    `std` (trainer.loss.grpo_std): "unbiased" (Bessel-corrected: slime's and verl's torch.std, the
    default) or "population" (correction 0): rewards [1, 0] give +-0.707 and +-1.0.
    `valid` [n] bool: samples whose reward is real (not FAILED / ABORTED). Only they enter the group and
    batch statistics, and the others get advantage 0: a verifier crash's placeholder reward of 0 must
    not move its group's baseline.
    """
    _check(rewards=rewards, groups=groups)
    r = rewards.double()
    g = groups.long()
    w = torch.ones_like(r) if valid is None else valid.to(r.dtype)
    r = r * w  # a placeholder reward must not leak through 0 * inf
    mean, cnt = _group_mean(r, g, w)
    if kind in ("grpo", "gspo"):
        centred = (r - mean[g]) * w
        if not std_norm:
            return centred.float()
        if std not in ("population", "unbiased"):
            raise ValueError(f"std must be 'population' or 'unbiased' (trainer.loss.grpo_std), got {std!r}")
        dof = cnt - 1.0 if std == "unbiased" else cnt
        var = torch.zeros_like(cnt).index_add(0, g, centred**2) / dof.clamp(min=1.0)
        return (centred / (var.sqrt()[g] + EPS)).float()
    base = _reinforce_base(r, g, w, kind, mean)
    m = max(float(w.sum()), 1.0)
    mu = (base * w).sum() / m
    sd = (((base - mu) * w) ** 2).sum().div(m).sqrt() if m > 1 else torch.zeros((), dtype=r.dtype)
    return ((base - mu) * w / (sd + EPS)).float()


def _reinforce_base(r, g, w, kind: str, mean):
    """The REINFORCE++ return before whitening: the reward, or the reward minus its group's mean."""
    if kind == "reinforce_pp":
        return r
    if kind == "reinforce_pp_baseline":
        return (r - mean[g]) * w
    raise ValueError(
        f"unknown advantage estimator {kind!r} (grpo, gspo, reinforce_pp, reinforce_pp_baseline)"
    )


def token_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    seq: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    valid: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [T], as the loss consumes them; masked tokens get 0 (ppo: `ppo_advantages`).

    grpo / gspo, and reinforce_pp* with reinforce_pp_whiten = "sample": each token carries its sample's
    advantage (`advantages`). reinforce_pp* with "token" (the default; slime, verl, OpenRLHF): each
    token's return G_t is whitened over every trained token of the batch with the Bessel-corrected
    variance, as slime's distributed_masked_whiten and verl's masked_whiten:
        A_t = (G_t - mean_tok) * rsqrt(var_tok * N / (N - 1) + 1e-8),   N = trained tokens (N >= 2)
    so a long response weighs more in the statistics. Rewards [1, 0] with lengths [1, 3]: G = [1, 0, 0, 0],
    mean .25, unbiased var .25 -> [1.5, -0.5, -0.5, -0.5] (per sample: +-1).
    G_t (the paper's and slime's): reinforce_pp: the discounted return of the token rewards
    -kl_in_reward_coef * KL_t plus the sample's reward on its last trained token (`reinforce_pp_returns`);
    reinforce_pp_baseline: (r - group mean) - kl_in_reward_coef * KL_t, undiscounted (slime's).
    `kl` [T]: the per-token k1 estimate logp_old - logp_ref, needed when kl_in_reward_coef > 0. With
    gamma = 1 and no reward KL (the defaults) G_t is the sample's (centred) reward on every token.
    """
    _check(seq=seq, mask=mask, kl=kl)
    if cfg.advantage == "ppo":
        raise ValueError("advantage=ppo needs the critic's values: use ppo_advantages")
    on = _trained(mask, seq, valid)
    if cfg.advantage in ("grpo", "gspo") or cfg.reinforce_pp_whiten == "sample":
        a = advantages(rewards, groups, cfg.advantage, cfg.grpo_std_norm, valid=valid, std=cfg.grpo_std)[seq]
        return torch.where(on, a, torch.zeros_like(a))
    if cfg.reinforce_pp_whiten != "token":
        raise ValueError(f"reinforce_pp_whiten must be 'token' or 'sample', got {cfg.reinforce_pp_whiten!r}")
    _check(rewards=rewards, groups=groups)
    coef = cfg.kl_in_reward_coef
    if coef and kl is None:
        raise ValueError("trainer.loss.kl_in_reward_coef > 0 needs the per-token KL to the reference (kl)")
    if cfg.advantage == "reinforce_pp":
        ret = reinforce_pp_returns(rewards, seq, mask, cfg.gamma, valid=valid, kl=kl, kl_coef=coef)
    else:
        r = rewards.double()
        g = groups.long()
        w = torch.ones_like(r) if valid is None else valid.to(r.dtype)
        r = r * w
        mean, _ = _group_mean(r, g, w)
        ret = _reinforce_base(r, g, w, cfg.advantage, mean)[seq]
        if coef:
            ret = ret - coef * torch.where(on, kl.double(), torch.zeros_like(ret))
    return whiten_tokens(torch.where(on, ret, torch.zeros_like(ret)), on)


def _trained(mask, seq, valid=None) -> torch.Tensor:
    """Tokens that enter the statistics: trained (mask) and of a sample with a real reward (valid)."""
    on = mask > 0
    if valid is not None:
        on = on & valid.to(torch.bool)[seq]
    return on


def whiten_tokens(x: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """(x - mean) * rsqrt(var * N / (N - 1) + 1e-8) over the N tokens where `on` (float32; 0 elsewhere):
    slime's distributed_masked_whiten and verl's masked_whiten, Bessel-corrected for N >= 2 (one token:
    var 0, result 0)."""
    x = torch.where(on, x.double(), torch.zeros_like(x, dtype=torch.float64))
    n_tok = int(on.sum())
    if n_tok == 0:
        return torch.zeros_like(x).float()
    mu = x.sum() / n_tok
    var = torch.where(on, (x - mu) ** 2, torch.zeros_like(x)).sum() / n_tok
    if n_tok >= 2:
        var = var * n_tok / (n_tok - 1)
    a = (x - mu) * torch.rsqrt(var + 1e-8)
    return torch.where(on, a, torch.zeros_like(a)).float()


# -- returns over a response: REINFORCE++ and GAE ----------------------------------------------------------
# Both run over the trained tokens of each response, in order: masked tokens (a multi-turn environment's
# tokens, a tail the loss skips) are not actions, so they are neither steps of the discount nor states
# whose (untrained) value could enter a trained token's advantage. slime counts every response position
# instead; the two agree whenever the mask has no hole before the last trained token.
def _rows(seq: torch.Tensor, on: torch.Tensor, n: int):
    """Index (sample, step) of each trained token in an [n, L] matrix of the samples' trained tokens."""
    if len(seq) > 1 and bool((seq[1:] < seq[:-1]).any()):
        raise ValueError(
            "tokens must be grouped by sample in order (seq non-decreasing), as TokenBatch has them"
        )
    idx = on.nonzero().squeeze(1)
    s = seq[idx]
    counts = torch.bincount(s, minlength=n)
    step = torch.arange(len(idx)) - (torch.cumsum(counts, 0) - counts)[s]
    return idx, s, step, int(counts.max()) if len(idx) else 0


def discounted_suffix_sum(x: torch.Tensor, w: float, chunk: int = 128) -> torch.Tensor:
    """y_t = sum_{k >= t} w^(k - t) x_k along dim 1 of x [n, L]: a backward scan done a chunk at a time
    (a [chunk, chunk] matmul each) instead of one Python step per token, as slime's chunked_gae."""
    if w == 1.0:
        return x.flip(1).cumsum(1).flip(1)
    out = torch.empty_like(x)
    i = torch.arange(chunk, dtype=x.dtype)
    diff = i[None, :] - i[:, None]  # j - i
    decay = torch.where(diff >= 0, torch.full_like(diff, w) ** diff.clamp(min=0), torch.zeros_like(diff))
    carry = x.new_zeros(x.shape[0])
    for start in reversed(range(0, x.shape[1], chunk)):
        c = min(chunk, x.shape[1] - start)
        y = x[:, start : start + c] @ decay[:c, :c].T + carry[:, None] * w ** (c - i[:c])
        out[:, start : start + c] = y
        carry = y[:, 0]
    return out


def token_rewards(rewards, seq, mask, valid=None, kl=None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [T] (float64): -kl_coef * KL_t on trained tokens, plus the sample's reward on its
    last trained token (the paper's and slime's shaping; samples without a real reward get nothing)."""
    _check(seq=seq, mask=mask, kl=kl)
    n = len(rewards)
    on = _trained(mask, seq, valid)
    r = torch.zeros(len(seq), dtype=torch.float64)
    if kl_coef:
        r = torch.where(on, -kl_coef * kl.double(), r)
    idx = on.nonzero().squeeze(1)
    if len(idx):
        last = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, seq[idx], idx, "amax")
        has = last >= 0
        r[last[has]] += rewards.double()[has]
    return r


def reinforce_pp_returns(rewards, seq, mask, gamma: float, valid=None, kl=None, kl_coef: float = 0.0):
    """REINFORCE++ returns G_t = sum_{k >= t} gamma^(k - t) r_k over each response's trained tokens, with
    r from `token_rewards` (float64 [T], 0 on other tokens). Reward 1, gamma .5, three trained tokens,
    no KL: G = [.25, .5, 1]."""
    on = _trained(mask, seq, valid)
    r = token_rewards(rewards, seq, mask, valid, kl, kl_coef)
    idx, s, step, L = _rows(seq, on, len(rewards))
    mat = torch.zeros(len(rewards), L, dtype=torch.float64)
    mat[s, step] = r[idx]
    out = torch.zeros_like(r)
    out[idx] = discounted_suffix_sum(mat, gamma)[s, step]
    return out


def gae(token_reward, values, seq, mask, n: int, gamma: float, lambd: float, valid=None):
    """Generalised advantage estimation over each response's trained tokens (PPO paper; slime's
    get_advantages_and_returns): delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0),
    A_t = sum_{k >= t} (gamma lambd)^(k - t) delta_k, returns R_t = A_t + V_t. Inputs [T]; returns
    (A, R), float64 [T], 0 on other tokens. lambd = 1: A_t = discounted return - V_t."""
    _check(token_reward=token_reward, values=values, seq=seq, mask=mask)
    on = _trained(mask, seq, valid)
    idx, s, step, L = _rows(seq, on, n)
    r = torch.zeros(n, L, dtype=torch.float64)
    v = torch.zeros(n, L, dtype=torch.float64)
    r[s, step] = token_reward.double()[idx]
    v[s, step] = values.double()[idx]  # padding after a response holds V = 0: the terminal value
    nxt = torch.cat([v[:, 1:], v.new_zeros(n, 1)], dim=1)
    adv = discounted_suffix_sum(r + gamma * nxt - v, gamma * lambd)
    a = torch.zeros(len(seq), dtype=torch.float64)
    a[idx] = adv[s, step]
    ret = torch.zeros_like(a)
    ret[idx] = a[idx] + v[s, step]
    return a, ret


def ppo_advantages(rewards, seq, mask, values, cfg: LossConfig, valid=None, kl=None):
    """advantage=ppo: GAE (trainer.loss.gamma, lambd) of the token rewards (`token_rewards`, with
    kl_in_reward_coef) against the critic's values [T]. Returns (advantages [T] float32, whitened over
    trained tokens when trainer.loss.ppo_whiten = "token"; returns [T] float32, the value targets)."""
    if cfg.kl_in_reward_coef and kl is None:
        raise ValueError("trainer.loss.kl_in_reward_coef > 0 needs the per-token KL to the reference (kl)")
    on = _trained(mask, seq, valid)
    r = token_rewards(rewards, seq, mask, valid, kl, cfg.kl_in_reward_coef)
    adv, ret = gae(r, values, seq, mask, len(rewards), cfg.gamma, cfg.lambd, valid)
    adv = whiten_tokens(adv, on) if cfg.ppo_whiten == "token" else adv.float()
    return adv, ret.float()


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
    _check(cp_group is not None, logp_old=logp_old, logp_rollout=logp_rollout, mask=mask, seq=seq)
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
):
    """The full per-batch objective. Returns (loss_sum, loss_count, stats) — loss = sum / count.

    per token: w_t * pg_t + kl_coef * KL_t - entropy_coef * H_t, aggregated by `aggregation_mode(cfg)`.
    With `logp_ref`, stats carry "sum/kl" (the KL estimate summed over trained tokens, whatever kl_coef).
    `cp_group`: the context-parallel group whose ranks hold the other tokens of these sequences.
    """
    _check(
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
    num, den = aggregate(
        per_token, mask, seq, n, aggregation_mode(cfg), cfg.sample_mean_denominator, cp_group
    )
    stats = token_stats(logp_old, logp_rollout, w, outside, clipped, mask, entropy)
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
    _check(
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
