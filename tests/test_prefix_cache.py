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
    assert _StreamingStub.bodies[-1]["extra_key"] == "v0.r0"
    posted = []
    stub_engine._post = lambda path, body=None, **kw: posted.append((path, stub_engine.cache_namespace)) or {}
    with stub_engine.updating(3):
        asyncio.run(stub_engine.generate([req]))  # sent while the update is under way: the new weights'
    assert _StreamingStub.bodies[-1]["extra_key"] == "v3.r0" and stub_engine.version == 3
    assert posted[0][1] == "v3.r0"  # the namespace moved before the pause was asked for
    # a relaunched server runs an older version until caught up: the catch-up push's key is not the one
    # its older weights cached under, nor the one before the relaunch
    stub_engine.restarts = 1
    with stub_engine.updating(5):
        pass
    assert stub_engine.cache_namespace == "v5.r1"


def test_a_version_that_goes_back_opens_a_new_cache_epoch(stub_engine):  # noqa: F811
    """A trainer resumed from an older checkpoint pushes its version numbers again, with weights that
    differ from the first pass's: KV cached under the first pass's numbers must not be matched."""
    stub_engine._post = lambda path, body=None, **kw: {}
    with stub_engine.updating(4):
        pass
    assert stub_engine.cache_namespace == "v4.r0"
    with stub_engine.updating(2):  # the resumed trainer's first push
        pass
    assert stub_engine.version == 2 and stub_engine.cache_namespace == "v2.r1"
    with stub_engine.updating(4):
        pass
    assert stub_engine.cache_namespace == "v4.r1"  # not the first pass's v4.r0


def test_the_engine_follows_the_servers_version_down_once_two_polls_report_it(stub_engine, monkeypatch):  # noqa: F811
    """Pushed by the trainer itself (NCCL), the version is what the server reports. A restarted trainer
    resumes from an older checkpoint: the version goes back (admission re-bases on that), but only once
    two polls in a row say so (one lower answer may be a poll that read the server just before a push
    through this client)."""
    import stages.rollout.sglang_version as sv

    monkeypatch.setattr(sv, "VERSION_POLL_S", 0.0)

    class Server:  # runs as long as it has version reports to give
        done = False

        def poll(self):
            return 0 if self.done else None

    server, reports, seen = Server(), [5, 5, 3, 5, 3, 3], []

    def server_version():
        seen.append(stub_engine.version)
        if not reports:
            server.done = True
            return None
        return reports.pop(0)

    stub_engine._server_version, stub_engine._proc = server_version, server
    stub_engine._follow_version(server)
    assert seen == [0, 5, 5, 5, 5, 5, 3]
    assert stub_engine.cache_namespace == "v3.r1"


def test_a_poll_that_read_the_server_before_this_clients_own_push_does_not_send_the_version_back(
    stub_engine,  # noqa: F811
    monkeypatch,
):
    """An adapter push (or a CUDA IPC push through the engine) labels the server and moves the engine's
    version itself. A poll whose answer predates the label, with the previous poll's equal reading,
    would read as the version going back twice in a row: it is set aside, not taken."""
    import stages.rollout.sglang_version as sv

    monkeypatch.setattr(sv, "VERSION_POLL_S", 0.0)

    class Server:
        done = False

        def poll(self):
            return 0 if self.done else None

    server, reports = Server(), [4, 4, 5, 5]

    def server_version():
        if not reports:
            server.done = True
            return None
        v = reports.pop(0)
        if len(reports) == 2:  # the second poll's answer left the server just before the push's label
            stub_engine._version = 5
        return v

    stub_engine._version = 4
    stub_engine._server_version, stub_engine._proc = server_version, server
    stub_engine._follow_version(server)
    assert stub_engine.version == 5
    assert stub_engine.versions_went_back == 0


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


def test_every_call_of_a_group_goes_to_one_engine_of_a_pool_and_groups_still_spread():
    """With the radix cache a generate_fn's calls through one EngineHandle (a group's, or per sample an
    episode's) carry its id as affinity: the pool sends them all to the engine that computed their prompt
    and earlier turns, while another group goes to the less loaded engine."""
    from stages.rollout.engine import GenResult
    from stages.rollout.engine_pool import EnginePool
    from stages.rollout.hooks import EngineHandle

    class Counting:
        def __init__(self, name):
            self.name, self.got, self.outstanding = name, [], 0

        def available(self):
            return True

        async def generate(self, requests):
            self.got += [r.rid for r in requests]
            return [
                GenResult(rid=r.rid, response_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
                for r in requests
            ]

    a, b = Counting("a"), Counting("b")
    pool = EnginePool([a, b])
    params = SamplingParams(max_new_tokens=1)
    first, second = EngineHandle(pool, "g-0", affinity=True), EngineHandle(pool, "g-1", affinity=True)

    async def go():
        await first.generate([1, 2], params, n=4)  # a group of 4 on one prompt
        a.outstanding = 10  # the first engine is busy now: a new group goes to the other one
        await second.generate([3], params, n=2)
        await first.generate([1, 2, 1], params)  # the first group's next turn: back where it was
        await second.generate([3, 1], params)

    asyncio.run(go())
    assert a.got == ["g-0-0", "g-0-1", "g-0-2", "g-0-3", "g-0-4"] and b.got == ["g-1-0", "g-1-1", "g-1-2"]


def test_the_radix_cache_with_a_trainer_side_push_is_refused_at_load():
    import pytest

    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="use weights.transport=cpu"):
        load_config("configs/tool-calc-gpu.yaml", ["rollout.sglang.radix_cache=true"])
    load_config("configs/tool-calc-gpu.yaml", ["rollout.sglang.radix_cache=true", "weights.transport=cpu"])
