"""Arrow batch of complete groups -> per-token training tensors and packed micro-batches.

Sequences (prompt + response, minus the last token) are packed first-fit-decreasing. Two layouts:
- rows (the CPU / block-mask path): rows as long as the longest sequence of the shard, several rows
  per micro-batch under `micro_batch_tokens`; each row carries segment ids for a block-diagonal causal
  mask (see model.causal_block_mask).
- packed row (the GPU / varlen path): one row per micro-batch, filled up to `micro_batch_tokens`,
  with the sequence boundaries as cumulative lengths (`cu_seqlens`) for FlashAttention's varlen
  kernels; no mask, and padding only to the next multiple of 8 tokens.
Response token j of a sample is predicted at input position prompt_len - 1 + j.

Samples that are not trainable (aborted / failed status) get a zero loss mask, and their reward does
not count toward the advantage baseline either: `TokenBatch.trainable` leaves them out of the group
and batch statistics (advantages.advantages `valid`), since a verifier crash's placeholder reward is not
real. Samples without response tokens are in no micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from buffer.record import list_values

TRAINABLE = ("completed", "truncated")
ROW_ALIGN = 8  # rows are rounded up to a multiple of this many tokens


@dataclass
class TokenBatch:
    """All response tokens of a batch, flat in sample order ([T]); samples are [n]."""

    n: int
    prompt_ids: np.ndarray  # flat values + offsets, for building inputs
    prompt_off: np.ndarray
    response_ids: np.ndarray
    response_off: np.ndarray
    rollout_logprobs: torch.Tensor  # [T] float32
    versions: torch.Tensor  # [T] int64
    mask: torch.Tensor  # [T] float32
    seq: torch.Tensor  # [T] sample index
    rewards: torch.Tensor  # [n] float32
    trainable: torch.Tensor  # [n] bool: status completed/truncated (FAILED / ABORTED rewards are not real)
    group_ids: list[str]
    # MoE routing replay: the routed_experts column (flat int16 values + offsets); None when no sample has any
    routed: tuple[np.ndarray, np.ndarray] | None = None
    truncated: torch.Tensor | None = None  # [n] bool: status truncated (the response hit max_new_tokens)
    # SFT rows of the step (stages/trainer/sft.py): [n] bool, and [T] their trained tokens, which `mask` (the
    # RL loss's) then leaves out. None: the step has none
    sft: torch.Tensor | None = None
    sft_mask: torch.Tensor | None = None
    # a served teacher's logprob per response token ([T] float32, 0 where a sample has none) and which
    # samples carry them ([n] bool): trainer.distill.server. None when no sample has any
    teacher_logprobs: torch.Tensor | None = None
    taught: torch.Tensor | None = None

    def rl_rows(self) -> torch.Tensor:
        """[n] bool: the RL samples (every sample but SFT rows), whose rewards and versions the metrics report."""
        return torch.ones(self.n, dtype=torch.bool) if self.sft is None else ~self.sft


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] input ids
    targets: torch.Tensor  # [b, s] next-token ids
    segments: torch.Tensor  # [b, s] segment id per position; padding has its own ids
    resp_pos: torch.Tensor  # [t] flat positions (in b*s) whose logits predict response tokens
    tok_index: torch.Tensor  # [t] index of those tokens in the TokenBatch's flat arrays
    num_tokens: int  # real (non-padding) tokens in the micro-batch
    cu_seqlens: torch.Tensor  # [k + 1] int32 segment boundaries over the flattened b*s positions
    max_segment_len: int  # longest segment (padding tails included)
    # MoE routing replay: [b, s, moe_layers, k] expert ids the engine chose per position; -1 where there
    # is no recording (padding, a sample without one): the router chooses there itself. None: no replay
    routed: torch.Tensor | None = None


def to_token_batch(batch: pa.RecordBatch | pa.Table) -> TokenBatch:
    """Validate and convert. Raises ValueError naming the problem for empty or inconsistent batches."""
    if batch is None or batch.num_rows == 0:
        raise ValueError("empty batch: the source returned no samples; nothing to train on")
    n = batch.num_rows
    cols = {
        name: list_values(batch, name)
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "versions", "loss_mask")
    }
    r_off = cols["response_ids"][1]
    for name in ("rollout_logprobs", "versions", "loss_mask"):
        if not np.array_equal(cols[name][1], r_off):
            bad = int(np.nonzero(np.diff(cols[name][1]) != np.diff(r_off))[0][0])
            raise ValueError(
                f"sample {batch.column('uid')[bad]}: {name} has {np.diff(cols[name][1])[bad]} entries but "
                f"response_ids has {np.diff(r_off)[bad]}; every response token needs one"
            )
    status = batch.column("status").to_pylist()
    lens = np.diff(r_off)
    empty_prompt = np.nonzero((np.diff(cols["prompt_ids"][1]) == 0) & (lens > 0))[0]
    if len(empty_prompt):
        raise ValueError(
            f"sample {batch.column('uid')[int(empty_prompt[0])]} has an empty prompt: the first "
            "response token has no position predicting it; every sample needs >= 1 prompt token"
        )
    seq = torch.from_numpy(np.repeat(np.arange(n), lens)).long()
    mask = torch.from_numpy(cols["loss_mask"][0].astype(np.float32))
    ok = torch.tensor([s in TRAINABLE for s in status], dtype=torch.bool)
    mask = mask * ok[seq].float() if len(seq) else mask
    return TokenBatch(
        n=n,
        prompt_ids=cols["prompt_ids"][0],
        prompt_off=cols["prompt_ids"][1],
        response_ids=cols["response_ids"][0],
        response_off=r_off,
        rollout_logprobs=torch.from_numpy(cols["rollout_logprobs"][0].astype(np.float32)),
        versions=torch.from_numpy(cols["versions"][0].astype(np.int64)),
        mask=mask,
        seq=seq,
        rewards=torch.from_numpy(batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float32)),
        trainable=ok,
        truncated=torch.tensor([s == "truncated" for s in status], dtype=torch.bool),
        group_ids=[str(g) for g in batch.column("group_id").to_pylist()],
        routed=_routed_column(batch),
        **_teacher_column(batch, lens),
    )


def _teacher_column(batch, lens: np.ndarray) -> dict:
    """TokenBatch's teacher_logprobs and taught (a sample has one logprob per response token, or none)."""
    if "teacher_logprobs" not in batch.schema.names:
        return {}
    values, offsets = list_values(batch, "teacher_logprobs")
    counts = np.diff(offsets)
    if not counts.any():
        return {}
    taught = counts > 0
    if not (counts[taught] == lens[taught]).all():
        bad = int(np.flatnonzero(taught & (counts != lens))[0])
        raise ValueError(
            f"sample {batch.column('uid')[bad]}: teacher_logprobs has {counts[bad]} entries but response_ids "
            f"has {lens[bad]}; a served teacher's logprob per response token, or none"
        )
    full = np.zeros(int(lens.sum()), np.float32)
    full[np.repeat(taught, lens)] = values
    return {"teacher_logprobs": torch.from_numpy(full), "taught": torch.from_numpy(taught)}


def _routed_column(batch) -> tuple[np.ndarray, np.ndarray] | None:
    if "routed_experts" not in batch.schema.names:
        return None
    values, offsets = list_values(batch, "routed_experts")
    return (values, offsets) if len(values) else None


def shard_samples(tb: TokenBatch, dp: int) -> list[list[int]]:
    """Split trainable samples over DP ranks, balancing tokens (longest first to the lightest rank)."""
    plen, rlen = np.diff(tb.prompt_off), np.diff(tb.response_off)
    train = [i for i in range(tb.n) if rlen[i] > 0]
    if len(train) < dp:
        raise ValueError(
            f"batch has {len(train)} samples with response tokens; data parallel size {dp} needs >= {dp}"
        )
    order = sorted(train, key=lambda i: -(plen[i] + rlen[i]))
    shards: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in order:
        k = load.index(min(load))
        shards[k].append(i)
        load[k] += int(plen[i] + rlen[i])
    return [sorted(s) for s in shards]


def mini_batch_parts(tb: TokenBatch, shard: list[int], m: int) -> list[list[int]]:
    """A rank's samples in `m` consecutive parts, one per update (trainer.mini_batches). SFT rows (at the
    batch's end) are split over the parts on their own, so that each update trains its share of them."""
    sft = set() if tb.sft is None else {i for i in shard if bool(tb.sft[i])}
    rl, rows = [i for i in shard if i not in sft], [i for i in shard if i in sft]
    return [
        rl[k * len(rl) // m : (k + 1) * len(rl) // m] + rows[k * len(rows) // m : (k + 1) * len(rows) // m]
        for k in range(m)
    ]


def pack(
    tb: TokenBatch,
    samples: list[int],
    micro_batch_tokens: int,
    packed_row: bool = False,
    align: int = ROW_ALIGN,
    routed_shape: tuple[int, int] | None = None,
) -> list[MicroBatch]:
    """First-fit-decreasing packing of `samples` into rows, rows grouped into micro-batches.

    `packed_row`: one row per micro-batch holding up to `micro_batch_tokens` (the varlen and TE layout).
    `align`: row lengths are multiples of it (a multiple of ROW_ALIGN; context and sequence parallelism
    split a row into equal parts).
    `routed_shape`: (moe_layers, top_k) to lay the samples' routed_experts out per position for routing
    replay (MicroBatch.routed); None leaves them out.
    """
    plen, rlen = np.diff(tb.prompt_off), np.diff(tb.response_off)
    seq_len = {i: int(plen[i] + rlen[i] - 1) for i in samples}
    if not samples:
        return []
    longest = max(seq_len.values())
    row_len = micro_batch_tokens if packed_row else -(-longest // align) * align
    if -(-longest // align) * align > micro_batch_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit trainer.micro_batch_tokens={micro_batch_tokens}; "
            "raise micro_batch_tokens (or lower rollout.sampling.max_new_tokens / max_prompt_tokens)"
        )
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(samples, key=lambda i: -seq_len[i]):
        k = next((k for k, r in enumerate(room) if r >= seq_len[i]), None)
        if k is None:
            rows.append([])
            room.append(row_len)
            k = len(rows) - 1
        rows[k].append(i)
        room[k] -= seq_len[i]
    if packed_row:  # each row its own micro-batch, trimmed to what it holds
        groups = [[row] for row in rows]
        lengths = [-(-(row_len - left) // align) * align for left in room]
    else:
        per_mb = max(1, micro_batch_tokens // row_len)
        groups = [rows[j : j + per_mb] for j in range(0, len(rows), per_mb)]
        lengths = [row_len] * len(groups)
    mbs = [_build(tb, group, n) for group, n in zip(groups, lengths)]
    if routed_shape is not None:
        for mb, group, n in zip(mbs, groups, lengths):
            mb.routed = _routed_layout(tb, group, n, routed_shape, seq_len)
    return mbs


def routed_width_problem(sample: int, entries: int, positions: int, shape: tuple[int, int]) -> str | None:
    """What is wrong with a sample's `entries` routed_experts ids for its `positions` forwarded
    positions in a model of `shape` (moe_layers, top_k); None when they fit (or there are none)."""
    width = shape[0] * shape[1]
    if entries == 0 or entries == positions * width:
        return None
    return (
        f"sample {sample} of the batch: routed_experts holds {entries} expert ids for {positions} positions; "
        f"this model needs {width} per position ({shape[0]} MoE layers x top-{shape[1]}): the engine served "
        "another model than the trainer's"
    )


def _routed_layout(
    tb: TokenBatch, rows: list[list[int]], row_len: int, shape: tuple[int, int], seq_len: dict[int, int]
) -> torch.Tensor:
    """[b, row_len, moe_layers, k] of the samples' recorded experts at their positions (as _build lays
    the tokens out), -1 elsewhere. ValueError naming the sample whose rows do not fit the model."""
    width = shape[0] * shape[1]
    out = np.full((len(rows), row_len, width), -1, np.int16)
    if tb.routed is not None:
        values, offsets = tb.routed
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n, got = seq_len[i], values[offsets[i] : offsets[i + 1]]
                problem = routed_width_problem(i, len(got), n, shape)
                if problem:
                    raise ValueError(problem)
                if len(got):
                    out[r, at : at + n] = got.reshape(n, width)
                at += n
    return torch.from_numpy(out).view(len(rows), row_len, *shape)


def _build(tb: TokenBatch, rows: list[list[int]], row_len: int) -> MicroBatch:
    b = len(rows)
    tokens = np.zeros((b, row_len), np.int64)
    targets = np.zeros((b, row_len), np.int64)
    # padding positions get ids that no real segment uses, so they only attend among themselves
    segments = np.full((b, row_len), -1, np.int64)
    resp_pos, tok_index = [], []
    bounds = [0]  # segment boundaries over the flattened rows: each sequence, then each row's padding
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for seg, i in enumerate(row):
            p = tb.prompt_ids[tb.prompt_off[i] : tb.prompt_off[i + 1]]
            y = tb.response_ids[tb.response_off[i] : tb.response_off[i + 1]]
            full = np.concatenate([p, y]).astype(np.int64)
            n = len(full) - 1
            tokens[r, at : at + n] = full[:-1]
            targets[r, at : at + n] = full[1:]
            segments[r, at : at + n] = seg
            resp_pos.append(r * row_len + at + len(p) - 1 + np.arange(len(y)))
            tok_index.append(tb.response_off[i] + np.arange(len(y)))
            at += n
            bounds.append(r * row_len + at)
        if at < row_len:
            bounds.append((r + 1) * row_len)
        real += at
    cu = np.asarray(bounds, np.int32)
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        targets=torch.from_numpy(targets),
        segments=torch.from_numpy(segments),
        resp_pos=torch.from_numpy(np.concatenate(resp_pos)).long(),
        tok_index=torch.from_numpy(np.concatenate(tok_index)).long(),
        num_tokens=real,
        cu_seqlens=torch.from_numpy(cu),
        max_segment_len=int(np.diff(cu).max()),
    )
