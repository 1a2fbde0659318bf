"""The OpenAI wire format of the agent endpoint (stages/rollout/agent_endpoint.py): requests checked and
normalised, tool calls read from the model's own text, and responses (whole or streamed) written.

Nothing here touches tokens. A request that cannot be served raises RequestError, which the endpoint
answers with an OpenAI-style error body ({"error": {"message", "type", "param"}}) naming the field and
what to send instead; nothing of the episode changes on such a request.

Messages are compared (is this call's history the episode so far?) by `Message.key`: role and text for
every message, plus the tool calls of an assistant message (name and arguments, the arguments as parsed
JSON, so that key order or spacing in an echoed `arguments` string does not count as a change). Tool-call
ids, names of tool messages and any other fields are not part of it: the chat template renders an
appended message from its role and text (multiturn.TurnTemplate), so they cannot change its tokens.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)  # Qwen / Hermes tool calls


class RequestError(ValueError):
    """A request the endpoint cannot serve: answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("not_found_error" if status == 404 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Message:
    """One chat message, normalised: `template` is what the chat template renders, `key` what calls are
    compared by (see the module docstring)."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as canonical JSON) of an assistant turn

    @property
    def key(self) -> tuple:
        return (self.role, self.content, self.tool_calls)

    @property
    def template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:  # HF templates render `arguments` as a mapping (Qwen: `| tojson`)
            out["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for n, a in self.tool_calls
            ]
        return out


@dataclass(kw_only=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    stream: bool = False
    logprobs: bool = False
    parse_tools: bool = False  # the request offered tools: read <tool_call> blocks into tool_calls


@dataclass(kw_only=True)
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int | None = None
    stream: bool = False


@dataclass(kw_only=True)
class TurnOut:
    """What a model turn answers: the text (never re-encoded: the episode keeps the engine's tokens),
    tool calls read from it, and the counts for `usage`."""

    text: str
    finish_reason: str  # OpenAI's: "stop", "length", "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict] = field(default_factory=list)
    content: str | None = None  # the text without its tool-call blocks (chat), None when nothing is left
    logprobs: list[tuple[str, float]] = field(default_factory=list)  # (token text, logprob), if asked


# -- requests ----------------------------------------------------------------------------------------
def _object(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object ({what}), got {type(body).__name__}")
    return body


def _text(value: Any, where: str) -> str:
    """A message's content: a string, null (an assistant turn of only tool calls), or text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    400,
                    f"{where}[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}",
                    f"{where}[{i}]",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"{where}: must be a string, null or a list of text parts", where)


def _tool_calls(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(400, f"{where}: must be a list of tool calls", where)
    out = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise RequestError(
                400,
                f"{where}[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}} "
                "(send back the tool_calls of the assistant message as they were returned)",
                f"{where}[{i}]",
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise RequestError(
                    400, f"{where}[{i}].function.arguments is not JSON ({e.msg})", f"{where}[{i}]"
                ) from None
        out.append((fn["name"], json.dumps(args, sort_keys=True)))
    return tuple(out)


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            400, "messages: required, a non-empty list of {'role': ..., 'content': ...} objects", "messages"
        )
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise RequestError(400, f"{where}: must be an object with a 'role' string", where)
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if m["role"] == "assistant" else ()
        if "content" not in m and not calls:
            raise RequestError(400, f"{where}: no 'content' (a {m['role']} message needs one)", where)
        out.append(
            Message(role=m["role"], content=_text(m.get("content"), f"{where}.content"), tool_calls=calls)
        )
    return out


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise RequestError(400, f"{key}={v!r}: must be an integer >= 1", key)
        return v
    return None


def _common(body: dict) -> None:
    """The fields that would make a response the episode cannot record exactly."""
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError(
            400,
            f"n={n!r}: one choice per call (an episode is one line of turns); start more episodes with a larger "
            "rollout.group_size instead",
            "n",
        )
    stop = body.get("stop")
    if stop not in (None, "", []):
        raise RequestError(
            400,
            f"stop={stop!r}: stop strings are not supported, since a turn cut inside a token would not be the "
            "tokens the model produced; a turn ends at the model's stop token (rollout.sampling.stop_token_ids)",
            "stop",
        )
    if not isinstance(body.get("stream", False), bool):
        raise RequestError(400, "stream: must be true or false", "stream")


def chat_request(body: Any) -> ChatRequest:
    """A /v1/chat/completions body, checked. Sampling fields (temperature, top_p, seed, ...) are not read:
    the run's rollout.sampling applies, since the trainer's importance weights assume that distribution."""
    body = _object(body, "an OpenAI chat.completions request")
    _common(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(400, "tools: must be a list of tool definitions", "tools")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=tools or None,
        max_tokens=_max_tokens(body),
        stream=body.get("stream", False),
        logprobs=bool(body.get("logprobs")),
        parse_tools=bool(tools),
    )


def completion_request(body: Any) -> CompletionRequest:
    """A /v1/completions body, checked: one prompt, text or token ids."""
    body = _object(body, "an OpenAI completions request")
    _common(body)
    if body.get("echo"):
        raise RequestError(400, "echo=true is not supported: the response holds the completion only", "echo")
    if body.get("suffix"):
        raise RequestError(400, "suffix is not supported (no fill-in-the-middle)", "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise RequestError(
            400, "prompt: required, one non-empty string or one list of token ids (no batches)", "prompt"
        )
    return CompletionRequest(prompt=prompt, max_tokens=_max_tokens(body), stream=body.get("stream", False))


# -- tool calls in the model's text ------------------------------------------------------------------
def read_tool_calls(text: str, call_id: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model turn in the Qwen / Hermes format: each
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes a tool call and leaves the content.
    A block that is not such JSON stays in the content as text (the agent sees what the model wrote)."""
    calls: list[dict] = []

    def take(m: re.Match) -> str:
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return m.group(0)
        args = call.get("arguments", {})
        if isinstance(args, str):  # arguments written as a JSON string: a call only if it is JSON
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return m.group(0)
        calls.append(
            {
                "id": f"{call_id}-{len(calls)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(args)},
            }
        )
        return ""

    rest = TOOL_CALL.sub(take, text)
    if not calls:
        return text, []
    return (rest.strip() or None), calls


def returned_message(out: TurnOut) -> Message:
    """The assistant message a turn returned, as the agent will send it back (its key is compared)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(json.loads(c["function"]["arguments"]), sort_keys=True))
        for c in out.tool_calls
    )
    return Message(role="assistant", content=out.content or "", tool_calls=calls)


# -- responses ---------------------------------------------------------------------------------------
def _usage(out: TurnOut) -> dict:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def _logprobs(out: TurnOut) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in out.logprobs
        ]
    }


def chat_response(out: TurnOut, *, rid: str, model: str, logprobs: bool) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.tool_calls:
        message["tool_calls"] = out.tool_calls
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": out.finish_reason,
                "logprobs": _logprobs(out) if logprobs else None,
            }
        ],
        "usage": _usage(out),
    }


def chat_chunks(out: TurnOut, *, rid: str, model: str) -> list[dict]:
    """A streamed chat answer: the whole turn in one delta (it is generated whole), then the finish."""
    delta: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.tool_calls:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(out.tool_calls)]
    base = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    return [
        dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]),
        dict(
            base, choices=[{"index": 0, "delta": {}, "finish_reason": out.finish_reason}], usage=_usage(out)
        ),
    ]


def completion_response(out: TurnOut, *, rid: str, model: str) -> dict:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}],
        "usage": _usage(out),
    }


def completion_chunks(out: TurnOut, *, rid: str, model: str) -> list[dict]:
    base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model}
    return [
        dict(base, choices=[{"index": 0, "text": out.text, "finish_reason": None, "logprobs": None}]),
        dict(base, choices=[{"index": 0, "text": "", "finish_reason": out.finish_reason, "logprobs": None}]),
    ]
