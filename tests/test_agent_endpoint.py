"""The agent endpoint over HTTP (stages/rollout/agent_endpoint.py): what a bad request, an unknown or
ended session, a text completion, a stream and a Qwen tool call get, and that a refused call changes
nothing of its episode; and the engine pool's session affinity."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from test_agent_episodes import ANSWER, CALL, EOS, ScriptedEngine, client

from stages.rollout.agent_endpoint import AgentEndpoint
from stages.rollout.agent_messages import read_tool_calls
from stages.rollout.agent_session import AgentSession
from stages.rollout.engine import GenRequest, GenResult, SamplingParams
from stages.rollout.engine_pool import EnginePool
from stages.rollout.multiturn import TurnTemplate

USER = [{"role": "user", "content": "7 times 6?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from stages.models import build_byte_tokenizer

    return build_byte_tokenizer(tmp_path_factory.mktemp("tok"))


def serve(tok, body, *, engine=None, max_turns=8, budget=96):
    """Run `await body(endpoint, session, base_url)` against a started endpoint with one session."""

    async def go():
        ep = AgentEndpoint()
        await ep.start()
        template = TurnTemplate(tok)
        session = AgentSession(
            "s1",
            engine or ScriptedEngine(),
            SamplingParams(max_new_tokens=budget),
            tok,
            template=lambda: template,
            max_turns=max_turns,
        )
        url = ep.add(session)
        try:
            return await asyncio.wait_for(body(ep, session, url), 30)
        finally:
            await ep.aclose()

    return asyncio.run(go())


async def post(url: str, payload, *, raw: bytes | None = None, headers=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else json.dumps(payload).encode()
        async with http.post(url, data=data, headers=headers or {}) as r:
            return r.status, await r.json()


def test_malformed_requests_get_a_400_naming_the_field_and_lose_nothing(tok):
    async def body(ep, session, url):
        async with client(url, "s1") as c:
            first = await c.chat.completions.create(model="m", messages=USER)
        bad = {
            b"{not json": "the request body is not JSON",
            json.dumps([1]).encode(): "must be a JSON object",
            json.dumps({"model": "m"}).encode(): "messages: required",
            json.dumps(
                {"messages": [{"content": "x"}]}
            ).encode(): "messages[0]: must be an object with a 'role'",
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(): (
                "messages[0].content[0]: only text parts"
            ),
            json.dumps({"messages": USER, "n": 2}).encode(): "n=2: one choice per call",
            json.dumps({"messages": USER, "stop": ["\n"]}).encode(): "stop strings are not supported",
            json.dumps({"messages": USER, "max_tokens": 0}).encode(): "max_tokens=0: must be an integer >= 1",
        }
        for raw, says in bad.items():
            status, err = await post(f"{url}/chat/completions", None, raw=raw)
            assert status == 400 and says in err["error"]["message"], (raw, err)
            assert err["error"]["type"] == "invalid_request_error"
        async with client(url, "s1") as c:  # the openai client raises it as BadRequestError, message intact
            with pytest.raises(openai.BadRequestError, match="stop strings are not supported"):
                await c.chat.completions.create(model="m", messages=USER, stop=["x"])
            # the episode is as it was: the next call extends it (no new segment)
            said = first.choices[0].message.content
            await c.chat.completions.create(
                model="m",
                messages=[*USER, {"role": "assistant", "content": said}, {"role": "tool", "content": "42"}],
            )
        assert len(session.segments) == 1 and session.turns == 2 and ep.refused == 9
        assert session.segments[0].response_ids[: len(CALL)] == CALL

    serve(tok, body)


def test_an_unknown_session_gets_a_404_naming_it_and_an_ended_one_a_400_with_the_reason(tok):
    async def body(ep, session, url):
        base = url.rsplit("/s/", 1)[0]
        status, err = await post(f"{base}/s/nope/v1/chat/completions", {"messages": USER})
        assert status == 404 and "no session 'nope'" in err["error"]["message"]
        assert "base_url and api_key handed to the agent_fn" in err["error"]["message"]
        async with client(f"{base}/v1", "ghost") as c:  # the api key names the session on /v1
            with pytest.raises(openai.NotFoundError, match="no session 'ghost'"):
                await c.chat.completions.create(model="m", messages=USER)
        async with client(f"{base}/v1", "s1") as c:
            r = await c.chat.completions.create(model="m", messages=USER)  # the api key alone finds it
            assert r.choices[0].finish_reason == "stop" and session.turns == 1
            assert [m.id for m in (await c.models.list()).data] == ["policy"]
        ep.remove("s1", "its episode ended")
        status, err = await post(f"{url}/chat/completions", {"messages": USER})
        assert status == 400 and "session 's1' has ended: its episode ended" in err["error"]["message"]
        status, err = await post(f"{base}/v2/whatever", {})
        assert status == 404 and "no route POST /v2/whatever" in err["error"]["message"]

    serve(tok, body)


def test_text_completions_extend_on_text_and_on_token_ids(tok):
    async def body(ep, session, url):
        async with client(url, "s1") as c:
            prompt = "<|im_start|>7 times 6?<|im_end|><|im_start|>"
            one = await c.completions.create(model="m", prompt=prompt)
            text = one.choices[0].text  # "\ufffd<tool>7*6</tool>": the model's stop token is not in it
            await c.completions.create(model="m", prompt=prompt + text + "<|im_start|>tool\n42<|im_end|>")
            seg = session.current
            assert len(session.segments) == 1 and seg.mode == "text"
            # the model's turn as sampled, then the agent's new text tokenised alone
            tail = tok("<|im_start|>tool\n42<|im_end|>", add_special_tokens=False).input_ids
            assert seg.response_ids == CALL + tail + ANSWER and seg.loss_mask.count(0) == len(tail)
            ids = seg.prompt_ids + seg.response_ids  # token ids: matched on ids
            await c.completions.create(model="m", prompt=ids + [ord("!")])
            assert len(session.segments) == 1 and seg.response_ids[-len(ANSWER) - 1] == ord("!")
            await c.completions.create(model="m", prompt="something else")  # diverges
            assert len(session.segments) == 2 and "does not begin" in session.current.started_by
            streamed = await c.chat.completions.create(model="m", messages=USER, stream=True)
            chunks = [ch async for ch in streamed]
            assert (
                "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                == "\ufffd<tool>7*6</tool>"
            )
            assert chunks[-1].choices[0].finish_reason == "stop"
            assert "after /v1/completions calls" in session.current.started_by

    serve(tok, body)


def test_qwen_tool_calls_are_read_and_echoed_back_without_a_new_segment(tok):
    call = b'<tool_call>\n{"name": "calc", "arguments": {"expr": "7*6"}}\n</tool_call>'
    engine = ScriptedEngine(lambda p: ([*call, EOS] if p.count(EOS) <= 1 else ANSWER, "stop"))
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]

    async def body(ep, session, url):
        async with client(url, "s1") as c:
            r = await c.chat.completions.create(model="m", messages=USER, tools=tools)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
            (tc,) = msg.tool_calls
            assert tc.function.name == "calc" and json.loads(tc.function.arguments) == {"expr": "7*6"}
            history = [*USER, msg.model_dump(exclude_none=True)]
            history.append({"role": "tool", "tool_call_id": tc.id, "content": "42"})
            r2 = await c.chat.completions.create(model="m", messages=history, tools=tools, logprobs=True)
            assert r2.choices[0].message.content == "<answer>42</answer>"
            assert [t.logprob for t in r2.choices[0].logprobs.content] == pytest.approx(
                [-0.01 * (i + 1) for i in range(len(ANSWER) - 1)]
            )
        (seg,) = session.segments  # the echoed tool call matched the model's turn
        assert seg.response_ids[: len(call) + 1] == [*call, EOS]

    serve(tok, body, engine=engine, budget=200)
    assert read_tool_calls("<tool_call>{not json}</tool_call>", "c") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )


def test_budget_spent_by_appended_tokens_ends_the_episode_with_a_length_finish(tok):
    async def body(ep, session, url):
        async with client(url, "s1") as c:
            r = await c.chat.completions.create(model="m", messages=USER)
            said = r.choices[0].message.content
            long_tool = {"role": "tool", "content": "x" * 200}
            r2 = await c.chat.completions.create(
                model="m", messages=[*USER, {"role": "assistant", "content": said}, long_tool]
            )
            assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.content == ""
            with pytest.raises(openai.BadRequestError, match="response budget"):
                await c.chat.completions.create(model="m", messages=USER)
        seg = session.current
        assert len(seg.response_ids) == 40 and seg.truncated_by == "environment tokens"
        assert seg.loss_mask == [1] * len(CALL) + [0] * (40 - len(CALL))

    serve(tok, body, budget=40)


def test_a_taken_port_names_the_key():
    async def go():
        first = AgentEndpoint()
        await first.start()
        try:
            with pytest.raises(OSError, match="rollout.agent.port=0"):
                await AgentEndpoint(port=first.port).start()
        finally:
            await first.aclose()

    asyncio.run(go())


class Stub:
    def __init__(self):
        self.outstanding, self.up, self.served = 0, True, []

    def available(self):
        return self.up

    async def generate(self, requests):
        self.served += [r.rid for r in requests]
        return [
            GenResult(rid=r.rid, response_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
            for r in requests
        ]


def test_the_pool_keeps_a_session_on_one_engine_while_it_is_up():
    a, b = Stub(), Stub()
    pool = EnginePool([a, b])

    def send(rid, key):
        asyncio.run(
            pool.generate([GenRequest(prompt_ids=[1], params=SamplingParams(), rid=rid, affinity=key)])
        )

    send("x1", "x")  # least loaded: a (ties go to the first)
    a.outstanding = 10  # a is now far busier; without affinity x's next turn would go to b
    send("x2", "x")
    send("y1", "y")  # a new key is balanced by load: b
    assert a.served == ["x1", "x2"] and b.served == ["y1"] and pool.pinned("x") == 0
    a.up = False  # a is down (restarting): x moves to b and stays there
    send("x3", "x")
    a.up, a.outstanding = True, 0
    send("x4", "x")
    assert b.served == ["y1", "x3", "x4"] and pool.pinned("x") == 1
    send("free", "")  # no key: by load, pinning nothing
    assert a.served[-1] == "free" and pool.pinned("") is None
    pool.forget_affinity("x")
    assert pool.pinned("x") is None
