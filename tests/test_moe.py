"""Qwen3-MoE in the megatron trainer: logits match transformers' (fp32, CPU), export -> HF reproduces
the source weights, router metrics count what transformers' router chose, the load-balancing loss is
off unless asked for, and expert parallelism (EP=2, gloo) trains like one rank."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.testing import forward_logits as _forward
from stages.trainer.tiny_families import make_tiny


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False}, {"mlp_only_layers": [0]}],
    ids=["norm-topk", "softmax-topk", "dense-first-layer"],
)
def test_logits_match_hf(tmp_path, dist1, overrides):
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, unwrap

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe", **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    policy = build_policy(path, ddp=False, attention="sdpa")
    m = unwrap(policy.model).eval()
    kinds = [type(layer.mlp).__name__ for layer in m.decoder.layers]
    assert kinds == (["MLP", "MoELayer"] if overrides.get("mlp_only_layers") else ["MoELayer"] * 2)
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(toks).logits
        out = _forward(m, toks)
    assert (out - ref).abs().max().item() <= 1e-4


def test_export_round_trip(tmp_path, dist1):
    from safetensors.torch import load_file

    from stages.trainer.testing import assert_export_round_trips

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(f"{path}/model.safetensors")
    assert_export_round_trips(path, str(tmp_path / "out"))  # experts exported in save_pretrained's form


def test_fused_expert_checkpoint_loads(tmp_path, dist1):
    """A checkpoint that stores the experts in transformers 5's fused in-memory form
    (`mlp.experts.gate_up_proj` [E, 2I, h], `down_proj` [E, h, I]) loads to the same policy."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.trainer.export import export_hf_state
    from stages.trainer.model import build_policy

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    src = load_file(f"{path}/model.safetensors")
    fused = {k: v for k, v in src.items() if ".mlp.experts." not in k}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([src[f"{p}{e}.gate_proj.weight"], src[f"{p}{e}.up_proj.weight"]]) for e in range(4)]
        )
        fused[p + "down_proj"] = torch.stack([src[f"{p}{e}.down_proj.weight"] for e in range(4)])
    other = tmp_path / "fused"
    other.mkdir()
    shutil.copy(f"{path}/config.json", other)
    save_file(fused, str(other / "model.safetensors"))
    state = export_hf_state(build_policy(str(other), ddp=False))
    assert set(state) == set(src) and all(torch.equal(state[k], src[k]) for k in src)


def test_te_grouped_expert_names_round_trip(tmp_path):
    """The TE spec's grouped-GEMM experts (linear_fc1.weight{i}) map both ways like the local spec's
    SequentialMLP, at EP=2 (rank 1 holds experts 2 and 3) and expert-TP=2."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from stages.trainer import hf_mapping, moe

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    hc, src = AutoConfig.from_pretrained(path), load_file(f"{path}/model.safetensors")
    shards = [
        hf_mapping.hf_to_mcore_layer(src.__getitem__, hc, 1, 1, 0, True, ep=2, ep_rank=1, etp=2, etp_rank=r)
        for r in range(2)
    ]
    assert torch.equal(
        shards[0]["mlp.experts.linear_fc2.weight1"],
        src["model.layers.1.mlp.experts.3.down_proj.weight"][:, :16],
    )
    assert "pre_mlp_layernorm.weight" in shards[0]  # TE's MoE layers keep a separate pre-MLP norm
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight1"
    full = hf_mapping.merge_tp(key, [s["mlp.experts.linear_fc1.weight1"] for s in shards], hc)
    pairs = dict(hf_mapping.mcore_to_hf(moe.global_expert_key(key, 1, 2), full, hc, 1, te=True))
    for name in ("gate_proj", "up_proj"):
        assert torch.equal(
            pairs[f"model.layers.1.mlp.experts.3.{name}.weight"],
            src[f"model.layers.1.mlp.experts.3.{name}.weight"],
        )
    norm = dict(
        hf_mapping.mcore_to_hf(
            "decoder.layers.0.pre_mlp_layernorm.weight", src["model.norm.weight"], hc, 1, te=True
        )
    )
    assert list(norm) == ["model.layers.1.post_attention_layernorm.weight"]


def test_router_metrics_count_transformers_routing(tmp_path, dist1):
    """moe/load_max_over_mean is computed from the experts transformers' router picks for the same
    tokens (busiest expert's tokens over the mean, averaged over layers), leaving out the positions
    the forward is told are padding."""
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, causal_block_mask, unwrap

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    picked = []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: picked.append(out[2]))
    policy = build_policy(path, ddp=False, attention="sdpa")
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, 25:] = True  # row 1 ends in padding
    pos = torch.arange(40)[None].expand(2, -1)
    with torch.no_grad():
        hf(toks)
        unwrap(policy.model).eval()(toks, pos, causal_block_mask(padding.long()), padding_mask=padding)
    ratios = []
    for idx in picked:  # [b * s, k] in HF's (batch-major) order
        load = torch.bincount(idx[~padding.reshape(-1)].reshape(-1), minlength=4).double()
        ratios.append((load.max() / load.mean()).item())
    got = policy.router_stats.metrics()
    assert got["moe/load_max_over_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-9)
    assert got["moe/load_max_over_mean_worst_layer"] == pytest.approx(max(ratios), rel=1e-9)
    assert max(ratios) > 1.0 and "moe/dropped" not in got and "moe/aux_loss" not in got
    assert policy.router_stats.metrics() == {}  # counts reset at each step's read


def test_aux_loss_is_off_unless_asked_and_capacity_drops(tmp_path, dist1):
    """With moe_aux_loss_coef = 0 nothing but the model's output reaches the router: a loss that
    ignores the output leaves its gradient zero. With a coefficient the load-balancing loss does, and
    is reported. A capacity factor of 0.5 drops at least half of the assignments."""
    from stages.trainer.model import build_policy, unwrap

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    toks = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = {}
    for coef in (0.0, 0.1):
        policy = build_policy(path, ddp=False, attention="sdpa", moe_aux_loss_coef=coef)
        m = unwrap(policy.model).train()
        (_forward(m, toks).sum() * 0.0).backward()
        router = m.decoder.layers[0].mlp.router.weight
        grads[coef] = 0.0 if router.grad is None else router.grad.abs().sum().item()
        got = policy.router_stats.metrics()
        assert ("moe/aux_loss" in got) == (coef > 0)
    assert grads[0.0] == 0.0 and grads[0.1] > 0
    assert got["moe/aux_loss"] >= 1.0  # Switch loss: E * sum(f_i * P_i) / k >= 1, 1 when balanced

    policy = build_policy(path, ddp=False, attention="sdpa", moe_capacity_factor=0.5)
    with torch.no_grad():
        _forward(unwrap(policy.model).eval(), toks)
    assert 0.5 <= policy.router_stats.metrics()["moe/dropped"] < 1.0


def test_torch_engine_takes_exported_expert_weights(tmp_path, dist1):
    """A weight push names experts as the export (and checkpoints, and SGLang) do; the torch engine,
    whose transformers model keeps them fused, writes each into place: afterwards its model equals
    one loaded from the pushed weights' checkpoint."""
    from transformers import AutoModelForCausalLM

    from stages.rollout.torch_engine import TorchEngine
    from stages.trainer.export import export_hf_state
    from stages.trainer.model import build_policy

    old = make_tiny(str(tmp_path / "old"), "qwen3_moe", seed=1)
    new = make_tiny(str(tmp_path / "new"), "qwen3_moe", seed=2)
    state = export_hf_state(build_policy(new, ddp=False))
    engine = TorchEngine(old)
    try:
        engine.update_weights(state.items(), version=1)
        ref = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
        got, want = dict(engine.model.named_parameters()), dict(ref.named_parameters())
        assert "model.layers.0.mlp.experts.gate_up_proj" in got
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        engine.close()


def test_unmapped_moe_shapes_are_refused():
    import transformers as tf

    from stages.trainer.hf_mapping import check_supported

    for cfg in (tf.MixtralConfig(), tf.DeepseekV3Config()):  # qwen2_moe, glm4_moe: test_moe_families.py
        with pytest.raises(ValueError, match=f"{cfg.model_type!r} is not supported.*qwen3_moe"):
            check_supported(cfg)
    with pytest.raises(ValueError, match="top-1 routing with norm_topk_prob"):
        check_supported(tf.Qwen3MoeConfig(num_experts_per_tok=1, norm_topk_prob=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # one micro-batch per rank: EP ranks run the same number of forwards without the trainer's
        # equalising (moe.equalize_microbatches)
        ("--ep", "2", "--micro-batch-tokens", "4096"),
        ("--ep", "2"),  # uneven micro-batch counts per DP rank, padded to equal ones
        ("--tp", "2", "--sp"),  # megatron's MoE layers take sequence-parallel input under TP
    ],
    ids=["ep2-one-microbatch", "ep2-uneven-microbatches", "tp2-sp-etp2"],
)
def test_expert_parallel_matches_one_rank(tmp_path, layout):
    """EP=2 (each rank holds 2 of the 4 experts, tokens exchanged all-to-all, dense weights
    data-parallel) and TP=2 with sequence parallelism (each expert split over the expert-TP group)
    train like one rank: same losses,
    gradient norms and exported weights after three SGD steps."""
    from stages.trainer.testing import assert_same_training, run_parallel_check

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    extra = tuple(layout[2:]) if layout[0] == "--ep" else ()
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, "--steps", "3", *extra)
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, "--steps", "3", *layout)
    assert_same_training(ref_m, ref_w, m, w)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--ep", "2"), ("--tp", "2", "--sp")], ids=["ep2", "tp2-sp"])
def test_routing_replay_under_expert_and_sequence_parallelism_matches_one_rank(tmp_path, layout):
    """Replayed routing is laid out per rank as one rank lays it out: under EP each DP rank replays its
    own samples' rows (empty padding micro-batches route themselves), under sequence parallelism each
    TP rank its slice of the positions. Samples carry random recorded experts, which the routers would
    almost never choose themselves, so a misplaced row changes the losses."""
    from stages.trainer.testing import assert_same_training, run_parallel_check

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe")
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, "--steps", "3", "--routing-replay")
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, "--steps", "3", "--routing-replay", *layout)
    assert all(step["routing/agreement"] < 0.5 for step in ref_m)  # the recordings were replayed
    assert_same_training(ref_m, ref_w, m, w)
