"""Context parallelism (trainer.cp): every micro-batch's sequence dimension split over the CP ranks, so
a sequence longer than one GPU's activation memory still trains.

Layout. The row of s positions is cut into 2*cp equal chunks and CP rank r holds chunks r and
2*cp-1-r ("zigzag"). Under causal attention late positions cost more than early ones; pairing an early
chunk with a late one gives every rank the same work. It is also the layout megatron's RoPE slices its
position table by (rope_utils.get_pos_emb_on_this_cp_rank), so the rotary embedding needs nothing here.

Attention. Each rank all-gathers the keys and values of the whole row (one collective per layer; its
backward sums every rank's key/value gradients back to their owner, a reduce-scatter) and attends its own
queries to them: a query at row position p sees the keys of its own sequence at positions <= p. This is
the all-gather form of context parallelism (as in Llama 3's training), chosen over ring attention for
being one collective whose cost is small next to attention at long lengths: K/V are 2 x kv_heads / heads
of the activations, a fraction with grouped-query attention. Megatron ships CP only inside
transformer-engine's attention, which this trainer's local spec does not use.

Everything else in the model is per position (norms, MLPs, projections) and runs on the local chunks.
The trainer keeps each token's loss terms on the rank that holds its position; per-sequence quantities
(GSPO's ratio, sample means) are summed over the CP group (stages/trainer/losses.py, `SeqReduce`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cp_info() -> tuple[object, int, int]:
    """(group, size, rank) of the context-parallel group; (None, 1, 0) without one."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None, 1, 0
    return (
        ps.get_context_parallel_group(),
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
    )


def local_positions(s: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Row positions rank `rank` holds, ascending: chunks `rank` and 2*cp-1-rank of 2*cp."""
    if s % (2 * cp):
        raise ValueError(f"a row of {s} positions does not split into 2*cp = {2 * cp} equal chunks")
    c = s // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def split_row(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's positions of `x` along `dim` (the sequence dimension)."""
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, x.device))


def _gathered_order(s: int, cp: int, device) -> torch.Tensor:
    """Row position of each row of an all-gather of every rank's local chunks (rank 0's first)."""
    return torch.cat([local_positions(s, cp, r, device) for r in range(cp)])


class _GatherRow(torch.autograd.Function):
    """[s/cp, ...] local rows of every CP rank -> [s, ...] in row order. Backward: each rank gets the
    sum over ranks of the gradient at its own positions."""

    @staticmethod
    def forward(ctx, x, group, cp: int):
        n = x.shape[0]
        out = x.new_empty((n * cp, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        order = _gathered_order(n * cp, cp, x.device)
        ctx.group, ctx.cp, ctx.order = group, cp, order
        row = torch.empty_like(out)
        row[order] = out
        return row

    @staticmethod
    def backward(ctx, grad):
        stacked = grad.contiguous()[ctx.order]  # back to gather order: rank r's positions at block r
        out = grad.new_empty((grad.shape[0] // ctx.cp, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, stacked, group=ctx.group)
        return out, None, None


def gather_row(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """All CP ranks' local positions of x (sequence first) -> the whole row, differentiably."""
    return _GatherRow.apply(x, group, cp)


def query_pieces(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split this rank's query positions into runs inside one sequence: (first local index, end local
    index, start of the sequence in the row) for each. `cu_seqlens` are the sequence boundaries over the
    whole row; `positions` the ascending row positions this rank holds."""
    bounds = cu_seqlens.tolist()
    pos = positions.tolist()
    seq_of = torch.bucketize(positions.cpu(), torch.tensor(bounds[1:-1]), right=True).tolist()
    pieces, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or seq_of[i] != seq_of[start] or pos[i] != pos[i - 1] + 1:
            pieces.append((start, i, bounds[seq_of[start]]))
            start = i
    return pieces


def attend_local_queries(q, k_row, v_row, cu_seqlens, positions, scale: float, flash=None):
    """Causal attention of this rank's queries q [n, heads, hn] (at row `positions`) over the whole row's
    keys/values [s, kv_heads, hn], each query within its own sequence. -> [n, heads, hn].

    Each run of consecutive local queries [a, b) of a sequence starting at s0 attends keys [s0, b): a
    rectangle whose last query row is aligned with its last key (bottom-right causal). On CUDA the runs
    go to FlashAttention varlen in one call (`flash(q, k, v, cu_q, cu_k, max_q, max_k)`), whose causal
    mask is bottom-right aligned for rectangles; elsewhere each run is one SDPA with an explicit mask.
    """
    pieces = query_pieces(cu_seqlens, positions)
    pos = positions.tolist()
    key_ranges = [(s0, pos[b - 1] + 1) for (_, b, s0) in pieces]
    if flash is not None:
        k_index = torch.cat([torch.arange(s0, e, device=q.device) for s0, e in key_ranges])
        q_lens = [b - a for a, b, _ in pieces]
        k_lens = [e - s0 for s0, e in key_ranges]
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        return flash(q, k_row[k_index], v_row[k_index], cu_q, cu_k, max(q_lens), max(k_lens))
    rep = q.shape[1] // k_row.shape[1]
    out = []
    for (a, b, s0), (_, e) in zip(pieces, key_ranges):
        qs = q[a:b].transpose(0, 1)  # [heads, m, hn]
        ks, vs = (x[s0:e].transpose(0, 1) for x in (k_row, v_row))
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        qpos = torch.tensor(pos[a:b], device=q.device)[:, None]
        kpos = torch.arange(s0, e, device=q.device)[None, :]
        out.append(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=kpos <= qpos, scale=scale).transpose(0, 1)
        )
    return torch.cat(out)


def local_view(mb, cp: int, rank: int):
    """This CP rank's part of a micro-batch (stages/trainer/packing.MicroBatch): its positions of the
    tokens and targets, and the response tokens whose predicting position it holds, their flat
    positions re-numbered into the local rows (their indices into the batch are kept). `segments` and
    `cu_seqlens` stay whole: attention needs the whole row's sequence boundaries."""
    import dataclasses

    s = mb.tokens.shape[1]
    mine = local_positions(s, cp, rank)
    local_of = torch.full((s,), -1, dtype=torch.long)
    local_of[mine] = torch.arange(len(mine))
    at = local_of[mb.resp_pos % s]
    keep = at >= 0
    return dataclasses.replace(
        mb,
        tokens=mb.tokens[:, mine],
        targets=mb.targets[:, mine],
        resp_pos=((mb.resp_pos // s) * len(mine) + at)[keep],
        tok_index=mb.tok_index[keep],
        routed=None if mb.routed is None else mb.routed[:, mine],
    )
