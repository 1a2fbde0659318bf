"""The fast adapter push (trainer.lora.push=adapter into SGLang, issue #37's <= 50 ms): the trainer sends
the adapters in its weights' dtype with alpha/r folded into B, both done on the device the adapters live
on (lora_peft.adapter_push_state), and the engine writes them to the adapter folder from their own memory
(stages/rollout/safetensors_write.py) instead of casting on its host and copying through safetensors'
save_file. What is checked: the writer's files are safetensors' own format, and the tensors and the
folder are what the old path (fp32 push, host cast, save_file) made, bit for bit."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from stages.rollout import safetensors_write
from stages.rollout.sglang_lora import host_cast, write_adapter_folder

# -- the writer ---------------------------------------------------------------------------------------


def _odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt).removeprefix("torch.")
        out[f"{name}.odd"] = torch.randn(3, 5, 7, generator=g).to(dt)
        out[f"{name}.scalar"] = torch.tensor(1.5, dtype=dt)
        out[f"{name}.empty"] = torch.empty(0, 4, dtype=dt)
        out[f"{name}.strided"] = torch.randn(6, 9, generator=g).to(dt)[:, ::2]  # not contiguous
        out[f"{name}.vector"] = torch.randn(13, generator=g).to(dt)
    out["ids"] = torch.arange(7, dtype=torch.int64)
    out["mask"] = torch.tensor([True, False, True])
    return out


def test_the_writer_round_trips_through_safetensors_own_reader(tmp_path):
    tensors = _odd_tensors()
    path = str(tmp_path / "x.safetensors")
    safetensors_write.save(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0  # the data starts 8-byte aligned, as safetensors writes it
    head = json.loads(raw[8 : 8 + n])
    assert head["bfloat16.odd"] == {"dtype": "BF16", "shape": [3, 5, 7], "data_offsets": [0, 210]}
    assert head["float16.scalar"]["shape"] == [] and head["float32.empty"]["shape"] == [0, 4]
    assert len(raw) == 8 + n + max(e["data_offsets"][1] for k, e in head.items() if k != "__metadata__")


def test_the_writer_reads_what_safetensors_writes_the_same_way(tmp_path):
    """The same tensors through save_file and through the writer load to the same tensors."""
    tensors = {k: v.contiguous() for k, v in _odd_tensors().items()}
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    safetensors_write.save(tensors, str(tmp_path / "ours.safetensors"))
    theirs, ours = (
        load_file(str(tmp_path / "theirs.safetensors")),
        load_file(str(tmp_path / "ours.safetensors")),
    )
    assert set(theirs) == set(ours)
    for k in theirs:
        assert theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]), k


def test_the_writer_goes_on_where_writev_stopped_and_past_its_buffer_limit(tmp_path, monkeypatch):
    """writev may write part of its buffers and takes at most IOV_MAX of them: every byte still lands."""
    import os

    many = {f"t{i}": torch.full((i % 5 + 1,), float(i), dtype=torch.bfloat16) for i in range(1500)}
    safetensors_write.save(many, str(tmp_path / "many.safetensors"))  # over Linux's 1024 buffers
    back = load_file(str(tmp_path / "many.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in many.items())

    real = os.writev

    def short(fd, buffers):  # at most 3 buffers and 1000 bytes a call
        budget, parts = 1000, []
        for b in list(buffers)[:3]:
            parts.append(memoryview(b)[:budget])
            budget -= len(parts[-1])
            if not budget:
                break
        return real(fd, parts)

    monkeypatch.setattr(os, "writev", short)
    tensors = _odd_tensors()
    safetensors_write.save(tensors, str(tmp_path / "short.safetensors"))
    back = load_file(str(tmp_path / "short.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_the_writer_refuses_a_dtype_it_does_not_write(tmp_path):
    with pytest.raises(ValueError, match="complex64"):
        safetensors_write.save({"z": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "z.safetensors"))


# -- the engine's adapter folder ----------------------------------------------------------------------


def _adapters(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for module, (o, i) in {
        "model.layers.0.self_attn.q_proj": (24, 16),
        "model.layers.1.mlp.down_proj": (16, 40),
    }.items():
        out[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(4, i, generator=g) * 0.02).to(dtype)
        out[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(o, 4, generator=g) * 0.02).to(dtype)
    return out


def test_a_bf16_push_is_written_as_it_comes_and_reads_as_the_old_path_wrote_it(tmp_path):
    """The trainer's bf16 tensors pass host_cast untouched (no copy) and the folder holds what the fp32
    push, cast on the host and written by save_file, held: the same bf16 bits, read by safetensors and
    by peft's own loader."""
    from peft.utils import load_peft_weights

    fp32 = _adapters()
    old = tmp_path / "old"
    old.mkdir()
    save_file(
        {n: host_cast(t, torch.bfloat16) for n, t in fp32.items()}, str(old / "adapter_model.safetensors")
    )
    bf16 = {n: t.to(torch.bfloat16) for n, t in fp32.items()}
    assert all(host_cast(t, torch.bfloat16).data_ptr() == t.data_ptr() for t in bf16.values())
    folder = write_adapter_folder(bf16, {"r": 4, "lora_alpha": 4}, torch.bfloat16, root=str(tmp_path))
    was = load_file(str(old / "adapter_model.safetensors"))
    now = load_file(str(Path(folder) / "adapter_model.safetensors"))
    via_peft = load_peft_weights(folder, device="cpu")
    assert set(now) == set(was) == set(via_peft)
    for n in was:
        assert now[n].dtype == torch.bfloat16 and torch.equal(
            now[n].view(torch.int16), was[n].view(torch.int16)
        )
        assert torch.equal(via_peft[n].view(torch.int16), was[n].view(torch.int16))
    assert json.loads((Path(folder) / "adapter_config.json").read_text()) == {"r": 4, "lora_alpha": 4}


# -- the trainer's side -------------------------------------------------------------------------------


def _policy(tmp_path, bf16: bool):
    """A tiny Qwen3-MoE policy (dense sites and per-expert adapters) with random nonzero adapters (B
    starts at zero), rank 4 and alpha 16 (B is scaled by 4)."""
    from stages.trainer.config import LoraConfig
    from stages.trainer.model import build_policy, unwrap
    from stages.trainer.tiny_families import make_tiny

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    lc = LoraConfig(rank=4, alpha=16.0, push="adapter", target_modules=["q_proj", "gate_proj", "down_proj"])
    policy = build_policy(path, lora=lc, ddp=False, bf16=bf16)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in unwrap(policy.model).named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return policy


def test_adapter_push_state_casts_and_scales_b_as_the_fp32_push_then_the_host_cast_did(
    tmp_path, dist1, monkeypatch
):
    """In bf16, the bits the engine's host cast made of the fp32 push; cast before the tensors leave
    the device they were gathered on (on a GPU trainer: one kernel each, not a host loop)."""
    from stages.trainer.lora_peft import PEFT_PREFIX, adapter_push_state, gather_peft_state

    lora = _policy(tmp_path, bf16=False).lora
    peft = gather_peft_state(lora)
    fp32 = adapter_push_state(lora)
    to_host, cpu = [], torch.Tensor.cpu

    def recorded(t, *a, **kw):  # the dtype of every tensor sent to the host
        to_host.append(t.dtype)
        return cpu(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "cpu", recorded)
    bf16 = adapter_push_state(lora, dtype=torch.bfloat16)
    monkeypatch.undo()
    floats = [d for d in to_host if d.is_floating_point]  # (gather_object's own byte tensors aside)
    assert len(floats) == len(bf16) and set(floats) == {torch.bfloat16}
    assert set(fp32) == set(bf16) == {n[len(PEFT_PREFIX) :] for n in peft}
    assert any(".experts." in n for n in bf16) and any(".self_attn." in n for n in bf16)
    for n, t in fp32.items():
        want = peft[PEFT_PREFIX + n] * (4.0 if n.endswith(".lora_B.weight") else 1.0)
        assert t.dtype == torch.float32 and torch.equal(t, want), n
        assert bf16[n].dtype == torch.bfloat16 and bf16[n].device.type == "cpu", n
        # the engine's old host cast of the fp32 push, bit for bit
        assert torch.equal(bf16[n].view(torch.int16), host_cast(t, torch.bfloat16).view(torch.int16)), n
    assert all(t.dtype == torch.float32 for t in peft.values())  # save_peft's folder stays fp32


@pytest.mark.parametrize("bf16", [True, False])
def test_a_snapshot_sends_the_adapters_in_the_dtype_of_the_trainers_weights(tmp_path, dist1, bf16):
    from stages.trainer.export import PolicyExport
    from stages.trainer.lora_peft import adapter_push_state

    export = PolicyExport(_policy(tmp_path, bf16=bf16))
    want = torch.bfloat16 if bf16 else torch.float32
    assert export.weights_dtype == want
    state = export.snapshot()
    fp32 = adapter_push_state(export.policy.lora)
    assert set(state) == set(fp32)
    for n, t in state.items():
        assert t.dtype == want and torch.equal(t, fp32[n].to(want)), n
