"""Built-in reward functions and the scorer's failure handling."""

from __future__ import annotations

import asyncio

import pytest
import reasoning_gym

from buffer.record import Sample, Status
from stages.reward.builtin import (
    digit_repeat,
    exact_match,
    extract_math_answer,
    math_answer,
    reasoning_gym_score,
)
from stages.reward.registry import RewardScorer, resolve_reward_fn


def s(label="", metadata=None, prompt="", uid="u"):
    return Sample(uid=uid, group_id="g", label=label, metadata=metadata or {}, prompt=prompt)


def test_exact_match():
    assert exact_match(s("abc"), " abc\n") == 1.0 and exact_match(s("abc"), "abd") == 0.0
    assert exact_match(s("ABC"), "abc", ignore_case=True) == 1.0


def test_digit_repeat_partial_credit_orders_answers():
    sample = s("123")
    exact, near, digits, junk = (digit_repeat(sample, r) for r in ("123", "124", "999", "xyz"))
    assert exact == 1.0 > near > digits > junk >= 0.0
    assert digit_repeat(sample, "1234567") < digit_repeat(sample, "1234") < 0.9  # overlong costs
    assert digit_repeat(sample, "") == 0.0 and max(digit_repeat(sample, r) for r in ("12", "1230")) < 0.9


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("It costs $1,000.", "1000", 1.0),
        ("first 3 then 7", "7", 1.0),
        ("first 3 then 7", "3", 0.0),
        ("x = 72", "Natalia sold ... #### 72", 1.0),
        ("no number", "5", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
    ],
)
def test_math_answer(response, label, want):
    assert math_answer(s(label), response) == want


def test_extract_nested_boxed():
    assert extract_math_answer("\\boxed{\\frac{3}{4}} and later \\boxed{2^{10}}") == "2^{10}"


def test_reasoning_gym_uses_its_own_scorer():
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=5)
    e = ds[0]
    sample = s(e["answer"], {**e["metadata"], "rg_dataset": "basic_arithmetic"}, e["question"])
    assert reasoning_gym_score(sample, f"thinking... <answer>{e['answer']}</answer>") == 1.0
    assert reasoning_gym_score(sample, "<answer>nonsense</answer>") == 0.0
    assert reasoning_gym_score(sample, "no tags at all") == 0.0


def test_scorer_marks_raising_sample_failed_and_batch_mode():
    def boom(sample, response):
        if response == "bad":
            raise ValueError("cannot parse")
        return 1.0

    samples = [s(uid="a"), s(uid="b"), s(uid="c")]
    scorer = RewardScorer(boom)
    asyncio.run(scorer.score(samples, ["ok", "bad", "ok"]))
    assert [x.status for x in samples] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    assert "cannot parse" in samples[1].error and samples[0].reward == 1.0 and scorer.failures == 1

    async def batch(samples, responses):
        return [len(r) for r in responses]

    batch_samples = [s(uid="x"), s(uid="y")]
    asyncio.run(RewardScorer(batch, batched=True).score(batch_samples, ["ab", "abcd"]))
    assert [x.reward for x in batch_samples] == [2.0, 4.0]

    wrong = [s(uid="z")]
    asyncio.run(RewardScorer(lambda ss, rs: [], batched=True).score(wrong, ["q"]))
    assert wrong[0].status == Status.FAILED and "returned 0 values" in wrong[0].error


def test_resolve_errors_name_the_fix():
    with pytest.raises(KeyError, match="module:function"):
        resolve_reward_fn("nope")
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_reward_fn("no_such_module:f")
    with pytest.raises(AttributeError, match="missing"):
        resolve_reward_fn("json:missing")


def test_a_non_finite_reward_fails_the_sample_instead_of_poisoning_its_group():
    def nan_reward(sample, response):
        return float("nan")

    s = Sample(uid="u", group_id="g")
    asyncio.run(RewardScorer(nan_reward).score([s], ["x"]))
    assert s.status == Status.FAILED and s.reward == 0.0 and "must be finite" in s.error
