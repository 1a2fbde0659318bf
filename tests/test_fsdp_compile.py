"""trainer.fsdp_compile with trainer.recompute (stages/trainer/fsdp_model.compile_layer): the compiled
decoder layers take packed micro-batches of every length, a no-grad pass (the old logprobs) and
checkpointed training passes without recompiling per length, and train as the eager model does.

At 7B over 2 ranks dynamo recompiled the layers' shared forward for each new variant (a length, the
no-grad pass, the checkpoint's recompute, FSDP's wrapper class) until its limit of 8, then ran the layer
eagerly in the middle of a checkpointed layer whose forward had run compiled: CheckpointError in the
first backward (bench/RESULTS.md, GPU session of 2026-11-28, 18:00). On this CPU the same growth shows on
a tiny Qwen2, in both attentions: sdpa (no graph break: dynamo traces the checkpoint into the layer's
graph) and the packed varlen rows (a graph break in the per-segment attention)."""

from __future__ import annotations

import time

import pytest
import torch

from stages.trainer.testing import make_tiny_hf

# packed rows: the segment lengths of each micro-batch; the last is an empty micro-batch's (_equal_count).
# The first is 64 tokens, the hidden size: duck sizing would make them one symbol, and the next length
# would recompile. Two segments or one: the CPU's per-segment attention recompiles its loop per segment
# count (its own code, not the layer's; a slower test, nothing more).
ROWS = [(40, 24), (40,), (50, 26), (9, 45), (12, 12), (8,)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stages.trainer.world import join_world

    join_world()  # a world of one (gloo)
    return make_tiny_hf(str(tmp_path_factory.mktemp("fsdp-compile") / "qwen2"), "qwen2")


def _build(path: str, attn: str, compiled: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from stages.trainer.fsdp_model import HeadedLM, load_lm, shard

    lm = load_lm(path, attn)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as the backend
    mesh = init_device_mesh("cpu", (1,))
    return shard(HeadedLM(lm), mesh, bf16=False, offload=False, compile_layers=compiled)


def _row(lengths: tuple[int, ...], seed: int):
    s = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "max_segment_len": max(lengths)}
    return torch.randint(0, 512, (1, s), generator=g), segments, kw


def _step(model, lengths, seed):
    """The backend's passes over one micro-batch: no-grad logprobs (eval), then a training forward and
    backward. Returns the no-grad pass's output and the parameters' gradients."""
    from stages.trainer.fsdp_model import full_tensor

    tokens, segments, kw = _row(lengths, seed)
    model.eval()
    with torch.no_grad():
        out = model(tokens, segments, **kw)
    model.train()
    hidden = model(tokens, segments, **kw)
    hidden.float().pow(2).mean().backward()
    grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def _graphs(layer) -> dict[str, int]:
    """dynamo's cache entries (one a compiled variant) of each code a decoder layer's call runs first:
    the forward it calls (an instance's own, else its class's), then each function that one wraps
    (transformers' checkpointing and deprecation wrappers, down to the layer's own forward)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    fns, fn = [], getattr(layer.forward, "__func__", layer.forward)
    while fn is not None:
        fns.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return {
        f"{f.__qualname__}@{f.__code__.co_firstlineno}": len(_debug_get_cache_entry_list(f.__code__))
        for f in fns
    }


@pytest.mark.parametrize(
    ("attn", "graphs"),
    # sdpa: no-grad pass x2 (the embeddings' output requires grad, the first layer's input alone), training
    # pass, each with a mask and without (a row of one sequence); varlen: no mask, and FSDP's subclass no
    # second graph of transformers' forward wrapper
    [("sdpa", 6), ("slipstream_varlen", 3)],
)
def test_compiled_layers_do_not_recompile_per_length_and_train_as_eager(tiny, attn, graphs):
    from stages.trainer.hf_varlen import register

    torch._dynamo.reset()
    register()
    eager, compiled = _build(tiny, attn, False), _build(tiny, attn, True)
    layer = compiled.lm.model.layers[0]
    t0, seen = time.monotonic(), []
    for i, lengths in enumerate(ROWS):
        want_out, want_grads = _step(eager, lengths, i)
        out, grads = _step(compiled, lengths, i)
        assert torch.allclose(out, want_out, atol=1e-5), (out - want_out).abs().max()
        for n, g in want_grads.items():
            assert torch.allclose(grads[n], g, atol=1e-5, rtol=1e-4), (n, (grads[n] - g).abs().max())
        seen.append(_graphs(layer))
    # every variant is there after the first two micro-batches (no-grad and training passes; sdpa's rows
    # of several sequences and of one, which has no mask); new lengths and an empty micro-batch add none
    assert seen[-1] == seen[1], seen
    assert max(seen[-1].values()) <= graphs, seen[-1]
    print(f"{attn}: {seen[-1]} in {time.monotonic() - t0:.1f}s")


def test_a_layer_past_its_recompile_limit_stops_the_step_with_the_setting_named(tiny, monkeypatch):
    """Past the limit dynamo would run the layer eagerly from then on; that must not go on silently.
    With a limit of 1, the second variant (the training pass after the no-grad one) is past it."""
    from stages.trainer import fsdp_model

    torch._dynamo.reset()
    monkeypatch.setattr(fsdp_model, "LAYER_RECOMPILE_LIMIT", 1)
    model = _build(tiny, "sdpa", True)
    with pytest.raises(fsdp_model.LayerRecompileLimit, match="trainer.fsdp_compile=false"):
        _step(model, (20, 12), 0)
