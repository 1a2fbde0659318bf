"""LoRA on the megatron trainer (trainer.lora, issue #37): the base stays frozen and only the adapters
train; TP (with and without sequence parallelism), PP and DP train as one rank does; the PEFT folder it
exports loads in `peft` and gives the trainer's logits, and a run starts from one (init_from); a
checkpoint holds the adapters only and resumes exactly; a push sends the merged tensors that have
adapters, after which the engine's logprobs are the trainer's, and the KL reference is the base."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from stages.trainer.config import LoraConfig, TrainerConfig
from stages.trainer.testing import (
    ListSource,
    assert_same_training,
    checkpoint_state,
    make_batch,
    make_tiny_hf,
    run_parallel_check,
)

LORA = ("--lora-rank", "4", "--steps", "3")  # 3 steps: B starts at zero, so A first moves at step 2


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    path = make_tiny_hf(str(d / "qwen2"), "qwen2", vocab_size=259)
    return path, d, run_parallel_check(path, str(d / "tp1"), 1, *LORA)


def test_only_the_adapted_tensors_train(one_rank):
    path, d, (metrics, weights) = one_rank
    base = load_file(f"{path}/model.safetensors")
    adapted = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "_proj.weight")
    for name, w in weights.items():
        moved = not torch.equal(w, base[name].to(w.dtype))
        assert moved == name.endswith(adapted), name  # biases, norms and embeddings stay the base's
    assert metrics[0]["loss"] != metrics[-1]["loss"]


@pytest.mark.parametrize(
    "layout", [("--tp", "2"), ("--tp", "2", "--sp"), ("--pp", "2")], ids=["tp2", "tp2-sp", "pp2"]
)
def test_a_parallel_layout_trains_the_adapters_as_one_rank_does(one_rank, layout):
    path, d, (ref_m, ref_w) = one_rank
    name = "-".join(layout)
    m, w = run_parallel_check(path, str(d / name), 2, *LORA, *layout)
    assert_same_training(ref_m, ref_w, m, w)
    ref_adapter = load_file(f"{d}/tp1/adapter/adapter_model.safetensors")
    adapter = load_file(f"{d}/{name}/adapter/adapter_model.safetensors")
    assert set(adapter) == set(ref_adapter)
    for k in ref_adapter:  # the adapters themselves, gathered from the TP shards / pipeline stages
        assert torch.allclose(adapter[k], ref_adapter[k], atol=1e-5), k


SAVE = ("--lora-save", "embed_tokens,model.norm,input_layernorm")


@pytest.fixture(scope="module")
def with_whole_modules(one_rank):
    """The LoRA run with modules trained whole beside the adapters (modules_to_save), at TP=1."""
    path, d, _ = one_rank
    return path, d, run_parallel_check(path, str(d / "save-tp1"), 1, *LORA, *SAVE)


def test_modules_to_save_train_whole_and_under_tp_as_on_one_rank(with_whole_modules):
    path, d, (ref_m, ref_w) = with_whole_modules
    base = load_file(f"{path}/model.safetensors")
    assert not torch.equal(ref_w["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(ref_w["model.norm.weight"], base["model.norm.weight"])
    assert torch.equal(
        ref_w["model.layers.0.post_attention_layernorm.weight"],
        base["model.layers.0.post_attention_layernorm.weight"],
    )
    m, w = run_parallel_check(path, str(d / "save-tp2"), 2, *LORA, *SAVE, "--tp", "2")
    assert_same_training(ref_m, ref_w, m, w)  # the vocabulary-parallel embedding's gradient too


def test_a_peft_folder_with_modules_to_save_loads_in_peft_with_the_embeddings_tied(with_whole_modules):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, d, (_, merged) = with_whole_modules
    tokens = torch.tensor([[3, 17, 42, 7, 250, 9, 100, 11]])
    with torch.no_grad():
        via_peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path), str(d / "save-tp1" / "adapter")
        )(tokens).logits
        trained = AutoModelForCausalLM.from_pretrained(path)
        trained.load_state_dict(merged, strict=False)
        mine = trained(tokens).logits
    assert (via_peft - mine).abs().max().item() < 1e-4


def test_activation_recompute_trains_the_adapters_as_without(one_rank):
    """megatron's recompute checkpoints each layer; with the embeddings frozen the first layer's input
    needs no gradient, and a checkpoint whose inputs need none passes none back: nothing would train."""
    path, d, (ref_m, ref_w) = one_rank
    m, w = run_parallel_check(path, str(d / "recompute"), 1, *LORA, "--recompute")
    assert_same_training(ref_m, ref_w, m, w)


@pytest.mark.slow
def test_dp2_trains_the_adapters_as_one_rank_does(one_rank):
    path, d, (ref_m, ref_w) = one_rank
    m, w = run_parallel_check(path, str(d / "dp2"), 2, *LORA)
    assert_same_training(ref_m, ref_w, m, w)


def test_the_peft_export_loads_in_peft_and_gives_the_trainers_logits(one_rank):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, d, (_, merged) = one_rank
    adapter = d / "tp1" / "adapter"
    tokens = torch.tensor([[3, 17, 42, 7, 250, 9, 100, 11]])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(adapter))
        via_peft = peft_model(tokens).logits
        trained = AutoModelForCausalLM.from_pretrained(path)
        trained.load_state_dict(merged, strict=False)  # the trainer's merged weights (tied head)
        mine = trained(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(path)(tokens).logits
    assert (via_peft - mine).abs().max().item() < 1e-4
    assert (via_peft - base).abs().max().item() > 1e-3  # the adapters moved the model


def test_init_from_a_peft_folder_starts_where_it_was_saved(one_rank, dist1):
    from stages.trainer.export import export_hf_state
    from stages.trainer.model import build_policy

    path, d, (_, merged) = one_rank
    lc = LoraConfig(rank=4, alpha=8.0, init_from=str(d / "tp1" / "adapter"))
    state = export_hf_state(build_policy(path, lora=lc, ddp=False))
    for name, w in merged.items():
        assert torch.allclose(state[name], w, atol=1e-6), name
    with pytest.raises(ValueError, match="trainer.lora.rank and trainer.lora.alpha"):
        build_policy(path, lora=LoraConfig(rank=8, alpha=8.0, init_from=lc.init_from), ddp=False)
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter folder"):
        build_policy(path, lora=LoraConfig(rank=4, init_from=str(d)), ddp=False)


def test_adapters_from_a_peft_folder_make_the_launcher_push_before_the_first_step(one_rank, tmp_path):
    """The engines start from the model folder at version 0. With init_from, version 0 is other weights
    (base + the folder's adapters), so the launcher must push them before the first samples are made, as
    after a resume (pipeline/orchestration/actors.py reads Trainer.engines_start_behind)."""
    from test_trainer_direction import _cfg
    from trainer_setup import make_trainer

    path, d, _ = one_rank
    cfg = _cfg()
    cfg.trainer.lora = LoraConfig(rank=4, alpha=8.0)
    assert not make_trainer(cfg, ListSource([]), path, tmp_path / "fresh").engines_start_behind
    cfg.trainer.lora = LoraConfig(rank=4, alpha=8.0, init_from=str(d / "tp1" / "adapter"))
    tr = make_trainer(cfg, ListSource([]), path, tmp_path / "from_peft")
    assert tr.version == 0 and tr.engines_start_behind


def test_generators_wait_for_the_first_push_when_version_0_is_not_the_model_folders():
    """The launcher's side of the test above: with init_from (or trainer.load + finetune) a generator
    generates nothing before its receiver applied the trainer's first push (actors.GeneratorActor)."""
    import torch
    from test_weights_cpu import FakeEngine

    from pipeline.config import load_config, weights_start_elsewhere
    from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender

    assert not weights_start_elsewhere(load_config(None, ["trainer.lora.rank=4"]))
    assert weights_start_elsewhere(load_config(None, ["trainer.lora.rank=4", "trainer.lora.init_from=/peft"]))
    assert weights_start_elsewhere(load_config(None, ["trainer.load=/ckpt", "trainer.finetune=true"]))
    assert not weights_start_elsewhere(load_config(None, ["trainer.load=/ckpt"]))  # its version is stale
    sender = ZmqWeightSender(timeout_s=10, min_engines=1)
    receiver = WeightReceiver(sender.address, FakeEngine(), name="e")
    try:
        assert not receiver.wait_applied(0.3)
        sender.push(0, [("a", torch.ones(3))]).result()
        assert receiver.wait_applied(5.0)
    finally:
        receiver.close()
        sender.close()


def test_a_checkpoint_holds_the_adapters_only_and_resumes_exactly(tmp_path):
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    args = ("--lora-rank", "4", "--optimizer", "adam", "--lr", "0.01")
    full = str(tmp_path / "full")
    full_m, full_w = run_parallel_check(path, full, 1, *args, "--steps", "4", "--checkpoint-every", "2")
    tensors, _ = checkpoint_state(f"{full}/run/checkpoints/step_000004")
    model_keys = [k for k in tensors if not k.startswith("optimizer.")]
    assert model_keys and all(".lora." in k for k in model_keys)  # no frozen base weight
    assert any(".exp_avg_sq." in k for k in tensors)  # the adapters' Adam state
    cut = str(tmp_path / "resumed")
    shutil.copytree(f"{full}/run", f"{cut}/run")
    shutil.rmtree(f"{cut}/run/checkpoints/step_000004")
    with open(f"{cut}/run/checkpoints/latest", "w") as f:
        f.write("step_000002")
    second, weights = run_parallel_check(path, cut, 1, *args, "--steps", "2")
    assert_same_training(full_m, full_w, full_m[:2] + second, weights)


def test_a_merged_push_sends_the_adapted_tensors_and_the_engine_samples_the_trainers_policy(tmp_path):
    from trainer_setup import engine_sample, make_trainer

    from pipeline.config import RunConfig
    from stages.rollout.torch_engine import TorchEngine
    from stages.trainer.packing import pack
    from stages.weights.zmq_transport import WeightReceiver, ZmqWeightSender

    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.lr = 2, 5e-2
    cfg.trainer.loss.kl_coef = 0.1  # the reference: the base, with the adapters off
    cfg.trainer.lora = LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    cfg.weights.push_every = 1
    batches = [make_batch(2, 4, seed=i) for i in range(2)]
    trainer = make_trainer(cfg, ListSource(batches), path, str(tmp_path / "run"))
    sender = ZmqWeightSender(timeout_s=30, min_engines=1)
    engine, base_engine = TorchEngine(path, seed=0), TorchEngine(path, seed=0)
    receiver = WeightReceiver(sender.address, engine, name="torch")
    pushed: list[str] = []
    apply = engine.update_weights

    def recording(named, version):
        named = list(named)
        pushed.extend(n for n, _ in named)
        apply(named, version)

    engine.update_weights = recording
    trainer.attach_sender(sender)
    try:
        for _ in range(2):
            trainer.step()
        trainer.wait_push()
        assert engine.version == trainer.version == 2
        sent = {n.split(".", 3)[3] for n in pushed}  # model.layers.{i}.<module>.weight
        assert sent == {"self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight"}
        req, res, tb, mine = engine_sample(engine, trainer)
        assert (mine - tb.rollout_logprobs).abs().max().item() <= 1e-4
        # the KL reference is the base model: what an engine that never got a push computes
        ref = trainer.backend.logprobs(tb, pack(tb, [0], 4096), reference=True)
        base_lp = _engine_logprobs(base_engine, req.prompt_ids, res.response_ids)
        assert (ref - base_lp).abs().max().item() <= 1e-4
        assert (ref - mine).abs().max().item() > 1e-4
    finally:
        receiver.close(), sender.close(), engine.close(), base_engine.close(), trainer.close()


def test_a_bf16_merge_is_the_fp32_merge_rounded_once(tmp_path):
    """Lora.merged on bf16 weights (a GPU push) is one fused GEMM; it equals the fp32 merge rounded to
    bf16 up to the adapters' own bf16 rounding, and it does change the weight."""
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.model import unwrap

    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.lr = 2, 5e-2
    cfg.trainer.lora = LoraConfig(rank=4, target_modules=["q_proj", "o_proj", "up_proj"])
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    trainer = make_trainer(
        cfg, ListSource([make_batch(2, 4, seed=i) for i in range(2)]), path, str(tmp_path / "r")
    )
    try:
        trainer.step(), trainer.step()
        lora, params = trainer.policy.lora, dict(unwrap(trainer.policy.model).named_parameters())
        keys = [k for k in params if lora.adapter_for(k) is not None and not lora.is_adapter_param(k)]
        assert len(keys) >= 3
        for key in keys:
            w = params[key].detach().to(torch.bfloat16)
            delta = lora.adapter_for(key).delta(key)
            assert delta.abs().max() > 0  # trained: B is no longer zero
            want = (w.float() + delta).to(torch.bfloat16)
            got = lora.merged(key, w)
            assert got.dtype == torch.bfloat16 and not torch.equal(got, w)
            ulp = w.float().abs().max() * 2**-7  # one bf16 step at the largest weight
            assert (got.float() - want.float()).abs().max() <= ulp + 0.02 * delta.abs().max()
    finally:
        trainer.close(save=False)


def _engine_logprobs(engine, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logprobs of `response` after `prompt` under the engine's model (temperature 1)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(lora={"rank": 4}, layer_spec="te"), "trainer.layer_spec=local"),
        (dict(lora={"rank": 4, "target_modules": ["qkv_proj"]}), "target_modules"),
        (dict(lora={"rank": 4}, loss={"advantage": "ppo"}), "critic has no adapters"),
        (dict(lora={"rank": 4, "push": "adapters"}), r"lora\.push"),
    ],
    ids=["te-spec", "unknown-module", "ppo-critic", "unknown-push"],
)
def test_a_lora_setting_the_trainer_cannot_honour_is_refused_with_the_key(change, match):
    import msgspec

    raw = msgspec.to_builtins(TrainerConfig())
    raw.update(change)
    with pytest.raises((ValueError, msgspec.ValidationError), match=match):
        msgspec.convert(raw, TrainerConfig)


def test_on_an_moe_model_the_mlp_names_target_the_experts_and_attention_names_only_attention(tmp_path, dist1):
    """(tests/test_lora_moe.py trains, pushes and exports the experts' adapters.)"""
    from stages.trainer.model import build_policy
    from stages.trainer.tiny_families import make_tiny

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    policy = build_policy(path, lora=LoraConfig(rank=4, target_modules=["q_proj", "o_proj"]), ddp=False)
    assert len(policy.lora.adapters) == 2 * policy.hf_config.num_hidden_layers and not policy.lora.experts
    policy = build_policy(path, lora=LoraConfig(rank=4, target_modules=["down_proj"]), ddp=False)
    assert not policy.lora.sites and len(policy.lora.experts) == policy.hf_config.num_hidden_layers
    assert all(ex.targeted == ("down_proj",) for ex in policy.lora.experts)


def test_one_lora_step_raises_the_logprobs_of_positive_advantage_tokens(tmp_path):
    """The policy-gradient direction through the adapters, checked from outside as for full fine-tuning
    (tests/test_trainer_direction.py): HF forwards of the initial folder and of the merged export."""
    from test_trainer_direction import BIG_CLIP, _advantage_signs, _cfg, _hf_logprobs, _samples
    from trainer_setup import make_trainer
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    hf_initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    samples = _samples(hf_initial, seed=1)
    cfg = _cfg(optimizer="adam", lr=1e-2, grad_clip=BIG_CLIP)
    cfg.trainer.lora = LoraConfig(rank=8, alpha=16)
    from buffer.record import samples_to_batch

    tr = make_trainer(cfg, ListSource([samples_to_batch(samples)]), path, str(tmp_path / "run"))
    tr.step()
    hf_after = AutoModelForCausalLM.from_pretrained(tr.save_hf(str(tmp_path / "hf")), dtype=torch.float32)
    before, after = _hf_logprobs(hf_initial, samples), _hf_logprobs(hf_after.eval(), samples)
    sign = _advantage_signs(samples)
    delta = [a - b for a, b in zip(after, before)]
    gain = sum(float(sg * d.sum()) for sg, d in zip(sign, delta))
    moved = sum(float(abs(d).sum()) for d in delta)
    assert moved > 1e-2 * sum(len(d) for d in delta), (gain, moved)
    assert gain > 0.5 * moved, (gain, moved)
