"""GPU only (marked `gpu`): weight pushes into a live SGLang HTTP server land and change its logprobs.

CUDA IPC needs the server on the same GPU as the trainer process (colocated); NCCL needs the server
on another GPU (kind nvidia-h100-x2). Both start `python -m sglang.launch_server` on a random tiny
Qwen2, push perturbed HF weights, and compare the server's logprobs with an HF forward of those weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu


def _server(path: str, port: int, gpu: int):
    import requests

    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        path,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.3",
        "--disable-cuda-graph",
        "--base-gpu-id",
        str(gpu),
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            time.sleep(2)
    proc.terminate()
    raise TimeoutError("SGLang server did not come up in 300 s")


def _check_push(sender_cls, gpu: int, tmp_path, **kw):
    import requests
    import torch
    from transformers import AutoModelForCausalLM

    from buffer.net import free_port
    from stages.trainer.testing import make_tiny_hf

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", vocab_size=1024)
    proc, url = _server(path, free_port(), gpu)
    try:
        # references in bf16, as the server computes: the pushed weights, and the ones it started with
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda(0)
        old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda(0)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sender = sender_cls([url], timeout_s=120, **kw)
        named = [(n, p.detach()) for n, p in hf.named_parameters()]
        sender.push(7, named).result()
        prompt = [1, 2, 3, 4, 5]
        out = requests.post(
            url + "/generate",
            json={
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True},
            },
            timeout=60,
        ).json()
        ids = out["output_ids"]
        lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])

        def logprobs(model):
            with torch.no_grad():
                lp = torch.log_softmax(
                    model(torch.tensor([prompt + ids], device="cuda:0")).logits.float(), -1
                )[0]
            return torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)])

        new_gap = (lps - logprobs(hf)).abs().mean().item()
        old_gap = (lps - logprobs(old)).abs().mean().item()
        print(
            f"METRIC {{'transport': '{sender_cls.__name__}', 'options': {kw}, 'vs_pushed': {new_gap:.4f}, "
            f"'vs_before': {old_gap:.4f}}}"
        )
        # the server now computes the pushed weights: bf16 engine vs a bf16 HF forward of exactly the
        # bytes pushed is 0.04-0.05 on an H200 (other kernels; this random model with perturbed weights
        # is far more sensitive than a trained one), against 2.4-2.9 for the weights from before the push
        assert new_gap < 0.1 and new_gap < old_gap / 20
        assert str(out["meta_info"].get("weight_version")) == "7"
        sender.close()
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.skipif(
    not os.environ.get("SLIPSTREAM_GPU_TESTS"), reason="set SLIPSTREAM_GPU_TESTS=1 on a GPU machine"
)
def test_cuda_ipc_push_colocated(tmp_path):
    from stages.weights.cuda_ipc_sender import CudaIpcSGLangSender

    _check_push(CudaIpcSGLangSender, 0, tmp_path)


@pytest.mark.skipif(
    not os.environ.get("SLIPSTREAM_GPU_TESTS"), reason="set SLIPSTREAM_GPU_TESTS=1 on a GPU machine"
)
@pytest.mark.parametrize("receive", ["flat", "per_tensor"])  # weights.nccl_receive
def test_nccl_push_to_second_gpu(tmp_path, receive):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL transport needs the engine on a second GPU")
    from stages.weights.nccl_sender import NcclSGLangSender

    _check_push(NcclSGLangSender, 1, tmp_path, receive=receive)
