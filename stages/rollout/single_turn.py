"""The built-in generate_fn: one model turn per sample, the whole group sampled in one engine call.

It is the default `rollout.generate_fn` and an implementation of the same interface a custom one has
(stages/rollout/hooks.py): the generator treats it like any other.
"""

from __future__ import annotations

from buffer.record import Sample, Status
from stages.rollout.hooks import GenerateContext, fill_response

# the engine's finish reason -> the sample's status
STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


async def single_turn(ctx: GenerateContext) -> list[Sample]:
    """Sample len(ctx.samples) responses of the prompt at once (the engine prefills a shared prompt
    once); every response token is the model's, so the loss mask is all ones."""
    results = await ctx.engine.generate(ctx.prompt.ids, ctx.params, n=len(ctx.samples))
    for sample, res in zip(ctx.samples, results, strict=True):
        fill_response(
            sample,
            response_ids=res.response_ids,
            rollout_logprobs=res.logprobs,
            versions=res.versions,
            status=STATUS.get(res.finish_reason, Status.ABORTED),
            routed_experts=res.routed_experts,
        )
    return ctx.samples
