"""Held-out evaluation: several eval.datasets, each with its own source, reward, samples, temperature,
token budget and pass@k list, generated through the run's engine and generate_fn."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
from test_multiturn import EOS, ScriptedEngine

from pipeline.config import ConfigError, from_dict
from pipeline.orchestration.evaluation import Evaluator, pass_at_k
from stages.rollout.hooks import HookError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from stages.models import build_byte_tokenizer

    return build_byte_tokenizer(tmp_path_factory.mktemp("tok"))


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25 and math.isclose(pass_at_k(4, 1, 2), 0.5)  # 1 - C(3,2)/C(4,2)
    assert math.isclose(pass_at_k(5, 2, 3), 1 - math.comb(3, 3) / math.comb(5, 3))


def _echo_label(prompt_ids):
    """Answers the digit-repeat prompt <|im_start|>DIGITS<|im_end|><|im_start|> correctly, but only
    every other call (so accuracy is 1/2 and pass@k has something to count)."""
    digits = prompt_ids[1 : prompt_ids.index(EOS)]
    return [(digits + [EOS], "stop", None), ([ord("x"), EOS], "stop", None)]


def test_two_eval_sets_with_their_own_settings(tok):
    cfg = from_dict(
        {
            "rollout": {"sampling": {"max_new_tokens": 6}},
            "eval": {
                "every_steps": 1,
                "datasets": [
                    {"num_prompts": 3, "samples_per_prompt": 4, "pass_k": [1, 2, 4]},
                    {
                        "name": "long",
                        "task_kwargs": {"min_digits": 5, "max_digits": 5},
                        "reward": "exact_match",
                        "num_prompts": 2,
                        "samples_per_prompt": 2,
                        "temperature": 0.5,
                        "max_new_tokens": 3,
                    },
                ],
            },
        }
    )
    engine = ScriptedEngine(_echo_label, version=7)
    seen = []
    inner = engine.generate

    async def spy(requests):
        seen.extend((r.params.temperature, r.params.max_new_tokens, len(r.prompt_ids)) for r in requests)
        return await inner(requests)

    engine.generate = spy
    out = asyncio.run(Evaluator(cfg, engine, tok).evaluate())
    assert out["eval/version"] == 7
    # default set: 3 prompts x 4 samples, every other one right -> accuracy 1/2, pass@1 = 1/2, pass@4 = 1
    assert out["eval/accuracy"] == 0.5 and out["eval/pass@1"] == 0.5 and out["eval/pass@4"] == 1.0
    assert math.isclose(out["eval/pass@2"], 1 - math.comb(2, 2) / math.comb(4, 2))
    # the "long" set: 5-digit prompts, answers cut at 3 tokens (truncated, wrong), its own temperature
    assert out["eval/long/accuracy"] == 0.0 and out["eval/long/truncated"] == 0.5
    assert "eval/long/pass@2" in out
    assert sorted({(t, m) for t, m, _ in seen}) == [(0.5, 3), (1.0, 6)]
    assert {n for t, m, n in seen if t == 0.5} == {8}  # <|im_start|> + 5 digits + <|im_end|><|im_start|>


def test_eval_runs_the_training_generate_fn(tok):
    """A multi-turn environment is evaluated with its tools, as it is trained."""
    call, answer = list(b"<tool>2 + 3</tool>") + [EOS], list(b"<answer>5</answer>") + [EOS]
    engine = ScriptedEngine(lambda p: [(answer if p.count(EOS) > 1 else call, "stop", None)])
    cfg = from_dict(
        {
            "rollout": {
                "generate_fn": "stages.rollout.envs.calculator:generate",
                "reward": {"fn": "exact_match"},
                "sampling": {"max_new_tokens": 64},  # a tool call is 19 tokens
            },
            "eval": {
                "datasets": [{"name": "calc", "num_prompts": 2, "samples_per_prompt": 2, "reward": "math"}]
            },
        }
    )
    out = asyncio.run(Evaluator(cfg, engine, tok).evaluate())
    assert len(engine.prompts) == 8  # 2 prompts x 2 samples x (tool call + answer)
    assert "eval/calc/accuracy" in out and out["eval/calc/failed"] == 0.0


def test_eval_dataset_settings_are_checked():
    with pytest.raises(ConfigError, match=r"pass_k \[8\] outside \[1, samples_per_prompt=4\]"):
        from_dict({"eval": {"datasets": [{"pass_k": [1, 8]}]}})
    with pytest.raises(ConfigError, match="names .* repeat"):
        from_dict({"eval": {"datasets": [{"name": "a"}, {"name": "a"}]}})
    # eval on SGLang engines is allowed now: it runs on the training engines
    assert from_dict({"rollout": {"engine": "sglang"}, "eval": {"every_steps": 5}}).eval.every_steps == 5


CALC = {
    "generate_fn": "stages.rollout.envs.calculator:generate",
    "reward": {"fn": "exact_match"},
    "sampling": {"max_new_tokens": 64},
}


def _calc_engine():
    call, answer = list(b"<tool>2 + 3</tool>") + [EOS], list(b"<answer>5</answer>") + [EOS]
    return ScriptedEngine(lambda p: [(answer if p.count(EOS) > 1 else call, "stop", None)])


def test_eval_with_a_per_sample_generate_fn(tok):
    """The calculator trains per sample (its generate_fn returns a list of one); evaluation used to
    raise "returned list" where the generator flattens."""
    cfg = from_dict(
        {
            "rollout": {**CALC, "generate_per_sample": True},
            "eval": {"datasets": [{"name": "calc", "num_prompts": 2, "samples_per_prompt": 2}]},
        }
    )
    engine = _calc_engine()
    out = asyncio.run(Evaluator(cfg, engine, tok).evaluate())
    assert len(engine.prompts) == 8 and out["eval/calc/failed"] == 0.0 and out["eval/calc/errors"] == 0


class FailingOn(ScriptedEngine):
    """Raises for prompts that `fails(prompt_ids, call number)` picks, else answers like the calculator."""

    def __init__(self, fails):
        inner = _calc_engine()
        super().__init__(inner.script)
        self.fails, self.calls = fails, 0

    async def generate(self, requests):
        self.calls += 1
        if any(self.fails(r.prompt_ids, self.calls) for r in requests):
            raise RuntimeError("engine restarting")
        return await super().generate(requests)


def test_engine_errors_in_eval_are_retried_then_counted_not_raised(tok):
    """Eval runs on the training engine: an engine error is retried like training retries it
    (rollout.engine_retries), and a prompt still failing is counted in eval/<set>/errors instead of
    ending the run (it used to raise through the actor, and the launcher stopped the run)."""
    cfg = from_dict(
        {
            "rollout": {**CALC, "engine_retries": 1},
            "eval": {"datasets": [{"name": "calc", "num_prompts": 3, "samples_per_prompt": 2}]},
        }
    )
    evaluator = Evaluator(cfg, FailingOn(lambda p, k: k == 1), tok)  # the first call fails, once
    out = asyncio.run(evaluator.evaluate())
    assert out["eval/calc/errors"] == 0 and out["eval/calc/failed"] == 0.0  # retried
    no_retry = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, engine_retries=0))
    out = asyncio.run(Evaluator(no_retry, FailingOn(lambda p, k: k == 1), tok).evaluate())
    assert out["eval/calc/errors"] == 1 and "eval/calc/accuracy" in out
    bad = evaluator.sets[0].prompts[1].ids
    engine = FailingOn(lambda p, k: list(p[: len(bad)]) == list(bad))  # one prompt fails every time
    out = asyncio.run(Evaluator(cfg, engine, tok).evaluate())
    assert out["eval/calc/errors"] == 1 and "eval/calc/accuracy" in out and len(engine.prompts) == 8
    out = asyncio.run(Evaluator(cfg, FailingOn(lambda p, k: True), tok).evaluate())
    assert out == {"eval/version": 0, "eval/calc/errors": 3}


async def buggy_eval_fn(ctx):
    """Raises on the first prompt; the others would take long."""
    if ctx.samples[0].group_id.endswith("-0"):
        raise KeyError("label")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        CANCELLED.append(ctx.samples[0].group_id)
        raise


CANCELLED: list[str] = []


def test_a_bug_in_the_generate_fn_stops_eval_naming_it_and_cancels_the_rest(tok):
    cfg = from_dict(
        {
            "rollout": {"generate_fn": "test_evaluation:buggy_eval_fn"},
            "eval": {"datasets": [{"num_prompts": 3, "samples_per_prompt": 2}]},
        }
    )

    async def run():
        with pytest.raises(HookError, match=r"test_evaluation:buggy_eval_fn raised KeyError: 'label'"):
            await asyncio.wait_for(Evaluator(cfg, ScriptedEngine([]), tok).evaluate(), 10)
        return sorted(CANCELLED)  # before anything else runs: the siblings were cancelled, not left

    CANCELLED.clear()
    assert asyncio.run(run()) == ["eval-default-1", "eval-default-2"]
