"""The CUDA IPC sender with servers on several GPUs (a colocated run with an engine beside each trainer
rank): each server gets the bucket in memory of its own GPU. A server that maps another GPU's memory and
copies it into its weights failed with 'CUDA error: invalid argument' and died (2 H200s, 2026-11-28). Here
without CUDA: the device each server runs on is asked once from its /server_info, and a bucket is moved
only to a device it is not on."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from http_stub import JsonHandler  # tests/ is on sys.path

from stages.weights.base import WeightPushError
from stages.weights.cuda_ipc_sender import CudaIpcSGLangSender, on_device


class _Info(JsonHandler):
    gets: list = []
    info: dict = {}

    def do_GET(self):  # noqa: N802
        type(self).gets.append(self.path)
        self._answer(self.info)


@pytest.fixture
def server():
    _Info.gets, _Info.info = [], {"base_gpu_id": 1, "tp_size": 1}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def _sender() -> CudaIpcSGLangSender:
    s = CudaIpcSGLangSender.__new__(CudaIpcSGLangSender)  # its constructor needs CUDA; these calls do not
    s._gpu_of, s.timeout_s = {}, 5.0
    return s


def test_a_server_on_another_gpu_is_asked_once_and_named_by_its_base_gpu_id(server):
    s = _sender()
    assert s._server_device(server, torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert s._server_device(server, torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert _Info.gets == ["/server_info"]  # asked once: a push has many buckets
    mine = torch.device("cuda", 1)
    assert s._server_device(server, mine) is mine  # the sender's own GPU: no copy will be made


def test_a_server_that_does_not_say_its_gpu_fails_the_push_by_name(server):
    _Info.info = {"tp_size": 1}
    with pytest.raises(WeightPushError, match=r"/server_info: no base_gpu_id"):
        _sender()._server_device(server, torch.device("cuda", 0))


def test_a_bucket_is_copied_only_to_a_device_it_is_not_on():
    group = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3))]
    assert on_device(group, torch.device("cpu")) is group  # where it is: the same bucket, no copy
    moved = on_device(group, torch.device("meta"))
    assert [n for n, _ in moved] == ["a", "b"]
    assert all(t.device.type == "meta" and t.shape == g.shape for (_, t), (_, g) in zip(moved, group))


def test_a_server_gone_when_asked_is_left_out_of_the_push_like_any_unreachable_one():
    with pytest.raises(WeightPushError) as e:
        _sender()._server_device("http://127.0.0.1:1", torch.device("cuda", 0))  # nothing listens on port 1
    assert e.value.unreachable and e.value.url == "http://127.0.0.1:1"
