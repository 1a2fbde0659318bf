"""What the SGLang client (sglang_engine.py) writes into a /generate request and reads from its streamed
answers: the sampling parameters, the weight-version stamp, the finish reason."""

from __future__ import annotations

import uuid

from stages.rollout.engine import GenRequest, SamplingParams


def generate_body(
    req: GenRequest, engine_name: str, *, cache_key: str | None, routed_experts: bool, adapter: str | None
) -> dict:
    """A streamed /generate request with per-token logprobs. `cache_key`: the radix cache's namespace
    (extra_key), None with the cache off; `routed_experts`: MoE routing replay (every position's experts,
    from the first prompt token on); `adapter`: the LoRA adapter to serve it (LoRA serving)."""
    body = {
        "input_ids": list(req.prompt_ids),
        "sampling_params": sampling_body(req.params),
        "return_logprob": True,
        "stream": True,
        "rid": f"{engine_name}-{uuid.uuid4().hex}",
    }
    if cache_key is not None:
        body["extra_key"] = cache_key
    if routed_experts:
        body["return_routed_experts"] = True
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def sampling_body(p: SamplingParams) -> dict:
    """A request's `sampling_params` for SGLang's /generate."""
    sp = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_new_tokens": p.max_new_tokens,
        "ignore_eos": bool(getattr(p, "ignore_eos", False)),
    }
    if p.top_k > 0:  # SGLang takes -1 for off and refuses 0
        sp["top_k"] = p.top_k
    if p.stop_token_ids and not sp["ignore_eos"]:
        sp["stop_token_ids"] = list(p.stop_token_ids)  # in addition to the model's eos
    if p.seed is not None:  # honoured by servers launched with --enable-deterministic-inference only
        sp["sampling_seed"] = p.seed
    # no "stop": with --skip-tokenizer-init SGLang refuses string stops (it has no tokenizer to decode
    # with); the engine matches them on the streamed tokens instead (stages/rollout/stop_strings.py)
    return sp


def cache_namespace(version: int, epoch: int) -> str:
    """The prefix-cache key (SGLang's extra_key) of requests sent for weights `version` in a server's
    `epoch` (its relaunches plus the times its version went back): SGLang matches cached prefixes only
    within one key, so no request reuses KV that other weights computed (a relaunched server runs an
    older version until caught up, and the catch-up push must not meet what was cached under that older
    one; a resumed trainer pushes version numbers again with other weights)."""
    return f"v{version}.r{epoch}"


def as_version(stamp, default: int) -> int:
    """A `weight_version` stamp of SGLang's meta_info as the int the trainer pushed."""
    try:
        return int(stamp)
    except (TypeError, ValueError):  # "default": a server launched without --weight-version
        return default


def finish_reason(reason) -> str:
    """SGLang's finish_reason (a dict, or its type) as a GenResult's: stop, length or abort."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"
