"""Agent episodes through the generator (rollout.agent_fn): agents written against the real `openai`
client call the real endpoint, a scripted engine answers, and the samples are checked token by token
against what the engine produced and what the chat template renders; diverging, failing, slow and
stale episodes end as the docs say, each touching one sample, not the run."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from openai import AsyncOpenAI
from test_rollout_generator import FakeSink, rollout_args

from buffer.record import I32, U8, Status, pack
from pipeline.config import from_dict
from stages.models import build_byte_tokenizer
from stages.rollout.agent_session import token_crc, turn_mismatches
from stages.rollout.data import PromptSource
from stages.rollout.engine import Engine, GenResult
from stages.rollout.generator import Generator
from stages.rollout.multiturn import TurnTemplate

EOS = 258  # <|im_end|> of the byte tokenizer
# the first turn opens with half of a UTF-8 character: decoded it reads "\ufffd", which re-encodes to
# three other tokens, so a proxy that re-encodes the text it returned would train on tokens never sampled
CALL = [0xE2, 0x82, *b"<tool>7*6</tool>", EOS]
ANSWER = [*b"<answer>42</answer>", EOS]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_byte_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedEngine(Engine):
    """Answers each request with script(prompt_ids) = (token ids, finish reason): by default CALL for a
    prompt holding one <|im_end|> (the user's), ANSWER after that. Records (prompt, GenResult) per
    request; logprobs differ per position so that a misaligned copy shows. `delay_s` per call;
    `fail_first` engine errors on the first calls; `slow_first_s` holds the very first request."""

    def __init__(self, script=None, *, delay_s=0.0, fail_first=0, slow_first_s=0.0):
        self.script = script or (lambda p: (CALL if p.count(EOS) <= 1 else ANSWER, "stop"))
        self.delay_s, self.fail_first, self.slow_first_s = delay_s, fail_first, slow_first_s
        self._version, self.calls, self.seen, self.cancelled = 0, 0, [], 0
        self.forgotten: list[str] = []

    def forget_affinity(self, key):  # as EnginePool: an episode's key is dropped when it ends
        self.forgotten.append(key)

    async def generate(self, requests):
        self.calls += 1
        n = self.calls
        first = n == 1
        try:
            await asyncio.sleep(self.slow_first_s if first and self.slow_first_s else self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += len(requests)
            raise
        if n <= self.fail_first:
            raise RuntimeError("scripted engine failure")
        out = []
        for req in requests:
            ids, finish = self.script(list(req.prompt_ids))
            if len(ids) > req.params.max_new_tokens:
                ids, finish = ids[: req.params.max_new_tokens], "length"
            res = GenResult(
                rid=req.rid,
                response_ids=list(ids),
                logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
                versions=[self._version] * len(ids),
                finish_reason=finish,
            )
            self.seen.append((list(req.prompt_ids), res, req.affinity))
            out.append(res)
        return out

    def update_weights(self, named_tensors, version):
        self._version = version

    @property
    def version(self):
        return self._version


def make_cfg(agent_fn: str, **rollout):
    tree = {
        "run": {"max_staleness": 1},
        "rollout": {
            "group_size": 2,
            "max_inflight_groups": 2,
            "agent_fn": f"test_agent_episodes:{agent_fn}",
            "reward": {"fn": "exact_match"},
            "sampling": {"max_new_tokens": 96},
            **rollout,
        },
    }
    return from_dict(tree)


def run_gen(cfg, engine, tok, *, groups=1, batch_groups=0, during=None):
    sink = FakeSink()
    gen = Generator(
        *rollout_args(cfg),
        sink,
        engine,
        "ag",
        batch_groups=batch_groups,
        source=PromptSource(cfg.rollout.data, tok),
        tokenizer=tok,
    )

    async def go():
        side = asyncio.ensure_future(during(gen)) if during else None
        stats = await asyncio.wait_for(gen.run(max_groups=groups), 60)
        if side is not None:
            await asyncio.wait_for(side, 30)
        return stats

    stats = asyncio.run(go())
    samples = sorted((s for g in sink.groups.values() for s in g), key=lambda s: s.uid)
    return gen, stats, samples


# -- agents (loaded by "test_agent_episodes:<name>") -------------------------------------------------
LOG: dict[str, list] = {"cancelled": [], "records": []}


def client(base_url, api_key):
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


async def tool_agent(base_url, api_key, record, session_id, *, edit=False, reward=None):
    """Ask, run the "tool", send its result, take the answer. edit=True rewrites the model's first
    turn before sending it back (a transcript the model never produced)."""
    LOG["records"].append(record)
    async with client(base_url, api_key) as c:
        messages = list(record["prompt"])
        first = await c.chat.completions.create(model="any", messages=messages)
        said = first.choices[0].message.content
        messages += [
            {"role": "assistant", "content": "<tool>6*7</tool>" if edit else said},
            {"role": "tool", "content": "42"},
        ]
        await c.chat.completions.create(model="any", messages=messages)
    return reward


async def raising_agent(base_url, api_key, record, session_id):
    """Episode 1 of each group raises after its first call; the others run the tool loop."""
    if session_id.split(".")[0].endswith("-1"):
        async with client(base_url, api_key) as c:
            await c.chat.completions.create(model="any", messages=list(record["prompt"]))
        raise ValueError("the agent's sandbox crashed")
    return await tool_agent(base_url, api_key, record, session_id)


async def odd_agent(base_url, api_key, record, session_id):
    """Episode 0 returns a string instead of a reward, episode 1 never calls the model."""
    if session_id.split(".")[0].endswith("-1"):
        return None
    await tool_agent(base_url, api_key, record, session_id)
    return "great"


async def chatty_agent(base_url, api_key, record, session_id):
    """Calls the model until it is refused (the turn budget), then returns."""
    async with client(base_url, api_key) as c:
        messages = list(record["prompt"])
        for _ in range(20):
            try:
                r = await c.chat.completions.create(model="any", messages=messages)
            except Exception as e:  # the refusal past rollout.agent.max_turns
                LOG["records"].append(str(e))
                raise
            messages += [{"role": "assistant", "content": r.choices[0].message.content}]
            messages += [{"role": "user", "content": "again"}]


async def waiting_agent(base_url, api_key, record, session_id):
    """One model call, then waits far longer than any budget; records being cancelled."""
    try:
        async with client(base_url, api_key) as c:
            await c.chat.completions.create(model="any", messages=list(record["prompt"]))
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        LOG["cancelled"].append(session_id)
        raise


# -- tests ---------------------------------------------------------------------------------------------
def test_an_openai_client_agent_makes_token_exact_samples(tok):
    engine = ScriptedEngine()
    gen, stats, samples = run_gen(make_cfg("tool_agent"), engine, tok)
    assert stats["groups_finished"] == 1 and stats["samples_failed"] == 0 and len(samples) == 2
    assert sorted(engine.forgotten) == sorted(s.metadata["agent"]["session"] for s in samples)
    template = TurnTemplate(tok)
    tool_tokens = template.tokens([{"role": "tool", "content": "42"}], after_stop_token=EOS)
    for s in samples:
        prompt = s.array("prompt_ids").tolist()
        record = LOG["records"][-1]
        # the prompt: the record's messages, rendered as the built-in generators render them
        assert (
            prompt
            == tok(
                tok.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            ).input_ids
        )
        sid = s.metadata["agent"]["session"]
        calls = [(p, r) for p, r, key in engine.seen if key == sid]  # the engine kept its affinity key
        assert len(calls) == 2 and s.metadata["agent"]["segments"] == 1
        (p1, r1), (p2, r2) = calls
        ids = s.array("response_ids").tolist()
        # model turns: the engine's tokens exactly; between them: the template's tokens for the tool message
        assert ids == r1.response_ids + tool_tokens + r2.response_ids
        assert ids[: len(CALL)] == CALL  # not the re-encoded "\ufffd" the agent read
        assert s.array("loss_mask").tolist() == [1] * len(CALL) + [0] * len(tool_tokens) + [1] * len(ANSWER)
        lp = s.array("rollout_logprobs").tolist()
        assert lp == pytest.approx(r1.logprobs + [0.0] * len(tool_tokens) + r2.logprobs)
        # each call ran on exactly the episode's tokens so far
        assert p1 == prompt and p2 == prompt + r1.response_ids + tool_tokens
        turns = s.metadata["agent"]["turns"]
        assert [(t[0], t[1]) for t in turns] == [(0, len(CALL)), (len(CALL) + len(tool_tokens), len(ANSWER))]
        assert all(token_crc(ids[a : a + n]) == crc for a, n, crc in turns) and turn_mismatches(s) == 0
        # the audit sees a changed model token, and a tool token trained on
        changed = msgspec.structs.replace(s, response_ids=pack([ids[0] ^ 1, *ids[1:]], I32))
        masked = msgspec.structs.replace(s, loss_mask=pack([1] * len(ids), U8))
        assert turn_mismatches(changed) == 1 and turn_mismatches(masked) == 1
        # the first turn's text does not re-encode to its tokens: counted, and not what was trained on
        assert s.metadata["agent"]["retokenize_diffs"] == 1
        assert tok(tok.decode(CALL[:-1]), add_special_tokens=False).input_ids != CALL[:-1]
        assert s.status == Status.COMPLETED and s.reward == 0.0  # exact_match of "<answer>42</answer>"
        assert s.metadata["rewarded_by"] == "reward_fn"


def test_a_diverging_agent_is_recorded_as_segments(tok):
    engine = ScriptedEngine()
    cfg = make_cfg("tool_agent", generate_kwargs={"edit": True, "reward": 0.5})
    _, stats, samples = run_gen(cfg, engine, tok)
    # each episode: the model's first turn (its own segment), then a new segment whose prompt is the
    # agent's edited history; group_size counts the segments
    assert len(samples) == 4 and {s.group_size for s in samples} == {4}
    assert sorted(s.group_index for s in samples) == [0, 1, 2, 3] and stats["samples"] == 4
    by_session: dict[str, list] = {}
    for s in samples:
        by_session.setdefault(s.metadata["agent"]["session"], []).append(s)
    for sid, (first, second) in by_session.items():
        a, b = first.metadata["agent"], second.metadata["agent"]
        assert (a["segment"], b["segment"]) == (0, 1) and a["segments"] == b["segments"] == 2
        assert a["started_by"] == "first call" and b["diverged_at"] == 1 and "messages[1]" in b["started_by"]
        assert first.array("response_ids").tolist() == CALL  # what the model did produce is kept
        # ... rendered whole: the agent's edit and the tool message are its prompt (loss_mask never 1 there)
        assert second.prompt.endswith(
            "<|im_start|><tool>6*7</tool><|im_end|><|im_start|>tool\n42<|im_end|><|im_start|>"
        )
        # the second segment's prompt is exactly what the engine was asked to continue
        (p2,) = [p for p, r, key in engine.seen if key == sid and p.count(EOS) > 1]
        assert second.array("prompt_ids").tolist() == p2
        assert second.array("response_ids").tolist() == ANSWER
        assert second.array("loss_mask").tolist() == [1] * len(ANSWER)
        # one reward per episode, the agent's, on every segment
        assert first.reward == second.reward == 0.5 and first.metadata["rewarded_by"] == "agent_fn"


def test_an_agent_that_raises_fails_its_sample_not_the_run(tok):
    _, stats, samples = run_gen(make_cfg("raising_agent"), ScriptedEngine(), tok, groups=2)
    assert stats["groups_finished"] == 2 and stats["samples_failed"] == 2 and len(samples) == 4
    for s in samples:
        if s.metadata["agent"]["session"].split(".")[0].endswith("-1"):
            assert s.status == Status.FAILED and s.reward == 0.0
            assert "raised ValueError: the agent's sandbox crashed" in s.error
            assert "Traceback" in s.error and "raising_agent" in s.error and s.metadata["failure"] == s.error
            assert s.array("response_ids").tolist() == CALL  # what it made before failing
        else:
            assert s.status == Status.COMPLETED and s.metadata["agent"]["segments"] == 1


def test_a_bad_return_or_no_model_call_fails_the_sample_naming_why(tok):
    _, stats, samples = run_gen(make_cfg("odd_agent"), ScriptedEngine(), tok)
    bad, idle = samples
    assert bad.status == Status.FAILED and "returned 'great' (str)" in bad.error and "as a float" in bad.error
    assert idle.status == Status.FAILED and "made no model call" in idle.error
    assert idle.array("response_ids").tolist() == [] and stats["groups_finished"] == 1


def test_the_turn_budget_ends_an_episode_truncated(tok):
    script = lambda p: ([*b"ok", EOS], "stop")  # noqa: E731
    cfg = make_cfg("chatty_agent", agent={"max_turns": 3})
    _, stats, samples = run_gen(cfg, ScriptedEngine(script), tok)
    for s in samples:
        assert s.status == Status.TRUNCATED and s.metadata["model_turns"] == 3
        assert "turn budget (rollout.agent.max_turns=3)" in s.metadata["agent"]["ended"]
        assert "has ended" in s.metadata["agent"]["agent_error"]  # the refusal the agent raised on
    assert any("max_turns=3" in str(e) for e in LOG["records"])


def test_the_time_budget_ends_an_episode_truncated_and_cancels_the_agent(tok):
    LOG["cancelled"].clear()
    cfg = make_cfg("waiting_agent", agent={"timeout_s": 0.5})
    t0 = time.monotonic()
    _, stats, samples = run_gen(cfg, ScriptedEngine(), tok)
    assert time.monotonic() - t0 < 10
    for s in samples:
        assert s.status == Status.TRUNCATED and s.array("response_ids").tolist() == CALL
        assert "timeout_s=0.5" in s.metadata["truncated_by"]
    assert len([c for c in LOG["cancelled"] if c.startswith("ag-0-")]) == 2


def test_the_staleness_abort_ends_an_episode(tok):
    """Group 0's first request hangs; the engine moves two versions on (max_staleness 1): the group is
    aborted, its episodes' agents cancelled, its request cancelled, and the other groups go on."""
    LOG["cancelled"].clear()
    engine = ScriptedEngine(slow_first_s=30.0)
    # one group at a time: groups 1 and 2 start after the push, at version 2, and are not stale
    cfg = make_cfg("waiting_agent", agent={"timeout_s": 1.0}, max_inflight_groups=1)

    async def push(gen):
        await asyncio.sleep(0.3)
        engine.update_weights([], 2)

    gen, stats, samples = run_gen(cfg, engine, tok, groups=3, batch_groups=2, during=push)
    assert stats["groups_aborted_stale"] == 1 and engine.cancelled == 1
    assert not any(s.group_id == "ag-0" for s in samples) and stats["groups_finished"] == 2
    assert sorted(c.split(".")[0] for c in LOG["cancelled"] if c.startswith("ag-0-")) == ["ag-0-0", "ag-0-1"]
    ep = gen.generate.endpoint
    assert not ep.sessions and all(
        "group was cancelled" in why for sid, why in ep.ended.items() if sid.startswith("ag-0-")
    )


def test_an_engine_error_generates_the_group_again(tok):
    engine = ScriptedEngine(fail_first=1)
    _, stats, samples = run_gen(make_cfg("tool_agent"), engine, tok)
    assert stats["engine_errors"] == 1 and stats["groups_finished"] == 1 and stats["samples_failed"] == 0
    assert all(s.status == Status.COMPLETED for s in samples)


def test_agent_config_errors_name_the_key():
    with pytest.raises(ValueError, match="leave rollout.generate_fn"):
        make_cfg("tool_agent", generate_fn="test_agent_episodes:tool_agent")
    with pytest.raises(ValueError, match="rollout.agent.max_turns=0"):
        make_cfg("tool_agent", agent={"max_turns": 0})
    from stages.rollout.agent_run import AgentGenerateFn
    from stages.rollout.hooks import HookError

    cfg = make_cfg("tool_agent", generate_kwargs={"nope": 1})
    with pytest.raises(HookError, match="nope=...") as e:
        AgentGenerateFn.from_config(cfg.rollout, None)
    assert "generate_kwargs are passed as keyword arguments" in str(e.value)


def test_the_agent_example_of_docs_rollouts_runs(tok, tmp_path):
    from test_rollout_hooks import _doc_examples

    path = _doc_examples(tmp_path)["my_agent.py"]
    cfg = make_cfg("tool_agent", generate_kwargs={"max_tool_calls": 2})
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, agent_fn=f"{path}:agent"))
    _, stats, samples = run_gen(cfg, ScriptedEngine(), tok)
    assert stats["samples_failed"] == 0 and len(samples) == 2
    assert all(s.array("response_ids").tolist() == CALL and s.metadata["model_turns"] == 1 for s in samples)
