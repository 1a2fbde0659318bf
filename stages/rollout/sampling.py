"""The sampling distribution (temperature, top-p) and exact log-probabilities under it.

The engine reports log p(token) under the distribution it actually sampled from; TIS divides by this
probability, so it must include temperature scaling and top-p truncation + renormalisation, not the
raw model softmax. Tests recompute it from a plain forward with `sampling_logprobs`.
"""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the sampling distribution for each row of `logits` [B, V] (float32).

    `temperature` and `top_p` are [B] tensors. Tokens outside the top-p nucleus get -inf. The nucleus is
    the smallest prefix of tokens sorted by probability whose mass reaches top_p (the first token is
    always kept). Rows with temperature <= 0 are greedy: a point mass (logprob 0) on the argmax.
    """
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    needs_nucleus = (top_p < 1.0) & ~greedy
    if bool(needs_nucleus.any()):
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        # keep a token while the mass of the tokens ranked above it is still below top_p
        keep_sorted = mass_before < top_p.to(logits.dtype)[:, None]
        keep_sorted[:, 0] = True
        keep_sorted |= ~needs_nucleus[:, None]
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        logp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
    if bool(greedy.any()):
        point = torch.full_like(logp, float("-inf"))
        point.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        logp = torch.where(greedy[:, None], point, logp)
    return logp


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B], their logprobs under the sampling dist [B])."""
    logp = sampling_logprobs(logits, temperature, top_p)
    # Gumbel-max on the masked log-probs samples exactly from softmax(logp) in one vectorised op and,
    # unlike multinomial, never needs a probability vector normalised to within float tolerance.
    u = torch.rand(logp.shape, generator=generator, device=logp.device, dtype=logp.dtype)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
    tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
