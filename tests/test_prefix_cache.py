"""SGLang's prefix (radix) cache within one weight version (issue #40, rollout.sglang.radix_cache): requests
carry the version they are sent for as SGLang's cache key, so none reuses KV of other weights."""

from __future__ import annotations

import asyncio

from stages.rollout.engine import GenRequest, SamplingParams
from tests.test_rollout_sampling_knobs import _StreamingStub, stub_engine  # noqa: F401 - the SGLang stub


def test_with_the_radix_cache_requests_are_keyed_by_the_weight_version_they_are_sent_for(stub_engine):  # noqa: F811
    """rollout.sglang.radix_cache: SGLang matches cached prefixes only within a request's extra_key, so a
    request sent after an update's start never reuses KV computed under the weights before it."""
    _StreamingStub.tokens = list(b"ab")
    req = GenRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=2), rid="q")
    asyncio.run(stub_engine.generate([req]))
    assert "extra_key" not in _StreamingStub.bodies[-1]  # the cache off (the default): no key
    stub_engine.cfg.radix_cache = True
    asyncio.run(stub_engine.generate([req]))
    assert _StreamingStub.bodies[-1]["extra_key"] == "v0"
    posted = []
    stub_engine._post = lambda path, body=None, **kw: posted.append((path, stub_engine.cache_namespace)) or {}
    with stub_engine.updating(3):
        asyncio.run(stub_engine.generate([req]))  # sent while the update is under way: the new weights'
    assert _StreamingStub.bodies[-1]["extra_key"] == "v3" and stub_engine.version == 3
    assert posted[0][1] == "v3"  # the namespace moved before the pause was asked for


def test_the_engine_counts_the_prompt_tokens_it_prefilled_and_not_those_the_cache_served(stub_engine):  # noqa: F811
    _StreamingStub.tokens = list(b"ab")
    _StreamingStub.extra_meta = {"prompt_tokens": 10, "cached_tokens": 7}
    req = GenRequest(prompt_ids=list(range(10)), params=SamplingParams(max_new_tokens=2), rid="q")
    (r,) = asyncio.run(stub_engine.generate([req]))
    assert r.meta["prompt_tokens"] == 10 and r.meta["cached_tokens"] == 7
    assert stub_engine.stats()["prefill_tokens"] == 3


def test_a_requests_sampling_seed_reaches_sglang():
    from stages.rollout.sglang_wire import sampling_body

    assert sampling_body(SamplingParams(seed=1234))["sampling_seed"] == 1234
    assert "sampling_seed" not in sampling_body(SamplingParams())
