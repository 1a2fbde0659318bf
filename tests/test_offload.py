"""Colocated offload's parts on the CPU (docs/offload.md): the trainer's state moved off its device and back
bit for bit (megatron and fsdp), a push while it is off, the torch engine's release and wake, SGLang's
release and resume calls against a stub server, and the keys that turn it on (config, slime's flags).
The whole hand-over in a pipeline run: tests/test_offload_pipeline.py."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from http_stub import JsonHandler  # tests/ is on sys.path

from pipeline.config import ConfigError, load_config
from pipeline.orchestration.placement import PlacementError, check_offload, make_plan
from pipeline.orchestration.turns import rollout_cfg
from pipeline.slime_args import to_overrides
from stages.host_copy import MemoryHeld
from stages.rollout.engine import GenRequest, SamplingParams
from stages.rollout.sglang_process import EngineError
from stages.trainer.offload import GRADS, OPTIMIZER, PARTS, WEIGHTS, StateOffloaded, snapshot_state
from stages.trainer.testing import ListSource, make_batch, make_tiny_hf

SYNC = ["run.mode=sync"]
BOTH = ["cluster.offload.train=true", "cluster.offload.rollout=true"]


# -- the keys --------------------------------------------------------------------------------------
def test_async_with_offload_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["cluster.offload.rollout=true"])  # the default run.mode is async
    msg = str(e.value)
    assert "cluster.offload.rollout=true needs run.mode=sync" in msg and "cluster.colocate=false" in msg
    with pytest.raises(ConfigError, match="cluster.offload.train/rollout=true needs run.mode=sync"):
        load_config(None, BOTH)
    with pytest.raises(ConfigError, match=r"cluster.offload.timeout_s=0: must be > 0"):
        load_config(None, [*SYNC, *BOTH, "cluster.offload.timeout_s=0"])
    assert load_config(None, [*SYNC, *BOTH]).cluster.offload.on


def test_offload_takes_turns_on_the_cpu_and_needs_colocate_on_gpus():
    cfg = load_config(None, [*SYNC, *BOTH])
    check_offload(make_plan(cfg, cluster_gpus=0), cfg)  # a CPU trainer: the path the CPU tests run
    with pytest.raises(PlacementError, match="share GPUs only with cluster.colocate=true"):
        check_offload(make_plan(cfg, cluster_gpus=2), cfg)  # trainer.device=auto trains on the GPUs
    colocated = load_config(None, [*SYNC, *BOTH, "cluster.colocate=true"])
    check_offload(make_plan(colocated, cluster_gpus=1), colocated)


def test_slime_offload_flags_map_to_the_keys_and_sync():
    assert set(to_overrides(["--offload"])) == {
        "cluster.offload.train=true",
        "cluster.offload.rollout=true",
        "run.mode=sync",
    }
    assert set(to_overrides(["--offload-rollout"])) == {"cluster.offload.rollout=true", "run.mode=sync"}
    assert set(to_overrides(["--offload-train"])) == {"cluster.offload.train=true", "run.mode=sync"}
    # slime's --colocate offloads both sides unless told otherwise
    assert set(to_overrides(["--colocate", "--no-offload-rollout"])) == {
        "cluster.colocate=true",
        "cluster.offload.train=true",
        "cluster.offload.rollout=false",
        "run.mode=sync",
    }
    assert set(to_overrides(["--colocate", "--no-offload-train", "--no-offload-rollout"])) == {
        "cluster.colocate=true",
        "cluster.offload.train=false",
        "cluster.offload.rollout=false",
    }
    cfg = load_config(None, to_overrides(["--offload"]))
    assert cfg.cluster.offload.train and cfg.cluster.offload.rollout and cfg.run.mode == "sync"


def test_sglang_servers_of_an_offloading_run_start_with_the_memory_saver():
    cfg = load_config(None, [*SYNC, *BOTH, "rollout.engine=sglang"])
    assert rollout_cfg(cfg).rollout.sglang.extra_args == ["--enable-memory-saver"]
    assert rollout_cfg(rollout_cfg(cfg)).rollout.sglang.extra_args == ["--enable-memory-saver"]  # once
    assert rollout_cfg(load_config(None, ["rollout.engine=sglang"])).rollout.sglang.extra_args == []


# -- the trainer's state ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _trainer(model_path, run_dir, backend="megatron", lora_rank=0):
    from trainer_setup import make_trainer

    lora = [f"trainer.lora.rank={lora_rank}"] if lora_rank else []
    cfg = load_config(None, [f"trainer.backend={backend}", "trainer.batch_groups=2", *lora])
    cfg.trainer.micro_batch_tokens = 64
    cfg.trainer.loss.kl_coef = 0.1  # a KL reference: a second model whose weights go too
    src = ListSource([make_batch(2, 4, seed=i, version=0) for i in range(3)])
    return make_trainer(cfg, src, model_path, str(run_dir))


@pytest.mark.parametrize(("backend", "lora_rank"), [("megatron", 0), ("fsdp", 0), ("megatron", 8)])
def test_trainer_state_round_trip_is_bit_identical_and_training_goes_on_as_without(
    model_path, tmp_path, backend, lora_rank
):
    """After a step (Adam's state exists), every part leaves the device: its storages are freed, a step
    is refused; back, weights and optimizer state are bit for bit what they were, gradients zero, and
    (megatron; fsdp's round trip is the same code) the next step equals that of a twin trainer that
    never offloaded. With LoRA (the 7B on one GPU, issue #38) the frozen base goes as weights and the
    adapters' Adam state as the optimizer's."""
    tr = _trainer(model_path, tmp_path / "tr", backend, lora_rank)
    twin = _trainer(model_path, tmp_path / "twin", backend, lora_rank) if backend == "megatron" else None
    tr.step()
    mem = tr.memory
    held = mem.device_bytes()
    before = snapshot_state(mem)
    assert before[WEIGHTS] and before[OPTIMIZER]
    # fsdp keeps no gradients between steps (zero_grad(set_to_none)): nothing of theirs to move
    grads = {GRADS} if backend == "megatron" else set()
    moved = mem.offload((GRADS, OPTIMIZER))
    assert mem.offloaded == {OPTIMIZER, *grads} and 0 < mem.device_bytes() < held
    moved["bytes"] += mem.offload(PARTS)["bytes"]  # the weights after the push; the rest is skipped
    assert (
        mem.offloaded == {WEIGHTS, OPTIMIZER, *grads} and mem.device_bytes() == 0 and moved["bytes"] == held
    )
    param = next(tr.policy.model.parameters())
    local = param.to_local() if backend == "fsdp" else param
    assert local.untyped_storage().nbytes() == 0  # freed, not only counted as moved
    with pytest.raises(
        StateOffloaded, match="a training step while the trainer's .*optimizer, weights are offloaded"
    ):
        tr.step()
    assert mem.onload(PARTS)["bytes"] == held and mem.device_bytes() == held and not mem.offloaded
    after = snapshot_state(mem)
    for part in (WEIGHTS, OPTIMIZER):
        assert after[part].keys() == before[part].keys()
        assert all(torch.equal(before[part][k], after[part][k]) for k in before[part]), part
    assert all(not t.any() for t in after[GRADS].values())  # rebuilt as zeros: each step zeroes them first
    if twin is None:
        return
    twin.step()
    a, b = twin.step(), tr.step()
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    ref = dict(twin.policy.model.named_parameters())
    assert all(torch.equal(ref[n], p) for n, p in tr.policy.model.named_parameters())


def test_a_push_while_the_weights_are_off_brings_them_back_for_itself(model_path, tmp_path):
    """The feed's push for an SGLang server relaunched while the trainer waits for data, offloaded:
    the gathers read the restored weights (what a trainer that kept them pushes), then they go again."""
    twin, tr = _trainer(model_path, tmp_path / "twin"), _trainer(model_path, tmp_path / "tr")
    want = twin.backend.weight_export().snapshot()
    tr.memory.offload(PARTS)
    got = []
    tr.publisher.sender = type("Sender", (), {"push": lambda self, v, named: got.append(dict(named))})()
    tr.publisher.push(0)
    assert WEIGHTS in tr.memory.offloaded and tr.memory.device_bytes() == 0  # gone again after the push
    assert got and got[0].keys() == want.keys()
    assert all(torch.equal(want[k], got[0][k]) for k in want)


def test_a_wake_that_cannot_get_its_memory_back_says_so(monkeypatch):
    import stages.host_copy as hc

    stash = hc.HostStash(torch.device("cpu"), "trainer rank 0 (weights)")
    t = torch.randn(1000)
    stash.park(hc.unique_storages([("w", t)], torch.device("cpu")))

    def full(s, n):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(hc, "_grow", full)
    with pytest.raises(
        MemoryHeld, match=r"trainer rank 0 \(weights\): cannot get 0.00 GB back on cpu .*available"
    ):
        stash.restore()
    monkeypatch.undo()
    assert stash.restore() == 4000 and t.untyped_storage().nbytes() == 4000  # still parked: a retry works


# -- the torch engine ------------------------------------------------------------------------------
def _requests(n: int, tokens: int = 6) -> list[GenRequest]:
    p = SamplingParams(max_new_tokens=tokens)
    return [GenRequest(prompt_ids=[5, 6, 7, 8], params=p, rid=str(i)) for i in range(n)]


@pytest.fixture
def engines(model_path):
    from stages.rollout.torch_engine import TorchEngine

    pair = TorchEngine(model_path, seed=3), TorchEngine(model_path, seed=3)
    yield pair
    for e in pair:
        e.close()


def test_torch_engine_releases_holds_requests_and_wakes_bit_identical(engines):
    eng, twin = engines
    weights = {n: p.clone() for n, p in eng.model.named_parameters()}
    assert eng.memory_bytes() > 0
    eng.release_memory(["weights", "kv_cache"], timeout_s=10)
    assert eng.released == {"weights", "kv_cache"} and eng.memory_bytes() == 0
    with pytest.raises(RuntimeError, match="while the engine's weights are released"):
        eng.update_weights([], version=1)

    async def held_until_woken():
        task = asyncio.create_task(eng.generate(_requests(4)))
        await asyncio.sleep(0.3)
        assert not task.done()  # held: nothing to generate with
        await asyncio.to_thread(eng.resume_memory, ["weights"], 10)
        await asyncio.sleep(0.3)
        assert not task.done()  # weights back for the push, the cache not yet
        await asyncio.to_thread(eng.resume_memory, ["kv_cache"], 10)
        return await asyncio.wait_for(task, 30)

    got = asyncio.run(held_until_woken())
    assert all(torch.equal(weights[n], p) for n, p in eng.model.named_parameters())
    want = asyncio.run(twin.generate(_requests(4)))  # same seed, same requests, weights never moved
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    for a, b in zip(got, want):  # batch shapes may differ (when each was admitted): rounding only
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_torch_engine_release_waits_for_running_sequences_then_names_them(engines):
    eng, _ = engines

    async def running_then_release():
        task = asyncio.create_task(eng.generate(_requests(1, tokens=40)))
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        eng.pause()  # the sequence stays running (as a weight push holds it) past the release's timeout
        with pytest.raises(TimeoutError, match=r"waited 0s \(cluster.offload.timeout_s\) for 1 running"):
            await asyncio.to_thread(eng.release_memory, ["weights", "kv_cache"], 0.2)
        assert not eng.released and not task.done()
        eng.resume()  # it serves on, as before the release
        (res,) = await asyncio.wait_for(task, 30)
        assert len(res.response_ids) == 40 or res.finish_reason == "stop"
        await asyncio.to_thread(eng.release_memory, ["weights", "kv_cache"], 10)
        assert eng.released == {"weights", "kv_cache"}

    asyncio.run(running_then_release())


# -- SGLang's calls --------------------------------------------------------------------------------
class _Server(JsonHandler):
    posts: list = []
    health = 0
    refuse_resume = False
    busy = False  # the scheduler is not idle within the flush's timeout

    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            type(self).health += 1
        self._answer({"weight_version": "0"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        type(self).posts.append((self.path, body))
        if self.path == "/resume_memory_occupation" and self.refuse_resume:
            self._answer({"success": False, "message": "CUDA out of memory"})
        elif self.path.startswith("/flush_cache") and self.busy:  # as SGLang 0.5.17 answers a timed-out flush
            self.send_error(400, "Timed out waiting for idle state.")
        else:
            self._answer({"success": True})


@pytest.fixture
def sglang(tmp_path):
    from stages.rollout.config import SGLangConfig
    from stages.rollout.sglang_engine import SGLangEngine

    _Server.posts, _Server.health, _Server.refuse_resume, _Server.busy = [], 0, False, False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conf = SGLangConfig(log_dir=str(tmp_path), extra_args=["--enable-memory-saver"])
    eng = SGLangEngine(str(tmp_path), conf, start=False, port=server.server_port)
    eng._proc = type("Alive", (), {"poll": lambda self: None, "pid": 0})()  # a server that runs
    yield eng
    eng._proc = None
    server.shutdown()


def test_sglang_release_and_wake_post_the_tags_and_hold_requests_between(sglang):
    eng = sglang
    eng.release_memory(["weights", "kv_cache"], timeout_s=5)
    eng.release_memory(["weights"], timeout_s=5)  # released already: nothing sent
    # first a flush that answers once SGLang's scheduler is idle (a release that finds it busy kills it)
    (flush, body), release = _Server.posts
    assert flush.startswith("/flush_cache?timeout=") and 4.0 <= float(flush.split("=")[1]) <= 5.0
    assert release == ("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    assert eng.check_health() and _Server.health == 0  # /health would need a token generated

    async def held():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(eng.enter(1), 0.2)
        assert eng.outstanding == 0

    asyncio.run(held())
    eng.resume_memory(["weights"], timeout_s=5)  # first, for the push
    eng.resume_memory(["kv_cache"], timeout_s=5)
    assert _Server.posts[2:] == [
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]
    asyncio.run(asyncio.wait_for(eng.enter(1), 1))  # flows again
    assert eng.outstanding == 1 and not eng.released


def test_sglang_release_refusals_name_the_fix(sglang):
    eng = sglang
    eng.outstanding = 2  # requests the server is still answering
    with pytest.raises(TimeoutError, match=r"for 2 outstanding request\(s\).*cluster.offload.timeout_s"):
        eng.release_memory(["weights", "kv_cache"], timeout_s=0.2)
    assert not eng.released and _Server.posts == []
    eng.outstanding = 0
    _Server.busy = True  # our count is 0 but the scheduler does not go idle: no release is sent
    with pytest.raises(EngineError, match="flush_cache.*HTTP 400.*idle state"):
        eng.release_memory(["weights", "kv_cache"], timeout_s=0.5)
    assert not eng.released and [p for p, _ in _Server.posts if "release" in p] == []
    asyncio.run(asyncio.wait_for(eng.enter(1), 1))  # requests are not held after the failed release
    eng.outstanding, _Server.busy = 0, False
    eng.release_memory(["weights", "kv_cache"], timeout_s=5)
    _Server.refuse_resume = True
    with pytest.raises(
        MemoryHeld, match="CUDA out of memory.*processes unknown here|CUDA out of memory.*held by"
    ):
        eng.resume_memory(["weights"], timeout_s=5)
    assert eng.released == {"weights", "kv_cache"}


def test_sglang_release_without_the_memory_saver_is_refused(tmp_path):
    from stages.rollout.config import SGLangConfig
    from stages.rollout.sglang_engine import SGLangEngine

    eng = SGLangEngine(str(tmp_path), SGLangConfig(log_dir=str(tmp_path)), start=False)
    with pytest.raises(RuntimeError, match="needs the server started with --enable-memory-saver"):
        eng.release_memory(["kv_cache"], timeout_s=5)
