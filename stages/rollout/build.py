"""Builders from a RunConfig: the engine (`build_engine`) and the prompt source (`load_source`)."""

from __future__ import annotations

from stages.rollout.engine import Engine


def build_engine(cfg, *, version: int = 0, seed: int | None = None, name: str = "sglang") -> Engine:
    """The inference engine that cfg.rollout.engine names, loaded with cfg.model's weights.

    version: the policy version of the initial weights (0 for a fresh run; the checkpoint's step when
    resuming). seed: sampling seed (default cfg.run.seed). name: SGLang engines are named (and log as)
    `name`-i.
    """
    from stages.models import resolve_model

    r = cfg.rollout
    path = resolve_model(cfg.model)
    if r.engine == "torch":
        from stages.rollout.torch_engine import TorchEngine

        return TorchEngine(
            path,
            device=r.device,
            dtype=cfg.model.dtype,
            max_batch_size=r.max_batch_size,
            chunk_tokens=r.chunk_tokens,
            seed=cfg.run.seed if seed is None else seed,
            version=version,
            record_routing=cfg.trainer.routing_replay,
        )
    if r.engine == "sglang":
        from stages.rollout.engine_pool import EnginePool

        return EnginePool.launch(
            path,
            r.sglang,
            r.engines_per_generator,
            dtype=cfg.model.dtype,
            version=version,
            fp32_lm_head=cfg.model.fp32_lm_head,
            name=name,
            record_routing=cfg.trainer.routing_replay,
        )
    raise ValueError(f"rollout.engine={r.engine!r}: expected torch or sglang")


def load_source(cfg, tokenizer=None):
    """(PromptSource, tokenizer) for cfg.rollout.data and cfg.model."""
    from stages.models import load_tokenizer, resolve_model
    from stages.rollout.data import PromptSource

    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model(cfg.model))
    return PromptSource(cfg.rollout.data, tokenizer), tokenizer
