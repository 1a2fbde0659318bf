"""A served teacher for on-policy distillation (trainer.distill.server; stages/trainer/distill.py): the
generator asks an SGLang server of the teacher for its logprob of every response token of each sample it
made, and stores them in the sample (Sample.teacher_logprobs), where the trainer takes them as the KL's
reference. The teacher never sits in the trainer's memory.

One /generate call per sample scores it without generating: the prompt and the response as input_ids,
max_new_tokens 0, and logprobs of the input from the last prompt token on (`logprob_start_len` = prompt
length - 1). SGLang answers `input_token_logprobs` for input positions from there: the first entry (the
last prompt token, which nothing before the start predicts) has no logprob, each later one is
log p(token | everything before it), so the entries after the first are the response tokens'.

A teacher that cannot be reached (after `retries` tries) or answers something else fails the sample,
naming the server: a failed sample is never trained, and the generator's samples_failed counts it. SGLang
refuses an input as long as its context, so the teacher's context length must hold the longest prompt
plus response (rollout.sampling.max_new_tokens), or the longest samples would fail.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from buffer.record import F32, Sample, Status, pack

log = logging.getLogger(__name__)
SCORED = (Status.COMPLETED, Status.TRUNCATED)  # the trained statuses: the others need no teacher
WARN_EVERY_S = 30.0


def score_body(prompt_ids: list[int], response_ids: list[int]) -> dict:
    """The /generate request that scores `response_ids` after `prompt_ids` without generating."""
    return {
        "input_ids": list(prompt_ids) + list(response_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
    }


def response_logprobs(answer: dict, response_ids: list[int]) -> np.ndarray:
    """The teacher's logprob of each response token from a score_body request's answer. Raises
    ValueError when the answer does not hold exactly those tokens' logprobs."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != len(response_ids) + 1:
        got = len(entries) if isinstance(entries, list) else "no"
        raise ValueError(
            f"the teacher answered {got} input_token_logprobs for a response of {len(response_ids)} tokens "
            f"(expected {len(response_ids) + 1}: the last prompt token's, then each response token's)"
        )
    ids = [int(e[1]) for e in entries[1:]]
    if ids != list(response_ids):
        raise ValueError(
            "the teacher scored other tokens than the response's (first differing position "
            f"{next(i for i, (a, b) in enumerate(zip(ids, response_ids)) if a != b)}): does it share the "
            "policy's vocabulary?"
        )
    lps = np.asarray([e[0] for e in entries[1:]], dtype=np.float64)
    if not np.isfinite(lps).all():
        raise ValueError("the teacher answered a logprob that is not finite")
    return lps


class TeacherClient:
    """Scores finished samples on the teacher server at `url` (module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 300.0, retries: int = 3):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries = timeout_s, retries
        self.failures = 0
        self._warned_at = 0.0

    async def annotate(self, samples: list[Sample]) -> None:
        """Set teacher_logprobs on every sample with a trained status and a response (a group's samples
        at once: the server batches them); a sample the teacher could not score is failed with the reason."""
        import aiohttp

        todo = [s for s in samples if s.status in SCORED and s.response_len]
        if not todo:
            return
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._score(session, s) for s in todo))

    async def _score(self, session, s: Sample) -> None:
        prompt, response = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
        try:
            answer = await self._post(session, score_body(prompt, response))
            s.teacher_logprobs = pack(response_logprobs(answer, response), F32)
        except (ValueError, ConnectionError, TypeError, KeyError, IndexError, AttributeError) as e:
            # an answer of another shape, or none: this sample fails, the generator goes on
            s.status, s.error = Status.FAILED, f"teacher {self.url}: {e}"
            self.failures += 1
            if time.monotonic() - self._warned_at > WARN_EVERY_S:
                self._warned_at = time.monotonic()
                log.warning(
                    "%s (%d samples failed so far); check trainer.distill.server", s.error, self.failures
                )

    async def _post(self, session, body: dict) -> dict:
        """POST /generate with up to `retries` more tries on connection errors and timeouts (a teacher
        restarting); raises ConnectionError after the last, ValueError for an answer other than 200."""
        import aiohttp

        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2**attempt, 10.0))
            try:
                async with session.post(self.url + "/generate", json=body) as resp:
                    if resp.status != 200:
                        raise ValueError(f"/generate -> HTTP {resp.status}: {(await resp.text())[:300]}")
                    return await resp.json()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:  # unreachable, cut off, not JSON
                last = e
        raise ConnectionError(f"unreachable after {self.retries + 1} tries ({type(last).__name__}: {last})")
