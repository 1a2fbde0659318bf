"""Adapter pushes into SGLang's LoRA serving (trainer.lora.push=adapter with rollout.engine=sglang, issue
#37; stages/rollout/sglang_lora.py). The SGLang server is the streaming stub of the sampling-knob tests,
and each adapter load's PEFT folder is read as the server would when it is posted: what is checked is what
the client sends and keeps: the launch flags, each push's adapter name, config and tensors, the adapter
and the version of every request, and which adapters are unloaded when."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from stages.rollout.engine import GenRequest, SamplingParams
from stages.rollout.sglang_lora import LoraServing
from tests.test_rollout_sampling_knobs import _StreamingStub, stub_engine  # noqa: F401 - the SGLang stub

ADAPTERS = {
    "model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 8), 0.5),
    "model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((8, 4), 0.25),
    "model.layers.1.mlp.down_proj.lora_A.weight": torch.ones(4, 16),
    "model.layers.1.mlp.down_proj.lora_B.weight": torch.ones(8, 4),
}


def read_adapter_folder(folder: str) -> dict:
    """What SGLang's /load_lora_adapter reads of a PEFT folder: its config and its tensors."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    return {"config_dict": config, "tensors": tensors, "dtype": dtypes.pop() if len(dtypes) == 1 else dtypes}


@pytest.fixture
def served(stub_engine):  # noqa: F811 - the fixture
    """The stub engine with LoRA serving of rank 4; its control calls recorded, and of each adapter load
    the folder's contents as the server found them when the load was posted."""
    eng = stub_engine
    eng.lora = LoraServing(4, ("q_proj", "down_proj"))
    eng.posted = []

    def post(path, body=None, **kw):
        if path == "/load_lora_adapter":
            body = dict(body, **read_adapter_folder(body["lora_path"]))
        eng.posted.append((path, body))
        return {}

    eng._post = post
    _StreamingStub.tokens = list(b"abcd")
    return eng


def _generate(eng):
    req = GenRequest(prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=4), rid="q")
    (r,) = asyncio.run(eng.generate([req]))
    return _StreamingStub.bodies[-1], r


def _paths(eng, path):
    return [body for p, body in eng.posted if p == path]


def test_a_server_for_adapter_pushes_is_launched_with_lora_serving_on(served):
    cmd = served._command("/m", 0)
    i = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "4"
    assert cmd[i + 1 : i + 3] == ["q_proj", "down_proj"]
    assert cmd[cmd.index("--max-loras-per-batch") + 1] == "4"
    served.lora = None
    assert "--enable-lora" not in served._command("/m", 0)


def test_an_adapter_push_loads_a_new_adapter_and_new_requests_are_served_by_it_as_its_version(served):
    body, r = _generate(served)
    assert "lora_path" not in body and r.versions == [0] * 4  # before any push: the base model
    served.update_weights(list(ADAPTERS.items()), 3)
    (load,) = _paths(served, "/load_lora_adapter")
    assert load["lora_name"] == "slipstream-v3.r0" and load["dtype"] == served.dtype
    assert load["config_dict"] == {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 4,  # alpha/r is folded into B by the trainer: SGLang's scaling must be 1
        "target_modules": ["down_proj", "q_proj"],
        "bias": "none",
    }
    assert load["tensors"].keys() == {"base_model.model." + n for n in ADAPTERS}
    for n, t in ADAPTERS.items():
        assert torch.equal(load["tensors"]["base_model.model." + n].float(), t)
    assert not Path(load["lora_path"]).exists()  # loaded: the folder is gone from shared memory
    assert _paths(served, "/update_weight_version")[-1]["new_version"] == "3"
    assert not _paths(served, "/pause_generation")  # generation goes on around an adapter load
    body, r = _generate(served)
    # the stub stamps every chunk "0": under LoRA serving a request's tokens are its adapter's version
    assert body["lora_path"] == "slipstream-v3.r0" and r.versions == [3] * 4
    assert served.version == 3 and served.requests_in_flight() == 0


def test_an_adapter_is_unloaded_only_once_no_request_uses_it(served):
    served.update_weights(list(ADAPTERS.items()), 1)
    in_flight = served.served.acquire()  # a request sent under v1, still streaming
    assert in_flight == (1, "slipstream-v1.r0")
    served.update_weights(list(ADAPTERS.items()), 2)
    served.finish_unloads()
    assert not _paths(served, "/unload_lora_adapter")  # v1 still serves that request
    served.served.release(in_flight[1])
    served.update_weights(list(ADAPTERS.items()), 3)
    served.finish_unloads()
    assert [b["lora_name"] for b in _paths(served, "/unload_lora_adapter")] == [
        "slipstream-v1.r0",
        "slipstream-v2.r0",
    ]
    assert served.served.loaded == ["slipstream-v3.r0"]


def test_a_relaunched_server_serves_the_base_until_the_catch_up_push_loads_under_a_new_name(served):
    served.update_weights(list(ADAPTERS.items()), 2)
    served._stop = lambda: None
    served.start = lambda path, version: None
    served.restart()
    body, r = _generate(served)
    assert "lora_path" not in body and r.versions == [0] * 4  # the relaunch holds no adapter
    served.update_weights(list(ADAPTERS.items()), 2)  # the transport's catch-up
    assert _paths(served, "/load_lora_adapter")[-1]["lora_name"] == "slipstream-v2.r1"
    assert _generate(served)[0]["lora_path"] == "slipstream-v2.r1"


def test_an_adapter_push_that_carries_a_whole_module_is_refused_naming_the_key(served):
    with pytest.raises(ValueError, match="modules_to_save"):
        served.update_weights([*ADAPTERS.items(), ("model.embed_tokens.weight", torch.ones(3, 8))], 1)
    assert not _paths(served, "/load_lora_adapter") and served.version == 0


def test_the_cpu_transport_delivers_an_adapter_push_to_a_server_with_lora_serving(served):
    from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender

    sender = ZmqWeightSender(timeout_s=20, min_engines=1)
    receiver = WeightReceiver(sender.address, served, name="sglang")
    try:
        sender.push(5, list(ADAPTERS.items())).result()
        assert receiver.applied == [5] and served.version == 5
        assert _paths(served, "/load_lora_adapter")[-1]["lora_name"] == "slipstream-v5.r0"
    finally:
        receiver.close()
        sender.close()


def test_the_config_takes_adapter_pushes_to_sglang_through_the_generator_only():
    from pipeline.config import ConfigError, load_config, rollout_run

    args = ["trainer.lora.rank=4", "trainer.lora.push=adapter", "rollout.engine=sglang"]
    with pytest.raises(ConfigError, match="weights.transport=cpu"):
        load_config(None, args)  # auto picks a transport that pushes into the servers directly
    with pytest.raises(ConfigError, match="modules_to_save"):
        load_config(None, [*args, "weights.transport=cpu", "trainer.lora.modules_to_save=[embed_tokens]"])
    cfg = load_config(None, [*args, "weights.transport=cpu", "run.max_staleness=3"])
    serving = rollout_run(cfg).lora_serving
    assert serving.rank == 4 and serving.target_modules == tuple(cfg.trainer.lora.target_modules)
    assert serving.max_loras_per_batch == 5  # every version a request in flight may still be under
    assert rollout_run(load_config(None, ["trainer.lora.rank=4"])).lora_serving is None  # merge pushes


def test_the_standalone_rollout_stage_launches_its_servers_for_adapter_pushes_too():
    from stages.rollout.config_file import load

    args = [
        "trainer.lora.rank=8",
        "trainer.lora.push=adapter",
        "rollout.engine=sglang",
        "run.max_staleness=1",
    ]
    serving = load(None, args).run.lora_serving
    assert serving is not None and serving.rank == 8 and serving.max_loras_per_batch == 3
    assert load(None, ["trainer.lora.rank=8"]).run.lora_serving is None


def test_an_adapter_push_returns_once_new_requests_use_it_and_unloads_the_old_one_after(served):
    """The unload of the adapter no request uses any more is not part of a push: a push returns once new
    requests go to its adapter (an adapter push within 50 ms, issue #37), and the unload follows."""
    import threading
    import time

    served.update_weights(list(ADAPTERS.items()), 1)
    served.finish_unloads()
    posted, release = served._post, threading.Event()

    def slow_unload(path, body=None, **kw):
        if path == "/unload_lora_adapter":
            release.wait(10)
        return posted(path, body, **kw)

    served._post = slow_unload
    t0 = time.monotonic()
    served.update_weights(list(ADAPTERS.items()), 2)
    took = time.monotonic() - t0
    body, r = _generate(served)
    assert took < 5 and r.versions == [2] * 4 and body["lora_path"] == "slipstream-v2.r0"
    assert not _paths(served, "/unload_lora_adapter")  # still under way
    release.set()
    served.finish_unloads()
    assert [b["lora_name"] for b in _paths(served, "/unload_lora_adapter")] == ["slipstream-v1.r0"]
    assert served.served.loaded == ["slipstream-v2.r0"]


def _unloads_failing(served, message: str):
    """`served`'s recorder of control calls, with every unload refused by an EngineError of `message`."""
    from stages.rollout.sglang_process import EngineError

    posted = served._post

    def post(path, body=None, **kw):
        if path == "/unload_lora_adapter":
            raise EngineError(message)
        return posted(path, body, **kw)

    return post


def test_an_adapter_that_cannot_be_unloaded_yet_leaves_the_push_applied_and_is_retried(served):
    served.update_weights(list(ADAPTERS.items()), 1)
    served.finish_unloads()
    posted, served._post = served._post, _unloads_failing(served, "timed out")
    served.update_weights(list(ADAPTERS.items()), 2)  # v1's unload fails: the push of v2 stands
    served.finish_unloads()
    assert served.version == 2 and served.served.loaded == ["slipstream-v1.r0", "slipstream-v2.r0"]
    served._post = posted
    served.update_weights(list(ADAPTERS.items()), 3)
    served.finish_unloads()
    assert [b["lora_name"] for b in _paths(served, "/unload_lora_adapter")] == [
        "slipstream-v1.r0",
        "slipstream-v2.r0",
    ]


def test_an_unload_that_had_worked_before_its_answer_was_lost_is_not_retried_for_ever(served):
    served.update_weights(list(ADAPTERS.items()), 1)
    served.finish_unloads()
    served._post = _unloads_failing(
        served, "POST /unload_lora_adapter -> HTTP 400: LoRA with name x does not exist"
    )
    served.update_weights(list(ADAPTERS.items()), 2)
    served.finish_unloads()
    assert served.served.loaded == ["slipstream-v2.r0"]


def test_lora_serving_is_refused_with_a_speculative_algorithm_sglang_cannot_combine_with_it():
    from pipeline.config import ConfigError, load_config

    args = [
        "trainer.lora.rank=4",
        "trainer.lora.push=adapter",
        "rollout.engine=sglang",
        "weights.transport=cpu",
    ]
    with pytest.raises(ConfigError, match="NGRAM speculative decoding only"):
        load_config(None, [*args, "rollout.sglang.extra_args=[--speculative-algorithm, EAGLE]"])
    load_config(None, [*args, "rollout.sglang.extra_args=[--speculative-algorithm=NGRAM]"])
    with pytest.raises(ConfigError, match="--max-lora-rank is set by slipstream"):
        load_config(None, [*args, "rollout.sglang.extra_args=[--max-lora-rank, 64]"])


def test_a_failed_adapter_load_leaves_no_folder_behind(served):
    """A load the server refuses is the push's error, and its folder in shared memory is removed all the
    same (a run pushing every step would fill /dev/shm)."""
    from stages.rollout.sglang_process import EngineError

    folders = []

    def refuse(path, body=None, **kw):
        if path == "/load_lora_adapter":
            folders.append(body["lora_path"])
            assert Path(body["lora_path"], "adapter_model.safetensors").exists()
            raise EngineError("POST /load_lora_adapter -> HTTP 400: LoRA is not enabled")
        return {}

    served._post = refuse
    with pytest.raises(EngineError, match="LoRA is not enabled"):
        served.update_weights(list(ADAPTERS.items()), 1)
    assert folders and not Path(folders[0]).exists()


def test_adapter_folders_go_to_shared_memory_only_where_it_has_room(monkeypatch, tmp_path):
    """A container's /dev/shm is often 64 MB: a 7B adapter push (308 MB) goes to the temporary directory
    then, and a write that fails anyway removes its folder and names the size and the fix."""
    import collections
    import errno
    import os
    import shutil

    import stages.rollout.sglang_lora as sl

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(sl, "SHM", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 0, 64 << 20))
    assert sl.adapter_folder_root(308 << 20) == str(tmp_path / "tmp")
    assert sl.adapter_folder_root(30 << 20) == str(tmp_path / "shm")

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sl.safetensors_write, "save", full)
    with pytest.raises(OSError, match=r"adapter push \(0 MB\) could not be written .*No space left.*TMPDIR"):
        sl.write_adapter_folder(dict(ADAPTERS), {"r": 4}, torch.bfloat16)
    assert os.listdir(tmp_path / "shm") == [] and os.listdir(tmp_path / "tmp") == []


def test_an_adapter_is_cast_for_its_folder_bit_for_bit_in_pieces_that_run_in_the_calling_thread():
    """The folder's bf16 tensors are exactly `.to(bfloat16)` of the trainer's fp32 adapters, made by ops
    on fewer elements than ATen's parallel grain (32768): a whole-tensor cast starts a thread per core and
    on a busy many-core GPU host took 7 ms each (3 s a push at 135M, bench/RESULTS.md)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from stages.rollout.sglang_lora import host_cast

    class Sizes(TorchFunctionMode):  # the element count of every op host_cast runs
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if torch.is_tensor(out) and getattr(func, "__name__", "") in ("copy_", "to"):
                self.numels.append(out.numel())
            return out

    g = torch.Generator().manual_seed(0)
    for shape in [(0, 4), (64, 576), (1536, 64), (3, 32767), (2, 32768 + 5)]:
        t = torch.randn(shape, generator=g) * 0.02
        with Sizes() as sizes:
            out = host_cast(t, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.shape == t.shape and out.is_contiguous()
        assert torch.equal(out.view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), shape
        assert max(sizes.numels, default=0) < 32768, (shape, max(sizes.numels))
    strided = torch.randn(64, 600, generator=g)[:, ::2]
    assert torch.equal(host_cast(strided, torch.float32), strided)
    same = torch.randn(8, generator=g, dtype=torch.bfloat16)
    assert host_cast(same, torch.bfloat16).data_ptr() == same.data_ptr()  # nothing to cast: no copy
