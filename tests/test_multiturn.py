"""Token-exact multi-turn rollouts through the generator, with a scripted engine: loss masks, versions
across turns and weight updates, truncation, tool failures, and the calculator environment."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from test_rollout_generator import FakeSink, rollout_args

from buffer.record import Status
from pipeline.config import from_dict
from stages.models import build_byte_tokenizer
from stages.rollout.data import PromptSource
from stages.rollout.engine import Engine, GenResult, SamplingParams
from stages.rollout.envs.calculator import calculate
from stages.rollout.generator import Generator
from stages.rollout.hooks import EngineHandle
from stages.rollout.multiturn import Conversation, TemplateError, TurnTemplate

EOS = 258  # <|im_end|> of the byte tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_byte_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedEngine(Engine):
    """Answers request k (in call order) with script[k % len(script)] = (token ids, finish reason,
    versions or None for the engine's version); `script` may be a function of the prompt giving such a
    list. Records every prompt it was given."""

    def __init__(self, script, version: int = 0):
        self.script, self._version, self.prompts = script, version, []

    async def generate(self, requests):
        out = []
        for req in requests:
            script = self.script(req.prompt_ids) if callable(self.script) else self.script
            ids, finish, versions = script[len(self.prompts) % len(script)]
            self.prompts.append(list(req.prompt_ids))
            if len(ids) > req.params.max_new_tokens:
                ids, finish = ids[: req.params.max_new_tokens], "length"
            vers = list(versions or [self._version] * len(ids))[: len(ids)]
            out.append(
                GenResult(
                    rid=req.rid,
                    response_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    versions=vers,
                    finish_reason=finish,
                )
            )
        await asyncio.sleep(0)
        return out

    def update_weights(self, named_tensors, version):
        self._version = version

    @property
    def version(self):
        return self._version


def _cfg(**rollout):
    tree = {
        "rollout": {"group_size": 3, "max_inflight_groups": 2, "sampling": {"max_new_tokens": 64}, **rollout}
    }
    return from_dict(tree)


def _run(cfg, engine, tok, groups=1):
    sink = FakeSink()
    gen = Generator(
        *rollout_args(cfg),
        sink,
        engine,
        "mt",
        batch_groups=0,
        source=PromptSource(cfg.rollout.data, tok),
        tokenizer=tok,
    )
    stats = asyncio.run(asyncio.wait_for(gen.run(max_groups=groups), 60))
    return sink, stats


# -- generate_fns used by these tests (loaded by their "module:function" names) --------------------------
TURN1, TURN2, TURN3 = [ord("a"), ord("b"), EOS], [ord("c"), EOS], [ord("d"), ord("e"), ord("f"), EOS]


async def three_turns(ctx):
    """Model, tool, model (after a weight update), tool, model."""
    out = []
    for s in ctx.samples:
        conv = Conversation(ctx.prompt.ids, ctx.engine, ctx.params, template=TurnTemplate(ctx.tokenizer))
        await conv.generate()
        conv.append_messages([{"role": "tool", "content": "1"}])
        await conv.generate()
        conv.append_messages([{"role": "tool", "content": "22"}, {"role": "tool", "content": "3"}])
        await conv.generate()
        out.append(conv.fill(s))
    return out


def test_three_turn_sample_mask_versions_and_exact_context(tok):
    # turn 2 straddles an update (versions 4, 5), turn 3 is all version 5
    engine = ScriptedEngine([(TURN1, "stop", [4, 4, 4]), (TURN2, "stop", [4, 5]), (TURN3, "stop", [5] * 4)])
    sink, stats = _run(_cfg(group_size=1, generate_fn="test_multiturn:three_turns"), engine, tok)
    (s,) = [s for g in sink.groups.values() for s in g]
    tool1 = [
        257,
        *b"tool\n1",
        EOS,
        257,
    ]  # the template's tokens for the tool message; the model's <|im_end|> not again
    tool23 = [257, *b"tool\n22", EOS, 257, *b"tool\n3", EOS, 257]
    want = TURN1 + tool1 + TURN2 + tool23 + TURN3
    assert s.array("response_ids").tolist() == want
    assert s.array("loss_mask").tolist() == [1] * 3 + [0] * len(tool1) + [1] * 2 + [0] * len(tool23) + [1] * 4
    assert s.array("versions").tolist() == [4] * 3 + [4] * len(tool1) + [4, 5] + [5] * len(tool23) + [5] * 4
    lp = s.array("rollout_logprobs").tolist()
    assert lp == [-0.5] * 3 + [0.0] * len(tool1) + [-0.5] * 2 + [0.0] * len(tool23) + [-0.5] * 4
    assert s.status == Status.COMPLETED and s.metadata["model_turns"] == 3 and s.min_version() == 4
    # each turn continued from exactly the tokens so far: nothing decoded and re-encoded
    prompt = engine.prompts[0]
    assert engine.prompts[1] == prompt + TURN1 + tool1
    assert engine.prompts[2] == prompt + TURN1 + tool1 + TURN2 + tool23
    assert stats["groups_finished"] == 1


async def flaky_tools(ctx):
    """Sample 1's tool raises, sample 2's times out; sample 0's works."""

    def tool(i):
        if i == 1:
            raise RuntimeError("sandbox crashed")
        if i == 2:
            time.sleep(1.0)
        return "ok"

    async def one(s):
        conv = Conversation(ctx.prompt.ids, ctx.engine, ctx.params, template=TurnTemplate(ctx.tokenizer))
        await conv.generate()
        result = await conv.call_tool(tool, s.group_index, timeout_s=0.2)
        if not conv.done:
            conv.append_messages([{"role": "tool", "content": result}])
            await conv.generate()
        return conv.fill(s)

    return list(await asyncio.gather(*(one(s) for s in ctx.samples)))


def test_a_failing_tool_fails_its_sample_and_the_group_reaches_the_buffer(tok):
    engine = ScriptedEngine([(TURN1, "stop", None)])
    sink, stats = _run(_cfg(generate_fn="test_multiturn:flaky_tools"), engine, tok)
    group = sorted(next(iter(sink.groups.values())), key=lambda s: s.group_index)
    assert len(group) == 3 and stats["groups_finished"] == 1 and stats["samples_failed"] == 2
    ok, raised, slow = group
    assert ok.status == Status.COMPLETED and ok.metadata["model_turns"] == 2
    assert raised.status == Status.FAILED and "sandbox crashed" in raised.metadata["failure"] == raised.error
    assert slow.status == Status.FAILED and "timed out after 0.2s" in slow.metadata["failure"]
    assert raised.array("response_ids").tolist() == TURN1 and raised.reward == 0.0


def test_budget_truncates_model_and_environment_tokens(tok):
    async def run(budget, env_tokens):
        engine = ScriptedEngine([(TURN1, "stop", None)])
        params = SamplingParams(max_new_tokens=budget)
        conv = Conversation([1, 2], EngineHandle(engine, "t"), params, template=TurnTemplate(tok))
        await conv.generate()
        conv.append_tokens(env_tokens)
        await conv.generate()
        return conv

    short = asyncio.run(run(2, [7]))  # the model's first turn hits the budget
    assert short.status == Status.TRUNCATED and short.response_ids == TURN1[:2] and short.done
    env = asyncio.run(run(5, [7, 7, 7, 7]))  # the environment's tokens pass it
    assert env.status == Status.TRUNCATED and env.response_ids == TURN1 + [7, 7]
    assert env.loss_mask == [1, 1, 1, 0, 0] and env.metadata["truncated_by"] == "environment tokens"
    fits = asyncio.run(run(64, [7]))
    assert fits.status == Status.COMPLETED and len(fits.response_ids) == 7


def test_turn_template_renders_only_the_new_messages(tok):
    t = TurnTemplate(tok)
    assert tok.decode(t.tokens([{"role": "tool", "content": "42"}], after_stop_token=EOS)) == (
        "<|im_start|>tool\n42<|im_end|><|im_start|>"
    )
    # a turn that ended without the stop token gets the template's end-of-turn text first
    assert t.tokens([{"role": "user", "content": "x"}], after_stop_token=None)[:3] == [EOS, 257, ord("x")]
    tok2 = copy.deepcopy(tok)
    tok2.chat_template = (  # a template that rewrites past assistant turns once another message follows
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}"
        "{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        TurnTemplate(tok2).tokens([{"role": "tool", "content": "1"}], after_stop_token=None)


def test_calculator_tool_and_episode(tok):
    assert [calculate(e) for e in ("34 + 12", "-33 / 11", "( -9 / 9 )", "2 - -1", "1/3")] == [
        "46",
        "-3",
        "-1",
        "3",
        "0.333333",
    ]
    assert calculate("1/0") == "error: division by zero" and calculate("__import__('os')") == "error: syntax"
    call = list(b"<tool>7 * 6</tool>") + [EOS]
    answer = list(b"<answer>42</answer>") + [EOS]
    # the episode's first turn (the prompt holds one <|im_end|>) calls the tool, the next one answers
    engine = ScriptedEngine(lambda p: [(answer if p.count(EOS) > 1 else call, "stop", None)])
    cfg = _cfg(
        group_size=2, generate_fn="stages.rollout.envs.calculator:generate", reward={"fn": "exact_match"}
    )
    sink, _ = _run(cfg, engine, tok)
    for s in next(iter(sink.groups.values())):
        ids = s.array("response_ids").tolist()
        assert (
            tok.decode(ids)
            == "<tool>7 * 6</tool><|im_end|><|im_start|>tool\n42<|im_end|><|im_start|><answer>42</answer><|im_end|>"
        )
        mask = s.array("loss_mask").tolist()
        assert mask == [1] * len(call) + [0] * (len(ids) - len(call) - len(answer)) + [1] * len(answer)
        assert s.metadata["tool_calls"] == 1 and s.status == Status.COMPLETED


def test_engine_error_in_a_custom_generate_fn_is_retried(tok):
    class Down(ScriptedEngine):
        async def generate(self, requests):
            raise RuntimeError("engine down")

    cfg = msgspec.structs.replace(_cfg(generate_fn="test_multiturn:three_turns"), run=_cfg().run)
    sink, stats = _run(cfg, Down([(TURN1, "stop", None)]), tok)
    assert stats["groups_failed"] == 1 and stats["engine_errors"] == 2 and not sink.groups


def test_calculator_answers_numbers_out_of_range_with_an_error_result():
    """OverflowError used to escape calculate(), so the sample failed as a tool crash."""
    assert calculate("1e999") == calculate("1e308*10/3") == "error: number out of range"
    assert calculate(
        "1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308*1e308"
    ) == (
        "error: number out of range"
    )  # an integer too long to print: a ValueError outside the old try, a crash too
    assert calculate("1e200") == "1e+200" and calculate("2 * 10000000000") == "20000000000"


def test_a_timed_out_sync_tool_keeps_a_tool_thread_not_the_default_executor():
    """The reward scorer runs in the loop's default executor; a hung tool must not take its threads."""
    release = threading.Event()

    def hangs():
        release.wait(10)
        return "late"

    async def run():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))  # one thread: one hung tool fills it
        conv = Conversation([1], EngineHandle(ScriptedEngine([]), "t"), SamplingParams(max_new_tokens=8))
        try:
            assert await conv.call_tool(hangs, timeout_s=0.1) is None
            assert conv.status == Status.FAILED and "timed out after 0.1s" in conv.error
            # the default executor is still free for the scorer
            return await asyncio.wait_for(loop.run_in_executor(None, threading.current_thread), 2.0)
        finally:
            release.set()

    worker = asyncio.run(run())
    assert not worker.name.startswith("slipstream-tool")
