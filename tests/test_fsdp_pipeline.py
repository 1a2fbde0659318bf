"""A family the megatron mapping cannot load (phi3: fused qkv and gate_up) trains in the whole pipeline
with trainer.backend=fsdp: the built-in torch engine samples it, the trainer pushes its weights back, and
in sync mode the engine's logprobs of its own tokens equal the trainer's (issue #42)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from stages.models import resolve_model


def _tiny_phi3(tmp_path: Path) -> str:
    """A random tiny Phi-3 with the built-in byte tokenizer and chat template (copied from tiny-qwen2)."""
    import transformers as tf

    src = Path(resolve_model(SimpleNamespace(name="tiny-qwen2-random", cache_dir=str(tmp_path / "models"))))
    out = tmp_path / "phi3"
    cfg = tf.Phi3Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.Phi3ForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return str(out)


def test_phi3_trains_in_the_pipeline_on_the_fsdp_backend_with_the_engine_agreeing(tmp_path):
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import run_pipeline

    path = _tiny_phi3(tmp_path)
    cfg = load_config(
        None,
        [
            f"model.name={path}",
            "trainer.backend=fsdp",
            "run.mode=sync",
            "run.steps=3",
            "trainer.batch_groups=4",
            "rollout.max_inflight_groups=4",
            f"run.dir={tmp_path / 'run'}",
            "metrics.progress=false",
        ],
    )
    res = run_pipeline(cfg)
    assert res.status == "completed", res.error
    rows = [h for h in res.history if "reward/mean" in h]
    assert len(rows) == 3 and [r["version"] for r in rows] == [1, 2, 3]
    same = [r for r in rows if r.get("logp/same_version_tokens", 0) > 0]
    assert same, "sync mode: every step trains tokens of the weights it was pushed"
    assert max(r["logp/abs_diff_same_version"] for r in same) < 1e-4
