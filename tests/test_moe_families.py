"""Qwen2-MoE (gated shared expert, q/k/v biases) and GLM4-MoE (sigmoid routing with a score-correction
bias, group-limited top-k, a routed scaling factor, a shared expert, leading dense layers, partial
RoPE, qk-norm) in the megatron trainer: logits match transformers' (fp32, CPU) with either expert
implementation, export -> HF reproduces the checkpoint's tensors under tensor and expert
parallelism, expert parallelism trains like one rank with the routing bias left as loaded, routing
replay rows skip the dense layers, and what megatron cannot express is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from stages.trainer.testing import forward_logits as _forward
from stages.trainer.tiny_families import make_tiny


@pytest.mark.parametrize(
    ("kind", "overrides", "mlps"),
    [
        ("qwen2_moe", {}, ["MoELayer", "MoELayer"]),
        ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}, ["MLP", "MoELayer"]),
        ("glm4_moe", {}, ["MLP", "MoELayer"]),
        # no group limit, no qk-norm, every layer MoE, full rotary
        (
            "glm4_moe",
            {
                "n_group": 1,
                "topk_group": 1,
                "use_qk_norm": False,
                "first_k_dense_replace": 0,
                "partial_rotary_factor": 1.0,
            },
            ["MoELayer", "MoELayer"],
        ),
    ],
    ids=["qwen2-moe", "qwen2-moe-norm-topk-dense-first", "glm4-moe", "glm4-moe-one-group"],
)
@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_logits_match_hf(tmp_path, dist1, kind, overrides, mlps, experts):
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, unwrap

    path = make_tiny(str(tmp_path / kind), kind, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    policy = build_policy(path, ddp=False, attention="sdpa", moe_experts=experts)
    m = unwrap(policy.model).eval()
    assert [type(layer.mlp).__name__ for layer in m.decoder.layers] == mlps
    want = "GroupedExperts" if experts == "grouped" else "SequentialMLP"
    assert all(type(x.mlp.experts).__name__ == want for x in m.decoder.layers if hasattr(x.mlp, "experts"))
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(toks).logits
        out = _forward(m, toks)
    assert (out - ref).abs().max().item() <= 1e-4


def test_glm_routing_details_change_the_logits(tmp_path, dist1):
    """The tiny GLM4-MoE exercises what the match above checks: without its score-correction bias,
    its group limit or its scaling factor the logits are far from transformers'."""
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, unwrap

    path = make_tiny(str(tmp_path / "glm"), "glm4_moe")
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(toks).logits

    def off(change) -> float:
        m = unwrap(build_policy(path, ddp=False, attention="sdpa").model).eval()
        change(m.decoder.layers[1].mlp.router)
        with torch.no_grad():
            return (_forward(m, toks) - ref).abs().max().item()

    def no_groups(r):
        r.config.moe_router_num_groups = r.config.moe_router_group_topk = None

    def no_scaling(r):
        r.config.moe_router_topk_scaling_factor = None

    assert off(lambda r: r.expert_bias.data.zero_()) > 1e-2
    assert off(no_groups) > 1e-2
    assert off(no_scaling) > 1e-2


@pytest.mark.parametrize("kind", ["qwen2_moe", "glm4_moe"])
def test_export_round_trip(tmp_path, dist1, kind):
    from safetensors.torch import load_file

    from stages.trainer.testing import assert_export_round_trips

    path = make_tiny(str(tmp_path / kind), kind)
    src = load_file(f"{path}/model.safetensors")
    extra = {
        "qwen2_moe": [
            "model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight",
        ],
        "glm4_moe": [
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.7.up_proj.weight",
        ],
    }[kind]
    assert all(k in src for k in extra)  # the names save_pretrained writes, the export must too
    assert_export_round_trips(path, str(tmp_path / "out"))


@pytest.mark.parametrize("kind", ["qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_shared_experts_and_bias_round_trip_under_tp_and_ep(tmp_path, kind, te):
    """TP=2 (the shared expert split like a dense MLP, its gate and the routing bias whole on every
    rank) with EP=2 (rank 1 holds the second half of the experts) maps back to the HF tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from stages.trainer import hf_mapping, moe

    path = make_tiny(str(tmp_path / kind), kind)
    hc, src = AutoConfig.from_pretrained(path), load_file(f"{path}/model.safetensors")
    shards = [
        hf_mapping.hf_to_mcore_layer(src.__getitem__, hc, 1, 2, r, te, ep=2, ep_rank=1, etp=2, etp_rank=r)
        for r in range(2)
    ]
    got = {}
    for sub in shards[0]:
        key = f"decoder.layers.0.{sub}"
        full = hf_mapping.merge_tp(key, [s[sub] for s in shards], hc)
        if moe.is_expert_param(key):
            key = moe.global_expert_key(key, 1, moe.num_experts(hc) // 2)
        got.update(hf_mapping.mcore_to_hf(key, full, hc, 1, te=te))
    layer = {k: v for k, v in src.items() if k.startswith("model.layers.1.")}
    half = moe.num_experts(hc) // 2
    layer = {k: v for k, v in layer.items() if ".experts." not in k or int(k.split(".")[5]) >= half}
    assert set(got) == set(layer)
    assert all(torch.equal(got[k], layer[k]) for k in layer)
    if kind == "qwen2_moe":
        assert shards[0]["mlp.shared_experts.linear_fc1.weight"].shape == (48, 64)  # [gate_r; up_r]


def test_expert_bias_is_a_frozen_fp32_parameter(tmp_path, dist1):
    """GLM's routing bias is exported with the parameters (a buffer would be left out of pushes), takes
    no gradient, and stays fp32 under bf16, where Float16Module would round it."""
    from safetensors.torch import load_file, save_file

    from stages.trainer.model import build_policy, unwrap

    path = make_tiny(str(tmp_path / "glm"), "glm4_moe")
    state = load_file(f"{path}/model.safetensors")
    # a bias of a few units, like GLM-4.5's: bf16 would move it by ~1e-2
    src = state["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.linspace(3.0, 3.1, 8)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    policy = build_policy(path, ddp=False, bf16=True, moe_experts="sequential")
    router = unwrap(policy.model).decoder.layers[1].mlp.router
    params = dict(unwrap(policy.model).named_parameters())
    bias = params["decoder.layers.1.mlp.router.expert_bias"]
    assert bias is router.expert_bias and not bias.requires_grad
    assert bias.dtype == torch.float32 and torch.equal(bias, src)
    assert params["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
    assert policy.config.moe_router_bias_update_rate == 0.0


def test_expert_parallel_matches_one_rank(tmp_path):
    """GLM4-MoE at EP=2 (4 of the 8 experts per rank, the shared expert and routing bias replicated)
    trains like one rank for three SGD steps, and the routing bias is exported as loaded: megatron does
    not move it toward balanced loads."""
    from safetensors.torch import load_file

    from stages.trainer.testing import assert_same_training, run_parallel_check

    path = make_tiny(str(tmp_path / "glm"), "glm4_moe")
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, "--steps", "3")
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, "--steps", "3", "--ep", "2")
    assert_same_training(ref_m, ref_w, m, w)
    src = load_file(f"{path}/model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(w[bias], src[bias])
    assert not torch.equal(w["model.layers.1.mlp.gate.weight"], src["model.layers.1.mlp.gate.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_moe", "glm4_moe"])
def test_tensor_and_sequence_parallel_matches_one_rank(tmp_path, kind):
    """TP=2 with sequence parallelism: experts split over expert-TP, the shared expert over TP (its
    gate's gradient summed over the TP group like a norm's)."""
    from stages.trainer.testing import assert_same_training, run_parallel_check

    path = make_tiny(str(tmp_path / kind), kind)
    ref_m, ref_w = run_parallel_check(path, str(tmp_path / "one"), 1, "--steps", "3")
    m, w = run_parallel_check(path, str(tmp_path / "two"), 2, "--steps", "3", "--tp", "2", "--sp")
    assert_same_training(ref_m, ref_w, m, w)


def test_replayed_glm_routing_matches_a_forced_hf_router(tmp_path, dist1):
    """Routing replay on the sigmoid router: recorded experts other than its own (each id + 1 mod 8,
    outside the groups it would keep, too) are weighted by the unbiased scores at them, renormalised
    and scaled, as transformers' router weights its own choice."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from stages.trainer.model import build_policy, unwrap
    from stages.trainer.routing_replay import RoutingReplay

    path = make_tiny(str(tmp_path / "glm"), "glm4_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    toks = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    gate, own = hf.model.layers[1].mlp.gate, []
    handle = gate.register_forward_hook(lambda _m, _in, out: own.append(out[2]))
    with torch.no_grad():
        hf(toks)
    handle.remove()
    forced = (own[0] + 1) % 8

    def forced_router(hidden):
        logits = F.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float())
        w = logits.sigmoid().gather(1, forced)
        return logits, w / (w.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor, forced

    gate.forward = forced_router
    policy = build_policy(path, ddp=False, attention="sdpa")
    m = unwrap(policy.model).eval()
    replay = RoutingReplay(m, policy.hf_config)
    replay.set_microbatch(forced.view(1, 24, 1, 4))  # [b, s, MoE layers, k]
    with torch.no_grad():
        ref = hf(toks).logits
        out = _forward(m, toks)
    assert (out - ref).abs().max().item() <= 1e-4
    assert replay.metrics() == {"routing/replayed": 24.0, "routing/agreement": 0.0}


def test_routing_rows_skip_the_dense_layers(tmp_path):
    """Routing replay (engine rows and the trainer's routers) counts GLM's leading dense layers and
    Qwen2-MoE's mlp_only_layers / decoder_sparse_step out."""
    import json

    from stages.models import moe_layer_flags
    from stages.rollout.routing import RoutingRows

    assert moe_layer_flags({"num_hidden_layers": 4, "first_k_dense_replace": 3}) == [False] * 3 + [True]
    qwen2 = {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layer_flags(qwen2) == [False, True, False, False, False, True]
    path = make_tiny(str(tmp_path / "glm"), "glm4_moe", num_hidden_layers=3)
    rows = RoutingRows.of_model(path)
    assert (rows.layers, rows.moe_layers, rows.top_k) == (3, (1, 2), 4)
    with open(f"{path}/config.json") as f:
        from stages.trainer.moe_config import num_experts

        assert num_experts(json.load(f)) == 8  # config.json says n_routed_experts


@pytest.mark.parametrize("kind", ["glm4_moe", "qwen2_moe"])
def test_the_torch_engine_records_each_families_routing(tmp_path, kind):
    """The CPU engine's routing recorder finds both families' routers (GLM's is `Glm4MoeTopkRouter`):
    one row of top-k experts per forwarded position and MoE layer, none for dense layers."""
    import asyncio

    from transformers import AutoConfig

    from stages.models import moe_layer_flags
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.torch_engine import TorchEngine

    path = make_tiny(str(tmp_path / kind), kind)
    hc = AutoConfig.from_pretrained(path)
    engine = TorchEngine(path, record_routing=True, seed=0)
    try:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        (res,) = asyncio.run(engine.generate([GenRequest(prompt_ids=[5, 9, 11, 2], params=params, rid="0")]))
    finally:
        engine.close()
    layers = sum(moe_layer_flags(hc))
    assert res.routed_experts.shape == (4 + 3 - 1, layers * hc.num_experts_per_tok)


def test_glm_trains_on_replayed_routing(tmp_path):
    """GLM's config names its experts n_routed_experts: the trainer's replay path (recorded experts in
    the samples, here random ones) reads it and trains, the routers overridden by the recordings."""
    from stages.trainer.testing import run_parallel_check

    path = make_tiny(str(tmp_path / "glm"), "glm4_moe")
    metrics, _ = run_parallel_check(path, str(tmp_path / "one"), 1, "--steps", "2", "--routing-replay")
    assert len(metrics) == 2 and all(m["routing/agreement"] < 0.5 for m in metrics)


def test_unmapped_shapes_are_refused():
    import transformers as tf

    from stages.trainer.hf_mapping import check_supported

    glm = dict(n_routed_experts=16, num_experts_per_tok=4)
    check_supported(tf.Glm4MoeConfig(**glm, n_group=4, topk_group=2))  # top-2 group scores: mapped
    check_supported(tf.Qwen2MoeConfig())
    cases = [
        (tf.Glm4MoeConfig(**glm, n_group=8, topk_group=4), r"n_group=8, topk_group=4 .*top-2 scores"),
        (tf.Glm4MoeConfig(**glm, norm_topk_prob=False), "norm_topk_prob=false .*always renormalises"),
        (tf.Glm4MoeConfig(**glm, n_shared_experts=0), "n_shared_experts=0"),
        (tf.Glm4MoeConfig(n_routed_experts=4, num_experts_per_tok=1), "top-1 routing"),
        (tf.Qwen2MoeConfig(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
        (tf.Qwen2MoeConfig(use_sliding_window=True), "use_sliding_window=true"),
        (tf.Qwen2MoeConfig(num_experts_per_tok=1, norm_topk_prob=True), "top-1 routing with norm_topk_prob"),
        (tf.MixtralConfig(), r"'mixtral' is not supported.*glm4_moe"),
        (tf.DeepseekV3Config(), r"'deepseek_v3' is not supported"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            check_supported(cfg)
