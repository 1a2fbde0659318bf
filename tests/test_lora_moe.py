"""LoRA on MoE models (trainer.lora, issue #37): one adapter per routed expert and projection
(stages/trainer/lora_experts.py) beside megatron's SequentialMLP and the grouped experts alike; only the
adapters train; expert parallelism trains as one rank does; the PEFT folder covers the experts and loads
in `peft`; merged pushes make the engine's logprobs the trainer's; and push=adapter sends the adapters
alone, which the torch engine applies over the base it keeps (stages/rollout/torch_model.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stages.trainer.config import LoraConfig
from stages.trainer.testing import ListSource, make_batch
from stages.trainer.tiny_families import make_tiny

ADAPTED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "_proj.weight")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of LoRA on every target module (attention and the experts) of a tiny Qwen3-MoE:
    (model folder, the megatron model's parameters before and after the steps, the merged HF export
    with its adapter/ folder)."""
    from stages.trainer.model import unwrap

    d = tmp_path_factory.mktemp("lora-moe")
    path = make_tiny(str(d / "moe"), "qwen3_moe")
    trainer = _trainer(d, path, "merge", target_modules=list(LoraConfig().target_modules))
    model = unwrap(trainer.policy.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        for _ in range(2):
            trainer.step()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        yield path, before, after, trainer.save_hf(str(d / "hf"))
    finally:
        trainer.close(save=False)


def test_only_the_adapters_train_and_every_expert_has_its_own(trained):
    path, before, after, hf = trained
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == {n for n in before if ".lora." in n}, moved  # no base weight, every adapter
    assert any(".lora.experts." in n for n in moved)
    src, merged = load_file(f"{path}/model.safetensors"), load_file(f"{hf}/model.safetensors")
    assert set(merged) == set(src)
    for name, w in merged.items():  # merged: the routers, norms and embeddings stay the base's
        assert (not torch.equal(w, src[name])) == name.endswith(ADAPTED), name
    adapter = load_file(f"{hf}/adapter/adapter_model.safetensors")
    for layer in range(2):
        for e in range(4):
            for part in ("gate_proj", "up_proj", "down_proj"):
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{part}.lora_B.weight"
                assert adapter[key].abs().max() > 0, key  # B starts at zero: it trained


def test_the_peft_export_covers_the_experts_loads_in_peft_and_gives_the_trainers_logits(trained):
    """peft 0.21 on transformers 5 converts the per-expert adapters onto the fused experts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _, _, hf = trained
    tokens = torch.tensor([[3, 17, 42, 7, 250, 9, 100, 11, 64, 300]])
    with torch.no_grad():
        base_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        base = base_model(tokens).logits
        via_peft = PeftModel.from_pretrained(base_model, f"{hf}/adapter")(tokens).logits
        mine = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(tokens).logits
    assert (via_peft - mine).abs().max().item() < 1e-4
    assert (via_peft - base).abs().max().item() > 1e-3


def test_init_from_the_peft_folder_starts_where_it_was_saved_in_either_expert_layout(trained):
    from stages.trainer.export import export_hf_state
    from stages.trainer.model import build_policy

    path, _, _, hf = trained
    merged = load_file(f"{hf}/model.safetensors")
    lc = LoraConfig(rank=4, alpha=16.0, init_from=f"{hf}/adapter")
    for experts in ("grouped", "sequential"):
        state = export_hf_state(build_policy(path, lora=lc, ddp=False, moe_experts=experts))
        assert set(state) == set(merged)
        for name, w in merged.items():
            assert torch.allclose(state[name], w, atol=1e-6), (experts, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [
        ("qwen3_moe", ("--ep", "2")),
        ("qwen3_moe", ("--tp", "2", "--sp")),  # expert-TP = 2: each expert's adapters split too
        ("qwen2_moe", ("--ep", "2")),  # a shared expert's adapters beside the experts'
        ("glm4_moe", ("--tp", "2", "--sp")),  # a dense first layer and a shared expert
    ],
    ids=["qwen3-ep2", "qwen3-tp2-sp", "qwen2-ep2", "glm4-tp2-sp"],
)
def test_expert_and_tensor_parallelism_train_the_expert_adapters_as_one_rank_does(tmp_path, family, layout):
    from stages.trainer.testing import assert_same_training, run_parallel_check

    path = make_tiny(str(tmp_path / "moe"), family)
    lora = ("--lora-rank", "4", "--steps", "3")  # every target module: attention, MLPs and the experts
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, *lora)
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, *lora, *layout)
    assert_same_training(ref_m, ref_w, m, w)
    ref_adapter = load_file(f"{tmp_path}/one/adapter/adapter_model.safetensors")
    adapter = load_file(f"{tmp_path}/two/adapter/adapter_model.safetensors")  # gathered from the ranks
    assert set(adapter) == set(ref_adapter) and any(".mlp.experts.3." in k for k in adapter)
    for k in ref_adapter:
        assert torch.allclose(adapter[k], ref_adapter[k], atol=1e-5), k


@pytest.mark.slow
def test_a_checkpoint_shards_the_expert_adapters_over_ep_and_resumes_exactly(tmp_path):
    import shutil

    from stages.trainer.testing import assert_same_training, checkpoint_state, run_parallel_check

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    args = ("--lora-rank", "4", "--optimizer", "adam", "--lr", "0.01", "--ep", "2")
    full = str(tmp_path / "full")
    full_m, full_w = run_parallel_check(path, full, 2, *args, "--steps", "4", "--checkpoint-every", "2")
    tensors, _ = checkpoint_state(f"{full}/run/checkpoints/step_000004")
    assert tensors["decoder.layers.0.lora.experts.A1"].shape[0] == 4  # both ranks' experts, in one tensor
    assert all(".lora." in k for k in tensors if not k.startswith(("optimizer.", "chained_")))
    cut = str(tmp_path / "resumed")
    shutil.copytree(f"{full}/run", f"{cut}/run")
    shutil.rmtree(f"{cut}/run/checkpoints/step_000004")
    with open(f"{cut}/run/checkpoints/latest", "w") as f:
        f.write("step_000002")
    second, weights = run_parallel_check(path, cut, 2, *args, "--steps", "2")
    assert_same_training(full_m, full_w, full_m[:2] + second, weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_grouped_and_sequential_experts_carry_the_same_adapters_and_merge_to_the_trainers_logits(
    tmp_path, dist1, family
):
    """The same adapters (random B, so they matter) on both expert modules: the same logits and
    adapter gradients, and the merged export computes them in transformers. Qwen2-MoE adds a shared
    expert's adapters, GLM-4.5 a dense first layer's and a shared expert's."""
    from transformers import AutoModelForCausalLM

    from stages.trainer.export import export_hf_state
    from stages.trainer.model import build_policy, unwrap
    from stages.trainer.testing import forward_logits

    path = make_tiny(str(tmp_path / family), family)
    toks = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    for experts in ("grouped", "sequential"):
        policy = build_policy(path, ddp=False, attention="sdpa", moe_experts=experts, lora=LoraConfig(rank=4))
        m = unwrap(policy.model).train()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if ".lora." in n and n.rsplit(".", 1)[1].startswith("B"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        logits = forward_logits(m, toks)
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        assert grads and all(".lora." in n for n in grads)  # the base is frozen
        assert all(p.grad is None for n, p in m.named_parameters() if not p.requires_grad)
        out[experts] = (logits.detach(), grads, export_hf_state(policy))
    (lg, gg, state), (ls, gs, _) = out["grouped"], out["sequential"]
    assert (lg - ls).abs().max().item() <= 1e-5
    assert gg.keys() == gs.keys() and any(".lora.experts." in n for n in gg)
    for n in gg:
        torch.testing.assert_close(gg[n], gs[n], atol=1e-4, rtol=1e-3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        _load_per_expert(hf, state)
        assert (hf(toks).logits - lg).abs().max().item() <= 1e-4


def _load_per_expert(model, state: dict) -> None:
    """Write HF tensors named per expert (as the export, pushes and checkpoints name them) into a
    transformers 5 model, whose experts are fused."""
    from stages.rollout.torch_model import checkpoint_names

    names = checkpoint_names(model)
    for k, v in state.items():
        names[k].copy_(v)


def _trainer(tmp_path, path: str, push: str, experts: str = "grouped", target_modules=None):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig

    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.lr, cfg.trainer.moe_experts = 2, 5e-2, experts
    targets = target_modules or ["q_proj", "gate_proj", "up_proj", "down_proj"]
    cfg.trainer.lora = LoraConfig(rank=4, target_modules=targets, push=push)
    cfg.trainer.loss.kl_coef = 0.1  # the reference: the base, with the adapters off
    cfg.weights.push_every = 1
    batches = [make_batch(2, 4, seed=i) for i in range(2)]
    return make_trainer(cfg, ListSource(batches), path, str(tmp_path / f"run-{push}-{experts}"))


def _sample(engine, trainer):
    """One generation of `engine` as a training batch, with the trainer's logprobs of it."""
    from trainer_setup import engine_sample

    req, res, tb, mine = engine_sample(engine, trainer)
    return req.prompt_ids, res.response_ids, tb, mine


def _reference_logprobs(trainer, tb) -> torch.Tensor:
    from stages.trainer.packing import pack

    return trainer.backend.logprobs(tb, pack(tb, [0], 4096), reference=True)


def _pushing(trainer, engine):
    """Connect `engine` to `trainer` over the CPU transport; returns (sender, receiver, pushed names)."""
    from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender

    sender = ZmqWeightSender(timeout_s=30, min_engines=1)
    receiver = WeightReceiver(sender.address, engine, name="torch")
    pushed: dict[str, torch.Tensor] = {}
    apply = engine.update_weights

    def recording(named, version):
        named = list(named)
        pushed.update(named)
        apply(named, version)

    engine.update_weights = recording
    trainer.attach_sender(sender)
    return sender, receiver, pushed


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_a_merged_push_sends_the_adapted_experts_and_the_engine_samples_the_trainers_policy(
    tmp_path, experts
):
    from stages.rollout.torch_engine import TorchEngine

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    trainer = _trainer(tmp_path, path, "merge", experts)
    engine, base_engine = TorchEngine(path, seed=0), TorchEngine(path, seed=0)
    sender, receiver, pushed = _pushing(trainer, engine)
    try:
        for _ in range(2):
            trainer.step()
        trainer.wait_push()
        assert engine.version == 2
        sent = {".".join(n.rsplit(".", 2)[-2:]) for n in pushed}  # the adapted modules' weights only
        assert sent == {"q_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
        assert sum(".experts." in n for n in pushed) == 2 * 4 * 3  # every expert of both layers
        prompt, response, tb, mine = _sample(engine, trainer)
        assert (mine - tb.rollout_logprobs).abs().max().item() <= 1e-4
        # the KL reference is the base model, expert adapters off too: an engine that got no push
        ref = _reference_logprobs(trainer, tb)
        assert (ref - _engine_logprobs(base_engine, prompt, response)).abs().max().item() <= 1e-4
        assert (ref - mine).abs().max().item() > 1e-4
    finally:
        receiver.close(), sender.close(), engine.close(), base_engine.close(), trainer.close()


def test_an_adapter_push_sends_the_adapters_only_and_the_engine_computes_the_merged_policy(tmp_path):
    """push=adapter: the bytes of a push are the adapters' (A and B of every adapted module, no weight);
    the engine, keeping its base weights, samples with the trainer's logprobs, and computes what an
    engine given the merged weights computes."""
    from stages.rollout.torch_engine import TorchEngine
    from stages.trainer.export import export_hf_state

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    trainer = _trainer(tmp_path, path, "adapter")
    engine, merged_engine = TorchEngine(path, seed=0), TorchEngine(path, seed=0)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    sender, receiver, pushed = _pushing(trainer, engine)
    try:
        for _ in range(2):
            trainer.step()
        stats = trainer.wait_push()
        assert engine.version == 2
        assert pushed and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in pushed)
        assert len(pushed) == 2 * 2 * (1 + 4 * 3)  # A and B of q_proj and 4 experts x 3, 2 layers
        assert stats["bytes"] == sum(t.numel() * t.element_size() for t in pushed.values())
        for n, p in engine.model.named_parameters():  # one base, kept
            if n in base:
                assert torch.equal(p, base[n]), n
        prompt, response, tb, mine = _sample(engine, trainer)
        assert (mine - tb.rollout_logprobs).abs().max().item() <= 1e-4
        merged_engine.update_weights(export_hf_state(trainer.policy).items(), version=2)
        via_adapters = _engine_logprobs(engine, prompt, response)
        via_merged = _engine_logprobs(merged_engine, prompt, response)
        assert (via_adapters - via_merged).abs().max().item() <= 1e-5
        assert (via_adapters - tb.rollout_logprobs).abs().max().item() <= 1e-4
        base_engine = TorchEngine(path, seed=0)
        try:  # the adapters moved the policy: the base computes other logprobs
            assert (via_adapters - _engine_logprobs(base_engine, prompt, response)).abs().max() > 1e-3
        finally:
            base_engine.close()
    finally:
        receiver.close(), sender.close(), engine.close(), merged_engine.close(), trainer.close()


def _engine_logprobs(engine, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_an_adapter_push_into_sglang_is_refused_naming_the_key(tmp_path, dist1):
    from stages.trainer.export import PolicyExport
    from stages.trainer.model import build_policy
    from stages.weights.config import WeightsConfig
    from stages.weights.cuda_ipc_sender import CudaIpcSGLangSender
    from stages.weights.publisher import WeightPublisher
    from stages.weights.zmq_transport import ZmqWeightSender

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    lc = LoraConfig(rank=4, push="adapter")
    export = PolicyExport(build_policy(path, lora=lc, ddp=False))
    publisher = WeightPublisher(WeightsConfig(), export, rank=0, device=torch.device("cpu"))
    sglang = CudaIpcSGLangSender.__new__(CudaIpcSGLangSender)  # no server: only its kind matters here
    with pytest.raises(ValueError, match="trainer.lora.push=merge"):
        publisher.attach(sglang)
    torch_engines = ZmqWeightSender(timeout_s=5)
    try:
        publisher.attach(torch_engines)
    finally:
        torch_engines.close()
