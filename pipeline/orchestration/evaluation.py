"""Held-out evaluation during training: accuracy and pass@k of the current weights on a fixed prompt set.

The prompt set comes from the training source with another seed (procedural tasks give new examples),
or from `eval.source` when set. It is built once, so successive evaluations are comparable.
"""

from __future__ import annotations

import msgspec

from pipeline.sample import Sample
from stages.rollout.engine import GenRequest, SamplingParams


class Evaluator:
    def __init__(self, cfg, engine, tokenizer=None):
        from stages.reward.registry import RewardScorer
        from stages.rollout.build import load_source

        e = cfg.eval
        data = msgspec.structs.replace(
            cfg.rollout.data,
            source=e.source or cfg.rollout.data.source,
            seed=cfg.rollout.data.seed + 7919,
            shuffle=True,
        )
        source, self.tok = load_source(
            msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, data=data)), tokenizer
        )
        self.prompts = [next(source) for _ in range(e.num_prompts)]
        self.k = e.samples_per_prompt
        self.threshold = e.correct_threshold
        self.engine = engine
        self.scorer = RewardScorer.from_config(cfg.rollout.reward)
        s = cfg.rollout.sampling
        self.params = SamplingParams(
            temperature=e.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=tuple(s.stop_token_ids),
        )

    async def evaluate(self) -> dict:
        """Generate k samples per held-out prompt with the engine's current weights and score them."""
        version = self.engine.version
        reqs = [
            GenRequest(prompt_ids=list(p.ids), params=self.params, rid=f"eval-{i}-{j}")
            for i, p in enumerate(self.prompts)
            for j in range(self.k)
        ]
        results = await self.engine.generate(reqs)
        samples, texts = [], []
        for r, req in zip(results, reqs, strict=True):
            p = self.prompts[int(req.rid.split("-")[1])]
            ids = r.response_ids[:-1] if r.finish_reason == "stop" and r.response_ids else r.response_ids
            texts.append(self.tok.decode(ids, skip_special_tokens=False))
            samples.append(
                Sample(uid=req.rid, group_id="eval", prompt=p.text, label=p.label, metadata=p.metadata)
            )
        await self.scorer.score(samples, texts)
        correct = [s.reward >= self.threshold for s in samples]
        per_prompt = [correct[i * self.k : (i + 1) * self.k] for i in range(len(self.prompts))]
        return {
            "eval/version": version,
            "eval/accuracy": sum(correct) / len(correct),
            f"eval/pass@{self.k}": sum(any(c) for c in per_prompt) / len(per_prompt),
            "eval/reward_mean": sum(s.reward for s in samples) / len(samples),
        }
