"""Builders from the rollout stage's config: the engine (`build_engine`) and the prompt source
(`load_source`)."""

from __future__ import annotations

from typing import Any

from stages.models import ModelConfig, load_tokenizer, resolve_model
from stages.rollout.config import DataConfig, RolloutConfig
from stages.rollout.data import PromptSource
from stages.rollout.engine import Engine
from stages.rollout.run import RolloutRun


def build_engine(
    rollout: RolloutConfig,
    model: ModelConfig,
    run: RolloutRun,
    *,
    version: int = 0,
    seed: int | None = None,
    name: str = "sglang",
    ports: list[int] | None = None,
) -> Engine:
    """The inference engine that rollout.engine names, loaded with `model`'s weights.

    version: the policy version of the initial weights (0 for a fresh run; the checkpoint's step when
    resuming). seed: sampling seed (default run.seed). name: SGLang engines are named (and log as)
    `name`-i. ports: the SGLang servers' ports (a healed generator's engines take its predecessor's,
    so the trainer's sender finds them at the same URLs).
    """
    r = rollout
    path = resolve_model(model)
    if r.engine == "torch":
        from stages.rollout.torch_engine import TorchEngine

        return TorchEngine(
            path,
            device=r.device,
            dtype=model.dtype,
            max_batch_size=r.max_batch_size,
            chunk_tokens=r.chunk_tokens,
            seed=run.seed if seed is None else seed,
            version=version,
            record_routing=run.routing_replay,
        )
    if r.engine == "sglang":
        from stages.rollout.engine_pool import EnginePool

        if r.sampling.stop and run.routing_replay:  # the engine would fail every such request
            raise ValueError(
                "rollout.sampling.stop with trainer.routing_replay on SGLang: SGLang sends a response's "
                "routed experts when it finishes, and a stop string ends the request before; stop on "
                "tokens (rollout.sampling.stop_token_ids) or use rollout.engine: torch"
            )

        return EnginePool.launch(
            path,
            r.sglang,
            r.engines_per_generator,
            dtype=model.dtype,
            version=version,
            fp32_lm_head=model.fp32_lm_head,
            name=name,
            record_routing=run.routing_replay,
            lora=run.lora_serving,
            ports=ports,
        )
    raise ValueError(f"rollout.engine={r.engine!r}: expected torch or sglang")


def load_source(data: DataConfig, model: ModelConfig, tokenizer: Any = None) -> tuple[PromptSource, Any]:
    """(PromptSource, tokenizer) for rollout.data and the model (its tokenizer unless one is given)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model(model))
    return PromptSource(data, tokenizer), tokenizer
