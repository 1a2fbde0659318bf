"""A server killed while trainer rank 0 broadcasts a bucket to it, over real NCCL on two GPUs.

The 2-GPU kill test of 2026-11-27 (03:00) killed the SGLang server mid-broadcast: NCCL waited for the
dead peer until its watchdog ended the trainer's process. The sender now makes the weight group with
the watchdog only reporting, watches its broadcast beside the server's load call, and aborts the group
when the call finds the server gone (stages/weights/sglang_transport.py). The CPU test of that
(tests/test_weights_group_processes.py) runs it on gloo, which fails the broadcast by itself; this one
runs the real NcclSGLangSender on GPU 0 against the same stand-in server joined by SGLang's own NCCL
helper on GPU 1, which kills itself at the load of the second push: the group's communicator is set
up by then and rank 0's broadcast is in flight, as in that run (its bucket holds 256 MB, more than
NCCL's buffers take without the peer). Then a direct push (push_now) in several buckets, packed on
the GPU as they come, lands in the relaunched server. Needs 2 GPUs and SGLang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from test_weights_group_processes import _end, _info, _launch, _named, _sums  # tests/ is on sys.path

pytestmark = pytest.mark.gpu


@pytest.fixture
def two_gpus():
    pytest.importorskip("sglang")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the trainer's and the server's)")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[1] if visible else "1"  # the server's GPU, as this process numbers them


def test_a_server_killed_mid_broadcast_over_nccl_is_left_out_and_the_trainer_lives_on(two_gpus):
    from buffer.net import free_port
    from stages.weights.nccl_sender import NcclSGLangSender
    from stages.weights.sglang_protocol import align_nccl_env

    torch.cuda.set_device(0)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    timeout_s = 10.0  # the group's own timeout is twice this: the test outlives it below
    # the server's NCCL cuMem setting must be this process's (align_nccl_env keeps a user's value)
    cumem = align_nccl_env()["NCCL_CUMEM_ENABLE"]
    server_env = {"STANDIN_BACKEND": "nccl", "CUDA_VISIBLE_DEVICES": two_gpus, "NCCL_CUMEM_ENABLE": cumem}
    procs: list[subprocess.Popen] = []
    sender = NcclSGLangSender([url], timeout_s=timeout_s, restart_grace_s=120, group_name=f"abort-{port}")
    try:
        server = _launch(port, procs, die_on_load=2, env=server_env)  # one bucket a push: dies in push 2

        def named(scale: float) -> list:
            g = torch.Generator(device="cuda").manual_seed(int(scale))
            big = torch.randn(8192, 16384, device="cuda", generator=g, dtype=torch.bfloat16)  # 256 MB
            return [(n, t.cuda()) for n, t in _named(scale)] + [("big.weight", big)]

        first = named(1.0)
        out = sender.push(1, first).result(timeout=60)
        assert out["engines"] == 1 and _info(url)["weights"] == pytest.approx(_sums(first), rel=1e-6)

        second = named(2.0)
        t0 = time.monotonic()
        down = sender.push(2, second).result(timeout=60)  # no WeightPushError: left out, the trainer goes on
        assert (down["engines"], down["engines_skipped"]) == (0, 1)
        assert time.monotonic() - t0 < timeout_s + 5, "the push waited for the dead server"
        assert server.wait(timeout=30) == -signal.SIGKILL
        # past the aborted group's own timeout: its watchdog, which ended the trainer in that run,
        # must not end this process now
        time.sleep(2 * timeout_s + 5)

        _launch(port, procs, env=server_env)  # relaunched: base weights, no groups
        caught = sender.catch_up().result(timeout=60)
        assert (caught["version"], caught["engines"]) == (2, 1)
        got = _info(url)
        assert got["weight_version"] == "2" and got["groups"] == sender.group_names[1:2]
        assert got["weights"] == pytest.approx(_sums(second), rel=1e-6)

        sender.bucket_bytes = 64 << 20  # the small tensors in one bucket, the 256 MB one alone
        third = named(3.0)
        direct = sender.push_now(3, iter(third), expect_bytes=300 << 20)
        assert direct["engines"] == 1 and direct["bytes"] == sum(
            t.numel() * t.element_size() for _, t in third
        )
        got = _info(url)
        assert got["weight_version"] == "3" and got["weights"] == pytest.approx(_sums(third), rel=1e-6)
    finally:
        _end(sender, procs)
