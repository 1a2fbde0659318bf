"""The sampling distribution (temperature, top-k, top-p) and exact log-probabilities under it.

The engine reports log p(token) under the distribution it actually sampled from; TIS divides by this
probability, so it must include temperature scaling and top-k / top-p truncation + renormalisation, not
the raw model softmax. Tests recompute it from a plain forward with `sampling_logprobs`.

Top-k and top-p together filter jointly, as SGLang's samplers do (flashinfer's
`top_k_top_p_sampling_from_probs(filter_apply_order="joint")` and its torch fallback): a token is kept
when it ranks among the k most likely AND the tokens ranked above it hold less than top_p of the whole
(temperature-scaled) distribution's mass; the kept tokens are then renormalised. (HF's and vLLM's
top-k-then-top-p measures top_p within the renormalised top k instead, which keeps fewer tokens.)

Seeded rows (a request's SamplingParams.seed, SGLang's `sampling_seed`): the random numbers of a token
come from a generator of its own, seeded from (the request's seed, the token's position), so what a
request samples depends on neither the rows beside it in the batch nor what the engine drew before (a
restarted engine, continuous batching). The generator gives each request a seed derived from its
prompt's durable data position (stages/rollout/position.py), which makes a resumed generator sample
what an uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def sampling_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the sampling distribution for each row of `logits` [B, V] (float32).

    `temperature`, `top_p` and `top_k` are [B] tensors (top_k <= 0 or None = no top-k). Tokens outside
    the kept set get -inf: the top-k tokens (ties broken by the sort) within the top-p nucleus, the
    smallest prefix of tokens sorted by probability whose mass reaches top_p (the first token is always
    kept). Rows with temperature <= 0 are greedy: a point mass (logprob 0) on the argmax.
    """
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    vocab = logp.shape[-1]
    needs_nucleus = (top_p < 1.0) & ~greedy
    needs_top_k = torch.zeros_like(greedy) if top_k is None else (top_k > 0) & (top_k < vocab) & ~greedy
    if bool(needs_nucleus.any()) or bool(needs_top_k.any()):
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        # keep a token while the mass of the tokens ranked above it is still below top_p
        keep_sorted = (mass_before < top_p.to(logits.dtype)[:, None]) | ~needs_nucleus[:, None]
        if top_k is not None:  # ... and its rank is below k
            rank = torch.arange(vocab, device=logp.device)
            keep_sorted &= (rank[None, :] < top_k[:, None]) | ~needs_top_k[:, None]
        keep_sorted[:, 0] = True
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
    top_k: torch.Tensor | None = None,
    seeds: Sequence[int | None] | None = None,
    positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B], their logprobs under the sampling dist [B]).

    `seeds` (one per row, None for a row without) with `positions` (each row's token position, prompt
    included): a seeded row's draw depends only on (seed, position) and its logits; the other rows
    draw from `generator`."""
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    # Gumbel-max on the masked log-probs samples exactly from softmax(logp) in one vectorised op and,
    # unlike multinomial, never needs a probability vector normalised to within float tolerance.
    u = _uniforms(logp, generator, seeds, positions)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
    tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _uniforms(logp: torch.Tensor, generator, seeds, positions) -> torch.Tensor:
    """U(0, 1) noise shaped like `logp` [B, V]: seeded rows from their own (seed, position) generator,
    the rest from `generator` (all of it in one draw when no row is seeded, as before seeds existed)."""
    kw = dict(device=logp.device, dtype=logp.dtype)
    if seeds is None or all(s is None for s in seeds):
        return torch.rand(logp.shape, generator=generator, **kw)
    if positions is None or len(positions) != len(seeds) or len(seeds) != logp.shape[0]:
        raise ValueError(f"sample: {len(seeds)} seeds need as many positions, one per row of {logp.shape[0]}")
    u = torch.empty_like(logp)
    free = [i for i, s in enumerate(seeds) if s is None]
    if free:
        u[free] = torch.rand((len(free), logp.shape[1]), generator=generator, **kw)
    own = torch.Generator(device=logp.device)
    for i, seed in enumerate(seeds):
        if seed is not None:
            own.manual_seed(token_seed(seed, positions[i]))
            u[i] = torch.rand(logp.shape[1], generator=own, **kw)
    return u


def token_seed(seed: int, position: int) -> int:
    """The generator seed of one token: splitmix64 of (request seed, position), 63 bits. Mixed rather
    than added, so that seed s at position p + 1 and seed s + 1 at position p draw unrelated numbers."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
