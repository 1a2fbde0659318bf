"""Build a Trainer from a whole RunConfig, as the launcher does (tests/ is on sys.path): the trainer takes
its own sections and a TrainerRun (pipeline.config.trainer_run), never the RunConfig."""

from __future__ import annotations

from typing import Any

from pipeline.config import RunConfig, trainer_run


def make_trainer(cfg: RunConfig, source: Any, model_path: str, run_dir: str, **kw: Any):
    """Trainer(cfg.trainer, trainer_run(cfg, run_dir), source, model_path, weights=cfg.weights, **kw)."""
    from stages.trainer.trainer import Trainer

    return Trainer(cfg.trainer, trainer_run(cfg, str(run_dir)), source, model_path, weights=cfg.weights, **kw)


def engine_sample(engine, trainer, max_new_tokens: int = 12):
    """One generation of `engine` on a fixed prompt as a training batch, with the trainer's logprobs of
    it: (request, engine result, token batch, trainer logprobs). The pushed weights are right when
    those logprobs equal the engine's (tb.rollout_logprobs)."""
    import asyncio

    from buffer.record import Sample, samples_to_batch
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.trainer.packing import pack, to_token_batch

    req = GenRequest(prompt_ids=[5, 17, 42, 7], params=SamplingParams(max_new_tokens=max_new_tokens), rid="x")
    res = asyncio.run(engine.generate([req]))[0]
    s = Sample.build(
        uid="x",
        group_id="x",
        prompt_ids=req.prompt_ids,
        response_ids=res.response_ids,
        rollout_logprobs=res.logprobs,
        versions=res.versions,
    )
    tb = to_token_batch(samples_to_batch([s]))
    return req, res, tb, trainer.backend.logprobs(tb, pack(tb, [0], 4096))
