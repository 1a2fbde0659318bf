"""Scoring a generated group: the reward function sees each sample's decoded response."""

from __future__ import annotations

import time
from typing import Any

from buffer.record import Sample, Status
from stages.reward.registry import RewardScorer

# metadata key of a sample rewarded while it was made (an agent episode: stages/rollout/agent_run.py):
# its value says by what, and the reward function does not score it again
REWARDED_BY = "rewarded_by"


async def score_samples(scorer: RewardScorer, tokenizer: Any, samples: list[Sample]) -> None:
    """Reward every sample that did not fail in generation and was not rewarded already (REWARDED_BY).
    The reward function sees the decoded response (environment tokens included) without the final stop
    token of a completed sample."""
    todo = [s for s in samples if s.status != Status.FAILED and REWARDED_BY not in s.metadata]
    for s in samples:
        s.finished_at = time.time()  # the scorer sets it again for those it scores
    texts = []
    for s in todo:
        ids = s.array("response_ids")
        body = ids[:-1] if s.status == Status.COMPLETED and len(ids) else ids
        texts.append(tokenizer.decode(body.tolist(), skip_special_tokens=False))
    if todo:
        await scorer.score(todo, texts)
