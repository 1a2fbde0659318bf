"""Supervised fine-tuning rows in the RL step (`trainer.sft` and `trainer.loss.sft_coef`): each optimizer
step also trains on `samples_per_step` conversations of a dataset by token NLL, weighted by sft_coef,
beside the policy gradient of the step's RL samples. This is what slime users do with an SFT warm-up or
a mixed SFT + RL objective (slime's `--loss-type sft_loss` with its multi-turn loss mask), without a
second trainer or a second copy of the weights.

The rows come from the trainer's own reading of the dataset, not through the buffer: a demonstration
depends on no policy version, so it has no staleness, no logprobs and no reward, and nothing to wait
for. Every rank reads the same rows for a step (picked from the step's version with the dataset's seed),
so no rank has to send them, and a resumed run picks exactly the rows an unbroken one would have.

A row is `{messages_key: [{role, content, step_loss_mask?}, ...]}` (slime's SFT schema). The conversation is
rendered with the tokenizer's chat template; the tokens of every assistant turn (its content and the
template's end of turn, so the model learns to stop) are trained, except turns with step_loss_mask 0.
The prompt is everything before the first assistant turn's content.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from buffer.record import Sample, samples_to_batch
from stages.data_files import ROW_FORMATS, file_rows
from stages.trainer.packing import ROW_ALIGN, TokenBatch
from stages.trainer.sft_config import SftConfig

log = logging.getLogger(__name__)


class SftDataError(ValueError):
    """A conversation of the SFT file cannot be trained on; the message names the file and row."""


def _read_rows(path: Path, key: str) -> list[list[dict]]:
    if not path.exists():
        raise SftDataError(f"trainer.sft.source {path} does not exist")
    if path.suffix not in ROW_FORMATS:
        raise SftDataError(
            f"trainer.sft.source {path}: unsupported format {path.suffix!r}; use .jsonl or .parquet"
        )
    rows = []
    for where, row, err in file_rows(path):
        if err is not None:
            raise SftDataError(f"{where}: not JSON ({err.msg}); fix or remove the line")
        if not isinstance(row, dict) or key not in row:
            raise SftDataError(f"{where}: no {key!r} key (trainer.sft.messages_key)")
        messages = row[key]  # Parquet files often hold a list column as JSON text
        rows.append(json.loads(messages) if isinstance(messages, str) else messages)
    return rows


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise SftDataError(f"{where}: expected a list of {{role, content}} messages with text content")
    if not any(m["role"] == "assistant" and m.get("step_loss_mask", 1) for m in messages):
        raise SftDataError(f"{where}: no assistant turn to train on (every one absent or step_loss_mask 0)")
    return messages


def tokenize_conversation(
    tokenizer, messages: list[dict], where: str
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask per response token) of one conversation, by the chat
    template: trained are the characters each trained assistant turn adds to the rendered text (its
    content and end of turn), mapped to the tokens that start inside them."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = tokenizer.apply_chat_template(plain, tokenize=False)
    spans, first = [], None
    for i, m in enumerate(plain):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(plain[:i], tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(plain[: i + 1], tokenize=False)
        if not (after.startswith(before) and full.startswith(after)):
            raise SftDataError(
                f"{where}: the chat template renders turn {i} differently once later messages follow (e.g. it "
                "drops past reasoning), so its tokens cannot be marked; use a template that only appends"
            )
        first = len(before) if first is None else first
        if messages[i].get("step_loss_mask", 1):
            spans.append((len(before), len(after)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = enc["input_ids"], [s for s, _ in enc["offset_mapping"]]
    cut = next(k for k, s in enumerate(starts) if s >= first)  # the first assistant content's first token
    if cut == 0:
        raise SftDataError(f"{where}: the conversation has no tokens before its first assistant turn")
    mask = [int(any(a <= s < b for a, b in spans)) for s in starts[cut:]]
    return ids[:cut], ids[cut:], mask


class SftData:
    """The SFT rows of each step, as buffer records (one group of one sample each)."""

    def __init__(self, cfg: SftConfig, tokenizer, max_tokens: int | None = None):
        """`max_tokens`: the longest conversation a micro-batch holds (trainer.micro_batch_tokens), if
        below trainer.sft.max_tokens."""
        self.cfg = cfg
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        limit = min(cfg.max_tokens, max_tokens or cfg.max_tokens)
        # packed as a sequence of prompt + response - 1 tokens, in rows of whole ROW_ALIGN blocks
        row_len = lambda p, r: -(-(len(p) + len(r) - 1) // ROW_ALIGN) * ROW_ALIGN  # noqa: E731
        path = Path(cfg.source)
        self.rows: list[tuple[list[int], list[int], list[int]]] = []
        too_long = 0
        for n, messages in enumerate(_read_rows(path, cfg.messages_key)):
            where = f"{path} row {n}"
            p, r, m = tokenize_conversation(tokenizer, _check_messages(messages, where), where)
            if len(p) + len(r) > cfg.max_tokens or row_len(p, r) > limit:
                too_long += 1
                continue
            self.rows.append((p, r, m))
        if too_long:
            log.warning(
                "trainer.sft: %d conversations over %d tokens (trainer.sft.max_tokens, micro_batch_tokens) are skipped",
                too_long,
                limit,
            )
        if not self.rows:
            raise SftDataError(
                f"{path}: no conversation to train on ({too_long} over {limit} tokens: trainer.sft.max_tokens, "
                "trainer.micro_batch_tokens)"
            )

    def indices(self, step: int) -> list[int]:
        """Row indices of step `step`: consecutive positions of an endless walk over the rows, each pass
        in its own order (seeded by the pass number)."""
        k, n = self.cfg.samples_per_step, len(self.rows)
        return [self._order(pos // n)[pos % n] for pos in range(step * k, (step + 1) * k)]

    def _order(self, epoch: int) -> list[int]:
        """The rows' order in pass `epoch` (the last one made is kept: a step rarely spans two)."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.rows)))
            if self.cfg.shuffle:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def batch(self, step: int, version: int) -> pa.RecordBatch:
        samples = []
        for i in self.indices(step):
            p, r, m = self.rows[i]
            uid = f"sft-{step}-{i}"
            samples.append(
                Sample.build(
                    uid=uid,
                    group_id=uid,
                    prompt_ids=p,
                    response_ids=r,
                    rollout_logprobs=np.zeros(len(r), np.float32),
                    versions=np.full(len(r), version, np.int32),
                    loss_mask=m,
                )
            )
        return samples_to_batch(samples)

    def extend(self, batch: pa.RecordBatch, step: int, version: int) -> tuple[pa.Table, int]:
        """The step's RL batch with its SFT rows after it, and how many those are."""
        rows = self.batch(step, version)
        rl = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        return pa.concat_tables([rl, pa.Table.from_batches([rows])]), rows.num_rows


def mark_sft(tb: TokenBatch, n_sft: int) -> TokenBatch:
    """`tb` whose last `n_sft` samples are SFT rows: their tokens move from `mask` (the RL loss's) to
    `sft_mask`, and they leave the reward statistics (`trainable`, `sft`)."""
    sft = torch.arange(tb.n) >= tb.n - n_sft
    on = sft[tb.seq].float() if len(tb.seq) else tb.mask
    return dataclasses.replace(
        tb, mask=tb.mask * (1.0 - on), sft_mask=tb.mask * on, sft=sft, trainable=tb.trainable & ~sft
    )
