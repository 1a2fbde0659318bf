"""Per-token logprob and entropy straight from hidden states: the LM head, the softmax and their
gradients in chunks, so no [tokens x vocab] tensor ever exists.

Why not `output_layer` + cross entropy: at a 150k vocabulary the logits of a 16k-token micro-batch
are 10 GB in fp32, and the trainer needs them only at response positions. Here the caller picks the
positions first (hidden [t, h]); each chunk of `chunk` rows computes its logits with a bf16 GEMM that
accumulates and outputs fp32 (`torch.mm(..., out_dtype=float32)`: tensor-core speed, fp32 logits as
SGLang's --enable-fp32-lm-head computes them), reduces them to logsumexp, target logit and entropy,
and frees them. The backward recomputes each chunk's logits (one GEMM) instead of keeping them, so
peak memory is a few chunk x vocab buffers whatever the sequence length.

Gradients, with z = logits / temperature, p = softmax(z), H = entropy:
    d logp(y) / dz = onehot(y) - p
    d H / dz       = -p * (log p + H)
Under tensor parallelism the weight holds a vocabulary shard: max, sum of exp, target logit and
sum p*z are all-reduced over the TP group, and so is the hidden-state gradient in the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MM_OUT_DTYPE: bool | None = None  # does this build's torch.mm take out_dtype for bf16 on this device?


# Logit of a vocabulary-padding column: exp() of it is 0, and unlike -inf it keeps 0 * logit finite
PAD_LOGIT = -1e30


def _logits(
    h: torch.Tensor, w: torch.Tensor, temperature: float, round_bf16: bool, real_cols: int
) -> torch.Tensor:
    """fp32 logits [c, V] of bf16 (or fp32) h [c, d] and w [V, d], divided by the temperature; columns
    from `real_cols` on are TP padding of the vocabulary and get PAD_LOGIT."""
    global _MM_OUT_DTYPE
    if h.dtype == torch.float32:
        z = h @ w.t()
    else:
        if _MM_OUT_DTYPE is None:
            _MM_OUT_DTYPE = h.is_cuda and _probe_mm_out_dtype(h.device)
        if _MM_OUT_DTYPE and h.is_cuda:
            z = torch.mm(h, w.t(), out_dtype=torch.float32)
        else:  # CPU: the same numbers (products of bf16 values, fp32 sums) at fp32-GEMM speed
            z = h.float() @ w.float().t()
        if round_bf16:  # what an engine without an fp32 LM head sees: logits rounded to bf16
            z = z.to(h.dtype).float()
    if temperature != 1.0:
        z.div_(temperature)
    if real_cols < z.shape[1]:
        z[:, max(real_cols, 0) :] = PAD_LOGIT
    return z


def _probe_mm_out_dtype(device) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _tp():
    """(group, world size, rank) of the tensor-parallel group; (None, 1, 0) without megatron's groups."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            return (
                ps.get_tensor_model_parallel_group(),
                ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank(),
            )
    except ImportError:
        pass
    return None, 1, 0


def _local_targets(targets: torch.Tensor, v0: int, v: int):
    local = targets - v0
    inside = (local >= 0) & (local < v)
    return local.clamp(0, v - 1), inside


# The elementwise work on a chunk's [c, V] fp32 logits is memory-bound: eager torch reads and writes
# the whole chunk once per op (shift, exp, product, sums; in the backward softmax, coefficients, the
# one-hot, the cast), ~40 % of the head's GPU time at a 150k vocabulary. On CUDA these functions are
# compiled (inductor fuses each into one or two passes over the chunk); the CPU runs them eagerly.
def _max_and_target(z: torch.Tensor, local: torch.Tensor, inside: torch.Tensor):
    return z.amax(-1), z.gather(1, local[:, None]).squeeze(1) * inside


def _exp_sums(z: torch.Tensor, zmax: torch.Tensor, want_entropy: bool):
    """sum exp(z - zmax) and sum exp(z - zmax) * (z - zmax) per row, without a [c, V] temporary."""
    zs = z - zmax[:, None]
    ez = torch.exp(zs)
    if want_entropy:
        return torch.stack([ez.sum(-1), (ez * zs).sum(-1)])
    return ez.sum(-1)[None]


def _grad_logits(z, lse, ent, g_logp, g_ent, local, inside, inv_temperature: float, out_dtype: torch.dtype):
    """d(sum g_logp * logp(y) + g_ent * H) / d logits for one chunk, in the GEMM dtype."""
    logp = z - lse[:, None]
    p = torch.exp(logp)
    coef = g_logp[:, None]
    if g_ent is not None:
        coef = coef + g_ent[:, None] * (logp + ent[:, None])
    cols = torch.arange(z.shape[1], device=z.device)[None, :]
    onehot = (cols == local[:, None]) & inside[:, None]
    gz = (onehot * g_logp[:, None] - p * coef) * inv_temperature
    return gz.to(out_dtype)


_COMPILED: dict = {}


def _fused(fn, device: torch.device):
    """`fn` compiled for CUDA (once per function), eager elsewhere or if compiling is unavailable."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        try:
            _COMPILED[fn] = torch.compile(fn, dynamic=True)
        except Exception:  # noqa: BLE001 - no inductor / triton on this build: eager is correct, slower
            _COMPILED[fn] = fn
    return _COMPILED[fn]


class _HeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, want_entropy, round_bf16, vocab):
        ctx.set_materialize_grads(False)  # an unused output (the metric-only entropy) gets None, not zeros
        group, tp, rank = _tp()
        t, v = hidden.shape[0], weight.shape[0]
        v0 = rank * v
        max_and_target, exp_sums = _fused(_max_and_target, hidden.device), _fused(_exp_sums, hidden.device)
        logp = torch.empty(t, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else None
        for s in range(0, t, chunk):
            e_ = min(t, s + chunk)
            z = _logits(hidden[s:e_], weight, temperature, round_bf16, vocab - v0)
            local, inside = _local_targets(targets[s:e_], v0, v)
            zmax, z_y = max_and_target(z, local, inside)
            if tp > 1:
                dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
            sums = torch.cat([exp_sums(z, zmax, want_entropy), z_y[None]])  # [sum e, (sum e*z,) z_y]
            del z
            if tp > 1:
                dist.all_reduce(sums, group=group)
            log_z = torch.log(sums[0])
            lse[s:e_] = zmax + log_z
            logp[s:e_] = sums[-1] - lse[s:e_]
            if want_entropy:  # H = log Z - E_p[z - zmax]
                ent[s:e_] = log_z - sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, targets, lse, ent if want_entropy else lse)
        ctx.cfg = (temperature, chunk, want_entropy, round_bf16, vocab)
        if want_entropy:
            return logp, ent
        return logp, torch.zeros(0, device=hidden.device)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        temperature, chunk, want_entropy, round_bf16, vocab = ctx.cfg
        group, tp, rank = _tp()
        t, v = hidden.shape[0], weight.shape[0]
        v0 = rank * v
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if g_logp is None:  # only the entropy is used
            g_logp = torch.zeros_like(lse)
        use_ent = want_entropy and g_ent is not None and g_ent.numel() > 0
        grad_logits = _fused(_grad_logits, hidden.device)
        for s in range(0, t, chunk):
            e_ = min(t, s + chunk)
            z = _logits(hidden[s:e_], weight, temperature, round_bf16, vocab - v0)
            local, inside = _local_targets(targets[s:e_], v0, v)
            # dz = onehot(y) * g_logp - p * (g_logp + g_ent * (log p + H)), over the temperature
            gz = grad_logits(
                z,
                lse[s:e_],
                ent[s:e_] if use_ent else None,
                g_logp[s:e_],
                g_ent[s:e_] if use_ent else None,
                local,
                inside,
                1.0 / temperature,
                weight.dtype,
            )
            del z
            h = hidden[s:e_]
            if need_h:
                grad_h[s:e_] = gz @ weight
            if need_w:
                if h.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h)
                elif _MM_OUT_DTYPE and h.is_cuda:
                    grad_w += torch.mm(gz.t(), h, out_dtype=torch.float32)
                else:
                    grad_w.addmm_(gz.t().float(), h.float())
        if need_h and tp > 1:  # each rank saw only its vocabulary shard
            dist.all_reduce(grad_h, group=group)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = 2048,
    fp32_logits: bool = True,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [t, d] at the positions that predict `targets` [t]; weight [V/tp, d] (this rank's
    vocabulary shard) -> (log p(target) [t] fp32, entropy [t] fp32 or None).

    `fp32_logits=False` rounds the logits to the activation dtype first, as an engine without an
    fp32 LM head does. `vocab_size`: the real vocabulary when the weight's rows are padded to a
    multiple of TP (hf_mapping.padded_vocab); the padding columns are left out of the softmax.
    The entropy carries gradient only with `entropy_grad` (an entropy bonus).
    """
    if hidden.ndim != 2 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: need [t, d] and [t]"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 (trainer.logits_chunk_tokens), got {chunk}")
    hidden = hidden.to(weight.dtype)
    if hidden.shape[0] == 0:
        # keeps the graph connected to the weight and, through the (empty) hidden, to the whole model:
        # under context parallelism another rank's backward waits in collectives this one must join
        z = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0 + hidden.sum().float() * 0
        return z, (z.clone() if entropy else None)
    round_bf16 = not fp32_logits and weight.dtype != torch.float32
    _, tp, _ = _tp()
    vocab = weight.shape[0] * tp if vocab_size is None else vocab_size
    logp, ent = _HeadLogprob.apply(
        hidden, weight, targets, float(temperature), chunk, entropy, round_bf16, vocab
    )
    if not entropy:
        return logp, None
    return logp, (ent if entropy_grad else ent.detach())
