"""The calculator environment (calculator.py) as an agent written only against the `openai` client: what a
user's agent looks like when trained through rollout.agent_fn (stages/rollout/agent_run.py).

The loop is calculator.episode's, over HTTP: ask the model; if its turn calls the tool
(`<tool>EXPRESSION</tool>`, the tiny model's own format, read from the text), send the result back as a
`tool` message and ask again; the turn without a call is the answer. The agent returns None: rollout.reward
(reasoning_gym) scores the episode, as configs/tool-calc-cpu.yaml scores the generate_fn's.

Use: rollout.agent_fn=stages.rollout.envs.calculator_agent:agent (configs/agent-calc-cpu.yaml).
generate_kwargs: max_tool_calls (default 2), request_timeout_s (default 120: one model call).
"""

from __future__ import annotations

import asyncio
import logging
import weakref

try:
    from openai import AsyncOpenAI
except ImportError as e:  # the dev extras have it; a run that names this agent needs it
    raise ImportError(
        f"stages.rollout.envs.calculator_agent is written against the openai client ({e}): "
        "pip install openai (or the project's dev extras: pip install -e '.[dev]')"
    ) from None

from stages.rollout.envs.calculator import TOOL_CALL, calculate

# the client logs every request at INFO: a line per model turn would drown the generator's log
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)


# one client per event loop, copied per episode with its base_url and key: building an AsyncOpenAI loads
# the CA certificates (~20 ms, measured: 5 of the 7 s that 256 episodes took with a client per episode),
# while a copy shares the first one's connection pool (its HTTP client is bound to the loop it runs in)
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client_for(base_url: str, api_key: str, timeout_s: float) -> AsyncOpenAI:
    loop = asyncio.get_running_loop()
    shared = _clients.get(loop)
    if shared is None:
        # no client retries: a refused call (the episode's budget is spent) is final, and an engine
        # failure is retried by the generator, which generates the whole group again
        shared = _clients[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return shared.with_options(base_url=base_url, api_key=api_key, timeout=timeout_s)


async def agent(
    base_url: str,
    api_key: str,
    record: dict,
    session_id: str,
    *,
    max_tool_calls: int = 2,
    request_timeout_s: float = 120.0,
) -> float | None:
    """One episode: the prompt's messages, then model turns and tool results until the model answers
    without a tool call (or calls it once too often, or is cut off)."""
    client = client_for(base_url, api_key, request_timeout_s)
    messages = list(record["prompt"])
    calls = 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        text = choice.message.content or ""
        messages.append({"role": "assistant", "content": text})
        call = TOOL_CALL.search(text)
        if choice.finish_reason != "stop" or call is None or calls >= max_tool_calls:
            return None  # an answer (or a turn cut off): rollout.reward scores the episode
        calls += 1
        messages.append({"role": "tool", "content": calculate(call.group(1))})
