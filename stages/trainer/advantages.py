"""Per-token advantages from rewards, as pure torch functions: GRPO / GSPO group baselines, REINFORCE++
(discounted returns with the token-level KL in the reward, whitened per token) and GAE over a critic's
values for PPO. The trainer computes them for the whole batch on every rank before the loss
(stages/trainer/losses.py), so they need no collective.

Token tensors are flat over all response tokens: [T], with `seq` [T] each token's sample in [0, n);
`mask` is 1.0 on trained tokens. Conventions that differ between frameworks are keys of trainer.loss
(docs/algorithms.md); their defaults are slime's.
"""

from __future__ import annotations

import torch

from stages.trainer.config import LossConfig
from stages.trainer.losses import EPS, check_tokens


# -- group baselines ----------------------------------------------------------------------------------------
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
    check_tokens(rewards=rewards, groups=groups)
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
    check_tokens(seq=seq, mask=mask, kl=kl)
    if cfg.advantage == "ppo":
        raise ValueError("advantage=ppo needs the critic's values: use ppo_advantages")
    on = _trained(mask, seq, valid)
    if cfg.advantage in ("grpo", "gspo") or cfg.reinforce_pp_whiten == "sample":
        a = advantages(rewards, groups, cfg.advantage, cfg.grpo_std_norm, valid=valid, std=cfg.grpo_std)[seq]
        return torch.where(on, a, torch.zeros_like(a))
    if cfg.reinforce_pp_whiten != "token":
        raise ValueError(f"reinforce_pp_whiten must be 'token' or 'sample', got {cfg.reinforce_pp_whiten!r}")
    check_tokens(rewards=rewards, groups=groups)
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
    check_tokens(seq=seq, mask=mask, kl=kl)
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
    check_tokens(token_reward=token_reward, values=values, seq=seq, mask=mask)
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
