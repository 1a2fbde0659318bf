"""HF <-> megatron mapping: logits of the megatron policy match transformers' forward (fp32, CPU), and
export -> HF round trip reproduces the source weights."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.testing import make_tiny_hf


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_logits_match_hf(tmp_path, dist1, kind, attention):
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    path = make_tiny_hf(str(tmp_path / kind), kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    policy = build_policy(path, ddp=False, attention=attention)
    m = unwrap(policy.model).eval()
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    seg = torch.zeros_like(toks)
    with torch.no_grad():
        ref = hf(toks).logits
        out = m(toks, torch.arange(40)[None].expand(2, -1), causal_block_mask(seg))
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
def test_packed_sequences_match_alone(tmp_path, dist1, attention):
    """Two sequences packed in one row with a block-diagonal mask give their unpacked logits."""
    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    path = make_tiny_hf(str(tmp_path / "q"), "qwen2")
    m = unwrap(build_policy(path, ddp=False, attention=attention).model).eval()
    a = torch.randint(0, 512, (1, 13), generator=torch.Generator().manual_seed(1))
    b = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    row = torch.cat([a, b], 1)
    seg = torch.tensor([[0] * 13 + [1] * 9])
    with torch.no_grad():
        packed = m(row, torch.arange(22)[None], causal_block_mask(seg))
        alone_b = m(b, torch.arange(9)[None], causal_block_mask(torch.zeros_like(b)))
    assert (packed[:, 13:] - alone_b).abs().max().item() <= 1e-4


def test_export_round_trip(tmp_path, dist1):
    from safetensors.torch import load_file

    from stages.trainer.export import export_hf_state, save_hf
    from stages.trainer.model import build_policy

    for kind in ("qwen2", "llama"):
        path = make_tiny_hf(str(tmp_path / kind), kind)
        src = load_file(f"{path}/model.safetensors")
        state = export_hf_state(build_policy(path, ddp=False))
        assert set(state) == set(src)
        for k in src:
            assert torch.equal(state[k], src[k]), k
        out = save_hf(state, path, str(tmp_path / f"{kind}-out"))
        assert set(load_file(f"{out}/model.safetensors")) == set(src)
        from transformers import AutoModelForCausalLM

        toks = torch.randint(0, 512, (1, 16))
        with torch.no_grad():  # the exported folder loads with save_pretrained's reader, same logits
            a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(toks).logits
            b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(toks).logits
        assert torch.equal(a, b)


def test_host_snapshot_is_a_copy_reused_and_refreshed(tmp_path, dist1):
    """weights.snapshot=cpu: the pinned buffers hold exactly the exported weights, training does not
    reach them, and the next push refills the same buffers (pinned once) with the new values, which
    is why the trainer waits for the previous push before taking the next snapshot."""
    from stages.trainer.export import HostSnapshot, export_hf_state
    from stages.trainer.model import build_policy, unwrap

    policy = build_policy(make_tiny_hf(str(tmp_path / "q"), "qwen2"), ddp=False)
    host = HostSnapshot()
    plain = export_hf_state(policy)
    first = export_hf_state(policy, host=host)
    assert set(first) == set(plain) and all(torch.equal(first[k], plain[k]) for k in plain)
    with torch.no_grad():
        for p in unwrap(policy.model).parameters():
            p.add_(1.0)
    assert all(torch.equal(first[k], plain[k]) for k in plain)  # a copy: training does not reach it
    second = export_hf_state(policy, host=host)
    assert all(second[k] is first[k] for k in plain)  # the same buffers, refilled
    assert all(torch.equal(second[k], plain[k] + 1.0) for k in plain)


@pytest.mark.parametrize("fp32_head", [False, True])
def test_bf16_lm_head_in_fp32(tmp_path, dist1, fp32_head):
    """model.fp32_lm_head: a bf16 policy's logits are the exact fp32 product of its bf16 hidden states
    and weights (SGLang's --enable-fp32-lm-head), not that product rounded to bf16; gradients still
    reach the weight."""
    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    path = make_tiny_hf(str(tmp_path / "q"), "qwen2")
    policy = build_policy(path, bf16=True, ddp=False, fp32_lm_head=fp32_head)
    gpt = unwrap(policy.model)
    seen = {}
    gpt.output_layer.register_forward_pre_hook(lambda mod, args: seen.update(h=args[0]))
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    out = policy.model(toks, torch.arange(40)[None].expand(2, -1), causal_block_mask(torch.zeros_like(toks)))
    w = (
        gpt.output_layer.weight
        if gpt.output_layer.weight is not None
        else gpt.embedding.word_embeddings.weight
    )
    assert seen["h"].dtype == w.dtype == torch.bfloat16
    exact = (seen["h"].float() @ w.float().t()).transpose(0, 1)
    err = (out - exact).abs().max().item()
    if fp32_head:
        assert err <= 1e-5
    else:  # bf16 logits: rounded to 2^-8 relative, visibly off the exact product
        assert err > 1e-3
    out.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_sdpa_attention_gradients_match_unfused(tmp_path, dist1):
    """trainer.attention=sdpa trains the same model: fp32 gradients through packed, grouped-query
    attention equal those of megatron's DotProductAttention."""
    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    path = make_tiny_hf(str(tmp_path / "q"), "qwen2")
    toks = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    seg = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    proj = torch.randn(512, generator=torch.Generator().manual_seed(4))
    grads = {}
    for attention in ("sdpa", "unfused"):
        m = unwrap(build_policy(path, ddp=False, attention=attention).model)
        out = m(toks, torch.arange(24)[None].expand(2, -1), causal_block_mask(seg))
        (out.log_softmax(-1) @ proj).sum().backward()
        grads[attention] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads["unfused"].keys() and len(grads["sdpa"]) > 10
    for n, g in grads["sdpa"].items():
        ref = grads["unfused"][n]
        assert (g - ref).abs().max() <= 1e-4 * (1 + ref.abs().max()), n


def test_a_direct_push_sends_the_live_weights_as_gathered_and_refuses_a_sender_that_keeps_pushes(
    tmp_path, dist1
):
    """weights.snapshot=direct: no copy is taken; the sender is handed the HF tensors as they are
    gathered (the same names and values as a snapshot), pushes them before push_weights returns, and its
    figures come out under the names a background push reports them at the next step (the run's stall
    is summed from those). The CPU transport keeps every push for engines that join later, which a lazy
    source cannot give it: refused, naming the fix."""
    from types import SimpleNamespace

    from stages.trainer.export import PolicyExport, export_hf_state, iter_hf_state
    from stages.trainer.model import build_policy
    from stages.weights.publisher import WeightPublisher

    policy = build_policy(make_tiny_hf(str(tmp_path / "q"), "qwen2"), ddp=False)
    plain = export_hf_state(policy)

    class Direct:
        def push_now(self, version, named, expect_bytes=None):
            self.got, self.expect = {n: t.clone() for n, t in named}, expect_bytes
            return {"version": version, "seconds": 0.25, "engines": 1, "bytes": 10}

    cpu = torch.device("cpu")
    t = WeightPublisher(
        SimpleNamespace(snapshot="direct"), PolicyExport(policy), rank=0, device=cpu, sender=Direct()
    )
    out = t._push_direct(4)
    assert out == {"push/prev_seconds": 0.25, "push/prev_engines": 1, "push/prev_bytes": 10}
    assert set(t.sender.got) == set(plain) and all(torch.equal(t.sender.got[k], plain[k]) for k in plain)
    # the size hint for the push's bucket buffer covers what was pushed
    assert t.sender.expect >= sum(x.numel() * x.element_size() for x in plain.values())
    assert dict(iter_hf_state(policy)).keys() == plain.keys()
    assert t.wait()["seconds"] == 0.25  # sync mode waits for it: it is already done
    assert t.wait() is None

    class Keeps:  # the CPU transport's sender: push() only
        def push(self, version, named):
            raise AssertionError("not called")

    keeps = WeightPublisher(
        SimpleNamespace(snapshot="direct"), PolicyExport(policy), rank=0, device=cpu, sender=Keeps()
    )
    with pytest.raises(ValueError, match="weights.snapshot=direct pushes into SGLang servers"):
        keeps._push_direct(4)


def test_auto_pushes_direct_where_the_gpu_copy_does_not_go_and_a_direct_push_can():
    """weights.snapshot=auto: a model over 10 % of the trainer's GPU (7B on an 80 GB card) is pushed
    direct into SGLang servers (at 7B the host copy cost 0.34 s of each step and 0.35 s of each push's
    pause, direct 0.16 s of both); a smaller one keeps its GPU copy; pipeline stages and the CPU
    transport, which cannot take a direct push, keep the host copy. Decided once, by rank 0, for all."""
    from types import SimpleNamespace

    from stages.weights.publisher import WeightPublisher

    class SGLangLike:
        def push_now(self, version, named, expect_bytes=None): ...

    class KeepsPushes:
        def push(self, version, named): ...

    def goes_direct(
        snapshot="auto", *, fits=False, pp=1, sender=SGLangLike(), device="cuda", rank=0, rank0_said=None
    ):
        t = WeightPublisher(
            SimpleNamespace(snapshot=snapshot),
            None,
            rank=rank,
            device=torch.device(device),
            stages=pp,
            sender=sender,
        )
        t._copy_fits_gpu = lambda: fits
        # rank 0's answer on every rank (a broadcast); alone, a rank's own
        t._rank0_says = lambda yes: yes if rank0_said is None else rank0_said
        first = t.goes_direct()
        t.wc.snapshot, t._copy_fits_gpu = "gpu", lambda: True  # decided once: not asked again
        assert t.goes_direct() is first
        return first

    assert goes_direct() is True
    assert goes_direct(fits=True) is False
    assert goes_direct(pp=2) is False
    assert goes_direct(sender=KeepsPushes()) is False
    assert goes_direct(device="cpu") is False
    assert goes_direct("direct", fits=True) is True
    assert goes_direct("cpu") is False and goes_direct("gpu") is False
    # rank 1 holds no sender (it cannot tell) and gathers in step with whatever rank 0 decided
    assert goes_direct(rank=1, sender=None, rank0_said=True) is True
    assert goes_direct(rank=1, sender=None, rank0_said=False) is False


def test_a_direct_push_under_tensor_parallelism_gathers_in_step_and_sends_the_trained_weights(tmp_path):
    """weights.snapshot=direct on two ranks (TP=2, real gloo gathers in two processes): rank 0's sender
    takes the tensors while rank 1 only gathers, a push after every step, none stuck in a gather, and
    the last push holds exactly the weights training ended with."""
    from safetensors.torch import load_file

    from stages.trainer.testing import run_parallel_check

    path = make_tiny_hf(str(tmp_path / "q"), "qwen2")
    _, trained = run_parallel_check(
        path, str(tmp_path / "tp2"), 2, "--tp", "2", "--direct-push", timeout_s=240
    )
    pushed = load_file(str(tmp_path / "tp2" / "pushed.safetensors"))
    assert set(pushed) == set(trained)
    for k in trained:
        assert torch.equal(pushed[k], trained[k]), k
