"""trainer.sft: the dataset of SFT rows added to each RL step (stages/trainer/sft.py trains them), kept
apart from that module so that loading a config needs no torch."""

from __future__ import annotations

import msgspec


class SftConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    source: str = ""  # a .jsonl or .parquet file of conversations; "" = no SFT rows
    messages_key: str = "messages"  # the column holding a row's list of {role, content} messages
    samples_per_step: int = 0  # conversations added to each optimizer step's batch
    shuffle: bool = True  # a new order each pass over the file, from `seed`
    seed: int = 0
    max_tokens: int = 2048  # a longer conversation is skipped (counted and logged once)


def check_sft(sft: SftConfig, sft_coef: float) -> None:
    """trainer.sft and trainer.loss.sft_coef go together; raises ValueError naming the keys."""
    on = bool(sft.source) or sft.samples_per_step > 0
    if sft_coef < 0:
        raise ValueError(f"trainer.loss.sft_coef={sft_coef}: must be >= 0 (0: no SFT term)")
    if on != (sft_coef > 0) or (on and (not sft.source or sft.samples_per_step < 1)):
        raise ValueError(
            "SFT rows need trainer.sft.source (a .jsonl/.parquet of conversations), "
            "trainer.sft.samples_per_step >= 1 and trainer.loss.sft_coef > 0 together (got source="
            f"{sft.source!r}, samples_per_step={sft.samples_per_step}, sft_coef={sft_coef})"
        )
    if sft.max_tokens < 2:
        raise ValueError(f"trainer.sft.max_tokens={sft.max_tokens}: must be >= 2")
