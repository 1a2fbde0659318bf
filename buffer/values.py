"""The value bounds every Sample must meet, for one sample (buffer.record.Sample.validate) and for
whole Arrow columns (buffer.validate.check_batch): the same checks, the same messages."""

from __future__ import annotations

import numpy as np

# Value bounds every sample must meet (Sample.validate; the buffer's columnar check_batch applies the same).
# A NaN or infinite reward or logprob poisons the loss of its whole batch (and every later step through
# the weights); a group that can never complete holds buffer capacity forever.
MAX_GROUP_SIZE = 4096
# |reward| above this is a reward function's bug (a sentinel, an overflow), not a signal: one such sample
# dominates the group's advantages
MAX_ABS_REWARD = 1e6
# created_at / finished_at are unix seconds: 0 (unset) up to 2**32 (year 2106); milliseconds or
# nanoseconds since the epoch, negative or non-finite values are refused
MAX_TIMESTAMP = float(2**32)
# a logprob is log p <= 0; float rounding of an engine's log-softmax may exceed 0 by less than this
LOGPROB_SLACK = 1e-4


def routed_problem(entries: int, positions: int) -> str | None:
    """What is wrong with `entries` routed_experts values for a sample whose trainer forward has
    `positions` positions (prompt_len + response_len - 1); None if they make whole rows (or none)."""
    if entries == 0:
        return None
    if positions <= 0 or entries % positions:
        return (
            f"routed_experts has {entries} entries, not whole rows for the {max(positions, 0)} positions the "
            "trainer forwards (prompt + response tokens but the last): one row of moe_layers x top_k expert "
            "ids per position, or none at all"
        )
    return None


def value_problem(
    *, reward, group_size, token_ids, logprobs, versions, loss_mask, routed=None, times=None, teacher=None
) -> str:
    """The first out-of-range value among these arrays, described with the bound and the fix; "" if none.
    Shared by Sample.validate (one sample) and buffer.validate.check_batch (whole columns). `times`:
    {"created_at": array, "finished_at": array}."""
    if not np.isfinite(reward).all():
        return f"reward {reward[~np.isfinite(reward)][0]} is not finite; a reward must be a real number"
    if len(reward) and np.abs(reward).max() > MAX_ABS_REWARD:
        bad = reward[np.abs(reward) > MAX_ABS_REWARD][0]
        return f"reward {bad} outside [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] (MAX_ABS_REWARD); scale the reward"
    for name, t in (times or {}).items():
        out = ~np.isfinite(t) | (t < 0) | (t > MAX_TIMESTAMP)
        if out.any():
            return (
                f"{name} {t[out][0]} outside [0, {MAX_TIMESTAMP:.0f}] (MAX_TIMESTAMP): unix seconds, "
                "e.g. time.time(), not milliseconds or nanoseconds"
            )
    if ((group_size < 1) | (group_size > MAX_GROUP_SIZE)).any():
        bad = group_size[(group_size < 1) | (group_size > MAX_GROUP_SIZE)][0]
        return f"group_size {bad} outside [1, {MAX_GROUP_SIZE}]"
    if len(token_ids) and token_ids.min() < 0:
        return f"token id {token_ids.min()} is negative; token ids index the vocabulary"
    for name, lp in (("rollout_logprobs", logprobs), ("teacher_logprobs", teacher)):
        if lp is not None and len(lp) and not (np.isfinite(lp).all() and lp.max() <= LOGPROB_SLACK):
            bad = lp[~np.isfinite(lp) | (lp > LOGPROB_SLACK)][0]
            return f"{name} holds {bad}; a logprob must be finite and <= 0"
    if len(versions) and versions.min() < 0:
        return f"versions holds {versions.min()}; a token's policy version is >= 0"
    if len(loss_mask) and loss_mask.max() > 1:
        return f"loss_mask holds {loss_mask.max()}; it must be 0 or 1 per token"
    if routed is not None and len(routed) and routed.min() < 0:
        return f"routed_experts holds {routed.min()}; an expert id is >= 0"
    return ""
