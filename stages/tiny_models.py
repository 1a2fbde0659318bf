"""The tiny built-in models (tiny-qwen2, tiny-qwen2-random, tiny-qwen3-moe) and the pieces other
builders reuse (the byte-level tokenizer, `write_tiny_qwen2`, `masked_nll_step`): see stages/models.py
for what each name resolves to. Nothing here imports another module of the repository."""

from __future__ import annotations

import json
from pathlib import Path

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
