"""The built-in torch engine: exact sampling logprobs, continuous batching, in-flight weight updates."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from stages.models import resolve_model
from stages.rollout.engine import GenRequest, SamplingParams
from stages.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
PROMPTS = [[257, 49, 50, 51, 258, 257], [257, 55, 258, 257], [257, 57, 48, 258, 257], [257, 49, 258, 257]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return resolve_model(
        SimpleNamespace(name="tiny-qwen2", cache_dir=str(tmp_path_factory.getbasetemp() / "models"))
    )


@pytest.fixture
def engine(tiny_path):
    eng = TorchEngine(tiny_path, chunk_tokens=4, max_batch_size=16, seed=1)
    yield eng
    eng.close()


def reference_logprobs(model, prompt, response, temperature, top_p, top_k=-1):
    """Independent recomputation: one unpadded forward, then temperature, top-k and nucleus by hand
    (jointly, as SGLang filters: the nucleus mass is of the whole distribution, not of the top k)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for row, tok in zip(logits, response):
        p = torch.softmax(row / temperature, -1)
        order = torch.argsort(p, descending=True)
        keep, mass = [], 0.0
        for j in order.tolist():
            if mass >= top_p or len(keep) == (top_k if top_k > 0 else len(p)):
                break
            keep.append(j)
            mass += float(p[j])
        assert tok in keep, "sampled a token outside the top-k / nucleus"
        out.append(float(torch.log(p[tok] / p[keep].sum())))
    return torch.tensor(out, dtype=torch.float64)


def run(engine, requests):
    return asyncio.run(engine.generate(requests))


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.3, 0.8, -1), (1.0, 1.0, 0), (1.0, 1.0, 4), (1.3, 0.9, 6)],
)
def test_logprobs_equal_plain_forward(engine, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12)
    reqs = [GenRequest(prompt_ids=p, params=params, rid=str(i)) for i, p in enumerate(PROMPTS * 2)]
    results = run(engine, reqs)
    assert [r.rid for r in results] == [q.rid for q in reqs]
    for q, r in zip(reqs, results):
        assert 1 <= len(r.response_ids) <= 12 and len(r.logprobs) == len(r.response_ids) == len(r.versions)
        assert r.finish_reason == ("stop" if r.response_ids[-1] == 258 else "length")
        ref = reference_logprobs(engine.model, q.prompt_ids, r.response_ids, temperature, top_p, top_k)
        assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-5), (
            r.logprobs,
            ref,
        )
        if temperature == 1.0 and top_p == 1.0 and top_k <= 0:  # then it is plain log_softmax
            with torch.no_grad():
                logits = engine.model(torch.tensor([q.prompt_ids + r.response_ids])).logits[0]
            lsm = torch.log_softmax(logits[len(q.prompt_ids) - 1 : -1], -1)
            plain = lsm.gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(r.logprobs), plain.float(), atol=1e-5)


def test_greedy_is_argmax_with_logprob_zero(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    (r,) = run(engine, [GenRequest(prompt_ids=PROMPTS[0], params=params)])
    ids = list(PROMPTS[0])
    for tok in r.response_ids:
        with torch.no_grad():
            assert tok == int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
    assert r.logprobs == [0.0] * 6 and r.finish_reason == "length"


def test_top_k_1_is_argmax_with_logprob_zero_and_rows_keep_their_own_k(engine):
    """top_k=1 samples the argmax (the truncated distribution is a point mass: logprob 0) while a row
    of the same batch without top-k keeps sampling from everything."""
    one = SamplingParams(temperature=1.3, top_k=1, max_new_tokens=8, ignore_eos=True)
    free = SamplingParams(temperature=1.3, max_new_tokens=8, ignore_eos=True)
    r1, r2 = run(
        engine,
        [GenRequest(prompt_ids=PROMPTS[0], params=one), GenRequest(prompt_ids=PROMPTS[0], params=free)],
    )
    ids = list(PROMPTS[0])
    for tok in r1.response_ids:
        with torch.no_grad():
            assert tok == int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
    assert r1.logprobs == [0.0] * 8
    assert all(lp < 0 for lp in r2.logprobs)  # a full distribution: no token has probability 1


def test_requests_join_running_batch(engine):
    """Continuous batching: requests submitted while others decode join at a chunk boundary and
    their logprobs are still exact (the left-padded KV-cache merge is invisible)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)

    async def staggered():
        first = asyncio.create_task(engine.generate([GenRequest(prompt_ids=PROMPTS[0], params=params)]))
        while engine.stats()["tokens"] < 6:
            await asyncio.sleep(0.001)
        later = await engine.generate([GenRequest(prompt_ids=p, params=params) for p in PROMPTS[1:]])
        return (await first) + later

    results = asyncio.run(staggered())
    for prompt, r in zip(PROMPTS, results):
        assert len(r.response_ids) == 40
        ref = reference_logprobs(engine.model, prompt, r.response_ids, 1.0, 1.0)
        assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-5)


def test_weight_update_applies_at_chunk_boundary(tiny_path):
    eng = TorchEngine(tiny_path, chunk_tokens=4, max_batch_size=4, seed=3)
    try:
        old_norm = eng.model.model.norm.weight.detach().clone()
        # only the final norm changes: it scales the logits but not the KV cache, so logprobs of later
        # tokens under the new weights can be recomputed exactly with one forward
        new_norm = old_norm * 3.0
        params = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
        box = {}
        done = threading.Event()
        eng.submit(
            [GenRequest(prompt_ids=PROMPTS[0], params=params)], [lambda r: (box.update(r=r), done.set())]
        )
        while eng.stats()["tokens"] < 3:
            time.sleep(0.0005)
        eng.update_weights([("model.norm.weight", new_norm)], version=1)
        assert eng.version == 1
        assert done.wait(60)
        r = box["r"]
        change = r.versions.index(1)
        assert 0 < change < 400 and change % 4 == 0, change
        assert r.versions == [0] * change + [1] * (400 - change)
        ref_new = reference_logprobs(eng.model, PROMPTS[0], r.response_ids, 1.0, 1.0)
        eng.model.model.norm.weight.data.copy_(old_norm)
        ref_old = reference_logprobs(eng.model, PROMPTS[0], r.response_ids, 1.0, 1.0)
        got = torch.tensor(r.logprobs, dtype=torch.float64)
        assert torch.allclose(got[:change], ref_old[:change], atol=1e-5)
        assert torch.allclose(got[change:], ref_new[change:], atol=1e-5)
        assert not torch.allclose(ref_old[change:], ref_new[change:], atol=1e-3)
    finally:
        eng.close()


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="not have"):
        engine.update_weights([("no.such.weight", torch.zeros(2))], version=5)
    assert engine.version == 0


def test_close_aborts_inflight(tiny_path):
    eng = TorchEngine(tiny_path, chunk_tokens=2)
    eng.pause()
    box = []
    eng.submit([GenRequest(prompt_ids=PROMPTS[1], params=SamplingParams())], [box.append])
    eng.close()
    assert box and box[0].finish_reason == "abort"


def test_a_caller_whose_event_loop_is_gone_does_not_end_the_engine(engine):
    """A generator killed mid-request leaves its requests in the engine and its event loop closed; the
    engine answering them must not end its thread, or the healed generator's requests hang for ever."""
    params = SamplingParams(max_new_tokens=4)
    engine.pause()  # the killed caller's requests are still queued when its loop closes

    async def killed_caller():
        asyncio.get_running_loop().create_task(
            engine.generate([GenRequest(prompt_ids=p, params=params) for p in PROMPTS])
        )
        await asyncio.sleep(0.01)  # then asyncio.run cancels the task and closes the loop

    asyncio.run(killed_caller())
    assert engine.requests_in_flight() == len(PROMPTS)
    engine.resume()

    async def next_caller():
        return await asyncio.wait_for(engine.generate([GenRequest(prompt_ids=PROMPTS[0], params=params)]), 30)

    (out,) = asyncio.run(next_caller())
    assert out.response_ids and out.finish_reason in ("stop", "length")
    deadline = time.monotonic() + 10
    while engine.requests_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.requests_in_flight() == 0, "the dead caller's answered requests must leave the count"


def test_an_engine_pool_reports_busy_and_idle_over_its_engines():
    """The generator's `generator/idle_share` comes from the pool's sums (it showed '-' with SGLang)."""
    from stages.rollout.engine_pool import EnginePool

    class Stub:
        def __init__(self, name, busy, idle, updates):
            self.name, self._s = name, {"busy_s": busy, "idle_s": idle, "tokens": 10, "updates": updates}

        def stats(self):
            return dict(self._s)

    s = EnginePool([Stub("a", 3.0, 1.0, 5), Stub("b", 1.0, 3.0, 4)]).stats()
    assert (s["busy_s"], s["idle_s"], s["tokens"], s["updates"]) == (4.0, 4.0, 20, 4)
    assert s["a"]["busy_s"] == 3.0  # each engine's own figures stay under its name
