"""Helpers for trainer tests and benchmarks: tiny random HF models and synthetic Arrow batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from buffer.record import Sample, samples_to_batch

TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
)


def make_sglang_tiny(path: str, seed: int = 0):
    """Save a random Qwen2 (4 layers, hidden 512, untied, bf16, default init) for the SGLang GPU
    tests and bench to `path`; returns the model. Built on the machine, so no model is carried."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return model


def make_tiny_hf(path: str, kind: str = "qwen2", seed: int = 1, **overrides) -> str:
    """Save a random tiny HF model (qwen2: tied + qkv bias; llama: untied; qwen3: qk-norm) to `path`."""
    import torch
    import transformers as tf

    cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, True),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, False),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, True),
    }[kind]
    kw = dict(TINY, tie_word_embeddings=cls[2])
    if kind == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw))
    if kind == "qwen2":  # qkv biases start at zero; make them matter for the mapping test
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("_proj.bias"):
                    p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def make_samples(
    num_groups: int,
    group_size: int,
    *,
    vocab: int = 512,
    seed: int = 0,
    version: int = 0,
    prompt_len=(3, 9),
    response_len=(2, 12),
    prefix: str = "",
) -> list[Sample]:
    """Random complete groups with random rewards and plausible rollout logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        plen = int(rng.integers(*prompt_len))
        prompt = rng.integers(0, vocab, plen)
        for i in range(group_size):
            n = int(rng.integers(*response_len))
            mask = np.ones(n, np.uint8)
            if n > 3:
                mask[-1] = 0
            out.append(
                Sample.build(
                    uid=f"{prefix}g{g}-{i}-s{seed}",
                    group_id=f"{prefix}g{g}-s{seed}",
                    group_index=i,
                    group_size=group_size,
                    prompt_ids=prompt,
                    response_ids=rng.integers(0, vocab, n),
                    rollout_logprobs=-rng.uniform(4.0, 8.0, n),
                    versions=np.full(n, version),
                    loss_mask=mask,
                    reward=float(rng.integers(0, 2)),
                )
            )
    return out


def make_batch(num_groups: int, group_size: int, **kw) -> pa.RecordBatch:
    return samples_to_batch(make_samples(num_groups, group_size, **kw))


class ListSource:
    """A BatchSource over pre-made batches (tests): hands each out once, records what it was asked."""

    address = "list-source (tests)"

    def __init__(self, batches):
        self.batches = list(batches)
        self.versions: list[int] = []
        self.fetches: list[tuple[int, int, int]] = []

    def fetch(self, num_groups, version, max_staleness, timeout_s):
        self.fetches.append((num_groups, version, max_staleness))
        return self.batches.pop(0) if self.batches else None

    def set_version(self, version):
        self.versions.append(version)

    def stats(self):
        return {"left": len(self.batches)}


def run_parallel_check(model_path: str, out: str, nproc: int, *args: str, timeout_s: float = 300):
    """`nproc` ranks of `python -m stages.trainer.parallel_check` (tests of the parallel layouts) ->
    (per-step metrics, exported HF weights). A failing rank raises AssertionError with its output."""
    import json

    from safetensors.torch import load_file

    from stages.trainer.ranks import RanksFailed, run_ranks

    try:
        run_ranks(
            "stages.trainer.parallel_check",
            ["--model-path", model_path, "--out", out, *args],
            nproc,
            timeout_s,
        )
    except RanksFailed as e:
        raise AssertionError(f"parallel_check: {e}") from None
    with open(f"{out}/metrics.json") as f:
        return json.load(f), load_file(f"{out}/weights.safetensors")


def assert_same_training(ref_m: list[dict], ref_w: dict, m: list[dict], w: dict, atol: float = 1e-5) -> None:
    """Two parallel_check runs trained alike: per-step loss, gradient norm and trained tokens, and the
    exported weights (the same tensors, each within `atol`)."""
    import torch

    for a, b in zip(ref_m, m, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"])
        assert a["tokens/trained"] == b["tokens/trained"]
    assert set(w) == set(ref_w)
    for k in ref_w:
        assert torch.allclose(w[k], ref_w[k], atol=atol), k


def checkpoint_state(step_dir: str) -> tuple[dict, dict]:
    """A megatron checkpoint folder (checkpoints/step_N) read back whole, without process groups ->
    (its sharded tensors by key: the model's, and the optimizer's as `optimizer.state.<exp_avg|...>.<key>`
    in the distributed optimizer's fully_reshardable format; megatron's common state: param groups,
    steps, the optimizer's sharding type)."""
    import os
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(step_dir, os.path.join(tmp, "whole.pt"))
        whole = torch.load(os.path.join(tmp, "whole.pt"), weights_only=False)
    tensors = {k: v for k, v in whole.items() if torch.is_tensor(v)}
    return tensors, torch.load(os.path.join(step_dir, "common.pt"), weights_only=False)


def assert_export_round_trips(path: str, out_dir: str) -> None:
    """The megatron build of the HF folder `path` exports exactly its tensors, and the folder saved from
    them computes the same logits as the original (needs init_distributed)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.trainer.export import export_hf_state, save_hf
    from stages.trainer.model import build_policy

    src = load_file(f"{path}/model.safetensors")
    state = export_hf_state(build_policy(path, ddp=False))
    assert set(state) == set(src)
    for k in src:
        assert torch.equal(state[k], src[k]), k
    out = save_hf(state, path, out_dir)
    toks = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(toks).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(toks).logits
    assert torch.equal(a, b)


def forward_logits(model, tokens):
    """A megatron GPTModel's logits [b, s, V] for `tokens` [b, s] (each row one causal sequence), on
    the tokens' device: what the tests compare against transformers' forward."""
    import torch

    from stages.trainer.model import causal_block_mask

    positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
    return model(tokens, positions, causal_block_mask(torch.zeros_like(tokens)))
