"""Held-out evaluation: several eval.datasets, each with its own source, reward, samples, temperature,
token budget and pass@k list, generated through the run's engine and generate_fn."""

from __future__ import annotations

import asyncio
import math

import pytest
from test_multiturn import EOS, ScriptedEngine

from pipeline.config import ConfigError, from_dict
from pipeline.orchestration.evaluation import Evaluator, pass_at_k


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pipeline.models import build_byte_tokenizer

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
