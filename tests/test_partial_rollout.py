"""rollout.partial_rollout (issue #41, slime's --partial-rollout): a group that goes past run.max_staleness
while generating is interrupted and continues from its tokens so far; no token generated before the
interrupt is lost, none of them is trained (loss_mask 0), and the buffer's staleness counts trained
tokens only, so the recycled group is not evicted for its kept tokens."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from buffer.record import Sample, Status, min_versions, samples_to_batch
from stages.rollout.engine import Engine, GenRequest, GenResult, SamplingParams, interrupted
from stages.rollout.generator import Generator
from stages.rollout.partial import continue_partial
from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args
from tests.test_rollout_sampling_knobs import _StreamingStub, stub_engine  # noqa: F401 - the SGLang stub


class SlowFirstGroup(Engine):
    """The first call decodes one token (id 7) per 10 ms until its requests are interrupted (then it
    ends them "abort" with what it has); every later call answers `n_new` tokens (id 9) at once. Every
    token carries the version the engine had when it was made."""

    def __init__(self, n_new: int = 3):
        self._version, self.n_new = 0, n_new
        self.calls: list[list[GenRequest]] = []

    async def generate(self, requests):
        self.calls.append(requests)
        if len(self.calls) > 1:
            await asyncio.sleep(0.01)
            return [self._result(r, [9] * self.n_new, [self._version] * self.n_new, "stop") for r in requests]
        ids, vers = [], []
        while not interrupted(requests[0]) and len(ids) < 500:
            ids.append(7)
            vers.append(self._version)
            await asyncio.sleep(0.01)
        return [self._result(r, ids, vers, "abort") for r in requests]

    @staticmethod
    def _result(req, ids, vers, reason):
        return GenResult(
            rid=req.rid,
            response_ids=list(ids),
            logprobs=[-0.5] * len(ids),
            versions=list(vers),
            finish_reason=reason,
        )

    def update_weights(self, named_tensors, version):
        self._version = version

    @property
    def version(self) -> int:
        return self._version


def _run(cfg, engine):
    sink = FakeSink()
    gen = Generator(*rollout_args(cfg), sink, engine, "g", batch_groups=2)

    async def move():  # past the bound (max_staleness 1) once the engine is at version 2
        for v in (1, 2):
            await asyncio.sleep(0.15)
            engine.update_weights([], v)

    async def go():
        mover = asyncio.create_task(move())
        stats = await gen.run(max_groups=6)
        await mover
        return stats

    return asyncio.run(go()), sink


def test_a_stale_group_continues_from_its_tokens_which_stay_untrained_with_their_versions(tmp_path_factory):
    cfg = make_cfg(
        tmp_path_factory, max_inflight_groups=4, partial_rollout=True, sampling={"max_new_tokens": 100}
    )
    engine = SlowFirstGroup()
    stats, sink = _run(cfg, engine)
    assert stats["groups_recycled"] == 1 and stats["groups_aborted_stale"] == 0
    assert stats["groups_finished"] == 6 and "g-0" in sink.groups  # nothing dropped
    first = sink.groups["g-0"]
    kept = 0
    for s in first:
        ids, mask, vers = s.array("response_ids"), s.array("loss_mask"), s.array("versions")
        kept = int((ids == 7).sum())
        assert kept >= 10 and list(ids) == [7] * kept + [9] * 3  # every kept token, then the new ones
        assert list(mask) == [0] * kept + [1] * 3
        # the kept tokens keep the versions they were made with (from 0 on; the engine may have made one
        # at 2 before the generator saw the push), the new ones are version 2's
        assert vers[0] == 0 and sorted(vers[:kept]) == list(vers[:kept]) and list(vers[kept:]) == [2] * 3
        assert s.status == Status.COMPLETED and s.min_version() == 2  # stale only by its trained tokens
    # the continuation asked for exactly the rest: prompt + kept tokens, max_new_tokens minus them
    cont = next(c for c in engine.calls if c[0].rid.startswith("g-0-r1"))
    assert len(cont) == 4 and all(r.params.max_new_tokens == 100 - kept for r in cont)
    assert cont[0].prompt_ids[-kept:] == [7] * kept


def test_without_partial_rollout_the_stale_group_is_dropped(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory, max_inflight_groups=4, sampling={"max_new_tokens": 100})
    stats, sink = _run(cfg, SlowFirstGroup())
    assert stats["groups_aborted_stale"] == 1 and stats["groups_recycled"] == 0 and "g-0" not in sink.groups


class FailingContinuation(SlowFirstGroup):
    """SlowFirstGroup whose server dies under the first group's continuation."""

    async def generate(self, requests):
        if requests[0].rid.startswith("g-0-r1"):
            raise RuntimeError("connection refused")
        return await super().generate(requests)


def test_an_engine_error_while_continuing_fails_the_group_not_the_generator(tmp_path_factory):
    cfg = make_cfg(
        tmp_path_factory, max_inflight_groups=4, partial_rollout=True, sampling={"max_new_tokens": 100}
    )
    stats, sink = _run(cfg, FailingContinuation())
    assert stats["groups_recycled"] == 1 and stats["groups_failed"] == 1 and "g-0" not in sink.groups
    assert stats["groups_finished"] == 5


class Answers:
    """An engine handle answering each request from a list (one GenResult per request, in order)."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), []

    async def generate(self, requests):
        self.requests += requests
        return [self.answers.pop(0) for _ in requests]


def _aborted(i, ids, vers, mask=None):
    s = Sample.build(
        uid=f"u{i}",
        group_id="g",
        group_index=i,
        group_size=3,
        prompt_ids=[1, 2],
        response_ids=ids,
        rollout_logprobs=[-1.0] * len(ids),
        versions=vers,
        loss_mask=mask,
    )
    s.status = Status.ABORTED
    return s


def test_continuing_keeps_every_token_once_and_a_finished_sample_untrained():
    params = SamplingParams(max_new_tokens=6)
    done = _aborted(0, [4, 4], [0, 0])
    done.status = Status.COMPLETED
    # sample 2 was recycled once before: its earlier continuation becomes context too
    samples = [done, _aborted(1, [5], [0]), _aborted(2, [6, 6, 6], [0, 1, 1], mask=[0, 1, 1])]
    res = [
        GenResult(rid="a", response_ids=[8, 8], logprobs=[-0.1, -0.2], versions=[3, 3], finish_reason="stop"),
        GenResult(
            rid="b", response_ids=[8, 8, 8], logprobs=[-0.3] * 3, versions=[3] * 3, finish_reason="length"
        ),
    ]
    engine = Answers(res)
    asyncio.run(continue_partial(engine, "g-r1", samples, params))
    assert [r.prompt_ids for r in engine.requests] == [[1, 2, 5], [1, 2, 6, 6, 6]]
    assert [r.params.max_new_tokens for r in engine.requests] == [5, 3]
    assert [r.rid for r in engine.requests] == ["g-r1-1", "g-r1-2"]
    # finished before the interrupt: as far past the bound, so kept as context with its reward
    assert list(samples[0].array("response_ids")) == [4, 4] and samples[0].status == Status.COMPLETED
    assert list(samples[0].array("loss_mask")) == [0, 0]
    one, two = samples[1], samples[2]
    assert list(one.array("response_ids")) == [5, 8, 8] and list(one.array("loss_mask")) == [0, 1, 1]
    assert np.allclose(one.array("rollout_logprobs"), [-1.0, -0.1, -0.2]) and list(one.array("versions")) == [
        0,
        3,
        3,
    ]
    assert list(two.array("loss_mask")) == [0, 0, 0, 1, 1, 1] and two.status == Status.TRUNCATED
    # the trained tokens alone make a sample's staleness, in the record and in its Arrow column alike
    batch = samples_to_batch(samples)
    assert batch.column("min_version").to_pylist() == [-1, 3, 3] == [s.min_version() for s in samples]
    assert list(min_versions(batch.column("versions"), batch.column("loss_mask"))) == [-1, 3, 3]


def test_the_torch_engine_ends_an_interrupted_request_with_the_tokens_it_has(tmp_path_factory):
    from stages.models import resolve_model
    from stages.rollout.torch_engine import TorchEngine

    path = resolve_model(
        SimpleNamespace(name="tiny-qwen2", cache_dir=str(tmp_path_factory.getbasetemp() / "models"))
    )
    eng = TorchEngine(path, chunk_tokens=1, max_batch_size=4, seed=1)
    try:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        stop, box, got = threading.Event(), [], threading.Event()
        req = GenRequest(prompt_ids=[257, 49, 258, 257], params=params, rid="x", interrupt=stop)
        eng.submit([req], [lambda r: (box.append(r), got.set())])
        deadline = time.monotonic() + 60
        while eng.stats().get("tokens", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        stop.set()
        assert got.wait(60)
        res = box[0]
        assert res.finish_reason == "abort" and 5 <= len(res.response_ids) < 200
        assert len(res.logprobs) == len(res.versions) == len(res.response_ids)
        queued = GenRequest(prompt_ids=[257, 49, 258, 257], params=params, rid="y", interrupt=stop)
        box.clear(), got.clear()
        eng.submit([queued], [lambda r: (box.append(r), got.set())])  # interrupted before it ran
        assert got.wait(60) and box[0].finish_reason == "abort" and box[0].response_ids == []
    finally:
        eng.close()


@pytest.mark.parametrize(
    "rollout, match",
    [
        ({"partial_rollout": True, "abort_stale_groups": False}, "needs rollout.abort_stale_groups=true"),
        ({"partial_rollout": True, "generate_per_sample": True}, "continues the built-in single-turn"),
    ],
)
def test_partial_rollout_where_it_cannot_work_is_refused_by_key(tmp_path_factory, rollout, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(tmp_path_factory, **rollout)


def test_sglang_ends_an_interrupted_stream_with_the_tokens_it_has(stub_engine):  # noqa: F811 - the fixture
    _StreamingStub.tokens = list(b"x" * 100)  # 50 chunks of two, 20 ms apart: a second in all
    stop = threading.Event()
    threading.Timer(0.15, stop.set).start()
    req = GenRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=100), rid="q", interrupt=stop)
    (r,) = asyncio.run(stub_engine.generate([req]))
    assert r.finish_reason == "abort" and 2 <= len(r.response_ids) < 100
    assert len(r.logprobs) == len(r.versions) == len(r.response_ids)
    assert _StreamingStub.disconnected.wait(5), "the stream went on after the interrupt"
