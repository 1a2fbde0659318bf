"""SGLangEngine on a CUDA GPU: logprobs against an HF forward, CUDA-IPC weight updates, in-place pause
without dropping in-flight requests, and restart of a killed server.

Needs a GPU and sglang==0.5.17 (see docs/gpu.md); marked `gpu`, so default runs skip it. The model is a
random-init small Qwen2 built here, so nothing is downloaded. Each test prints a `METRIC {...}` line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

TOL = 0.02  # mean |logp_sglang - logp_hf| in bf16


def metric(**kw) -> None:
    print("METRIC " + json.dumps(kw), flush=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("sglang")
    from stages.trainer.testing import make_sglang_tiny

    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = make_sglang_tiny(str(path))
    return path, model.cuda().eval()


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    from stages.rollout.config import SGLangConfig
    from stages.rollout.sglang_engine import SGLangEngine

    cfg = SGLangConfig(
        mem_fraction_static=0.3,
        disable_cuda_graph=True,
        stream_interval=1,
        log_dir=str(tmp_path_factory.mktemp("sglang-logs")),
    )
    t0 = time.perf_counter()
    eng = SGLangEngine(tiny[0], cfg, dtype="bfloat16", version=0)
    metric(test="startup", startup_s=round(time.perf_counter() - t0, 2))
    yield eng
    eng.close()


def requests(n: int, max_new: int, *, ignore_eos: bool = False, seed: int = 0):
    from stages.rollout.engine import GenRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=ignore_eos)
    return [
        GenRequest(
            prompt_ids=torch.randint(3, 2048, (5 + i % 7,), generator=g).tolist(), params=params, rid=str(i)
        )
        for i in range(n)
    ]


def hf_diffs(model, reqs, results) -> list[float]:
    out = []
    for q, r in zip(reqs, results):
        x = torch.tensor([q.prompt_ids + r.response_ids], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(x).logits.float(), -1)[0]
        n = len(q.prompt_ids)
        ref = lp[n - 1 : n - 1 + len(r.response_ids)].gather(
            1, torch.tensor(r.response_ids, device="cuda")[:, None]
        )
        out += (ref[:, 0].cpu() - torch.tensor(r.logprobs)).abs().tolist()
    return out


def perturbed(model, scale=0.02, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * scale)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_generate_logprobs_match_hf(engine, tiny):
    reqs = requests(16, 64)
    t0 = time.perf_counter()
    res = asyncio.run(engine.generate(reqs))
    secs = time.perf_counter() - t0
    ntok = sum(len(r.response_ids) for r in res)
    assert all(len(r.response_ids) == len(r.logprobs) == len(r.versions) > 0 for r in res)
    assert all(set(r.versions) == {0} for r in res)
    assert [r.rid for r in res] == [q.rid for q in reqs]
    assert all(r.finish_reason in ("stop", "length") for r in res)
    for r in res:  # a stop must be the eos token, kept as the last response token (it is trained on)
        if r.finish_reason == "stop":
            assert r.response_ids[-1] == 2
    d = hf_diffs(tiny[1], reqs, res)
    metric(test="logprobs", mean_abs_diff=round(sum(d) / len(d), 5), max_abs_diff=round(max(d), 4))
    metric(
        test="generate",
        requests=len(reqs),
        tokens=ntok,
        seconds=round(secs, 3),
        tokens_per_s=round(ntok / secs),
    )
    assert sum(d) / len(d) <= TOL


def test_update_weights_from_tensor_follows_new_weights(engine, tiny):
    model = tiny[1]
    reqs = requests(8, 48, seed=3)
    before = asyncio.run(engine.generate(reqs))
    named = perturbed(model)
    old_diff = hf_diffs(model, reqs, before)  # old logprobs against the new weights: must differ
    timing = engine.update_weights(named, version=1)
    assert engine.version == 1
    reqs = requests(8, 48, seed=4)
    after = asyncio.run(engine.generate(reqs))
    assert all(set(r.versions) == {1} for r in after)
    d = hf_diffs(model, reqs, after)
    metric(test="update_from_tensor", **{k: round(v * 1e3, 2) for k, v in timing.items()}, unit="ms")
    metric(
        test="logprobs_after_update",
        mean_abs_diff=round(sum(d) / len(d), 5),
        old_vs_new=round(sum(old_diff) / len(old_diff), 4),
    )
    assert sum(d) / len(d) <= TOL < sum(old_diff) / len(old_diff)


def test_pause_in_place_keeps_inflight_request(engine, tiny):
    reqs = requests(4, 3000, ignore_eos=True, seed=5)
    named = perturbed(tiny[1], seed=2)
    timing: dict = {}

    async def run():
        task = asyncio.create_task(engine.generate(reqs))
        while engine.outstanding == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # well inside the generation
        timing.update(await asyncio.to_thread(engine.update_weights, named, 2))
        return await task

    res = asyncio.run(run())
    assert all(r.finish_reason == "length" and len(r.response_ids) == 3000 for r in res)
    for r in res:
        assert r.versions == sorted(r.versions), "versions must not go back"
        assert set(r.versions) == {1, 2}, "the update should land mid-generation"
    n_old = [r.versions.count(1) for r in res]
    metric(
        test="pause_in_place", tokens_v1=n_old, **{k: round(v * 1e3, 2) for k, v in timing.items()}, unit="ms"
    )


def test_killed_server_is_restarted_at_current_weights(engine, tiny):
    os.killpg(engine.pid, signal.SIGKILL)
    deadline = time.time() + 30
    while engine.check_health() and time.time() < deadline:
        time.sleep(0.2)
    assert not engine.check_health()
    secs = engine.restart()
    assert engine.check_health() and engine.version == 2
    reqs = requests(4, 32, seed=7)
    res = asyncio.run(engine.generate(reqs))
    assert all(set(r.versions) == {2} for r in res)
    d = hf_diffs(tiny[1], reqs, res)  # re-synced from the held copy: the newest weights
    metric(test="restart", restart_s=round(secs, 2), mean_abs_diff=round(sum(d) / len(d), 5))
    assert sum(d) / len(d) <= TOL


def test_pool_balances_by_outstanding(engine):
    from stages.rollout.engine_pool import EnginePool

    pool = EnginePool([engine])
    res = asyncio.run(pool.generate(requests(6, 8, seed=9)))
    assert [r.rid for r in res] == [str(i) for i in range(6)]
    assert pool.version == engine.version
    assert not threading.current_thread().daemon
