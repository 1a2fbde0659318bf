"""rollout.partial_rollout: a group past the staleness bound is recycled, not thrown away (slime's
--partial-rollout with --mask-offpolicy-in-partial-rollout).

Without it, a group whose generation started more than run.max_staleness versions ago is cancelled
(admission.abort_stale) and its tokens are lost: the buffer would evict it on arrival. With it the group's
requests are interrupted instead (GenRequest.interrupt): the engine ends them with the tokens it has, and
each unfinished sample continues from exactly those tokens (never decoded and re-encoded) under the
current weights. The kept tokens stay in the response with their own logprobs and versions, as context
(loss_mask 0): they come from a policy past the bound, so they are not trained, and the staleness the
buffer checks counts trained tokens only (buffer.record.min_versions). The tokens generated after the
recycle are trained as usual; so are none of a sample that had finished before the interrupt (its tokens
are as old, and its reward still counts in the group's baseline). A group can be recycled again if it goes
stale again; each time the tokens so far become context. An engine error while continuing fails the group,
as one in a first attempt does once its retries are spent.

Only the built-in single-turn generate_fn is recycled this way (config.py refuses the others): a custom
generate_fn or agent holds its own state between engine calls that a restart from tokens would skip.
"""

from __future__ import annotations

import dataclasses
import logging

from buffer.record import Sample, Status
from stages.rollout.engine import GenRequest, SamplingParams
from stages.rollout.hooks import fill_response
from stages.rollout.single_turn import STATUS

log = logging.getLogger(__name__)


def has_partial(samples: list[Sample] | None) -> bool:
    """Whether a group's attempt left samples to continue (interrupted before they finished). One that
    went stale after its generation ended goes to the buffer as it is, which judges its staleness."""
    return samples is not None and any(s.status == Status.ABORTED for s in samples)


async def continue_partial(
    engine, rid_prefix: str, samples: list[Sample], params: SamplingParams, name: str = ""
) -> list[Sample] | None:
    """Continue every aborted sample of a group from its tokens so far (`engine`: the group's engine as
    its generate_fn reaches it; requests are named `rid_prefix`-<group index>). Returns the samples,
    updated in place: response = kept tokens (loss_mask 0) + new tokens (loss_mask 1), the status the new
    tokens' one. A sample that had finished keeps its response, untrained (loss_mask 0): its tokens are as
    far past the staleness bound as the others', and its reward still counts in the group's baseline.
    None when the engine fails (the group fails; `name`: the generator's, for the log)."""
    todo, reqs = [], []
    for s in samples:
        if s.status != Status.ABORTED:  # finished before the interrupt, but past the bound all the same:
            s.loss_mask = bytes(s.response_len)  # context only, its reward still in the group's baseline
            continue
        left = params.max_new_tokens - s.response_len
        if left <= 0:  # it had all its tokens when it was interrupted
            s.loss_mask, s.status = bytes(s.response_len), Status.TRUNCATED
            continue
        todo.append(s)
        ids = [int(t) for t in s.array("prompt_ids")] + [int(t) for t in s.array("response_ids")]
        reqs.append(
            GenRequest(
                prompt_ids=ids,
                params=dataclasses.replace(params, max_new_tokens=left),
                rid=f"{rid_prefix}-{s.group_index}",
            )
        )
    try:
        results = await engine.generate(reqs) if reqs else []
    except Exception as e:  # an engine error (a server died): the group fails, not the generator
        log.warning(
            "generator %s: continuing %s failed (%s: %s); the group fails",
            name,
            rid_prefix,
            type(e).__name__,
            e,
        )
        return None
    for s, res in zip(todo, results, strict=True):
        kept = s.response_len
        fill_response(
            s,
            response_ids=[*s.array("response_ids").tolist(), *res.response_ids],
            rollout_logprobs=[*s.array("rollout_logprobs").tolist(), *res.logprobs],
            versions=[*s.array("versions").tolist(), *res.versions],
            loss_mask=[0] * kept + [1] * len(res.response_ids),
            status=STATUS.get(res.finish_reason, Status.ABORTED),
            routed_experts=res.routed_experts,  # the continuation's prompt is the whole context so far
        )
    return samples
