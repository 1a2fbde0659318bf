"""The OpenAI-compatible endpoint a generator serves to its agents (rollout.agent_fn): /v1/chat/completions
and /v1/completions (streamed or not) and /v1/models, on a local port, in the generator's event loop.

How a call finds its episode. Each episode is a session, and its id travels in the base_url handed to the
agent, `http://HOST:PORT/s/<session>/v1`, so an unmodified `openai.AsyncOpenAI(base_url=..., api_key=...)`
reaches it with no extra header; the api_key handed over is the session id too, so a client that can only
be pointed at `http://HOST:PORT/v1` works as well (the session is then read from `Authorization: Bearer`).
An id the endpoint never served is answered 404 naming it; a session whose episode has ended, 400 with the
reason (its calls cannot change a finished episode).

The endpoint serves only what its sessions hold: the engine, budgets and tokens are the session's
(stages/rollout/agent_session.py), so nothing here depends on the kind of engine behind it.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import OrderedDict
from typing import Any

from aiohttp import web

from stages.rollout.agent_messages import (
    RequestError,
    chat_chunks,
    chat_request,
    chat_response,
    completion_chunks,
    completion_request,
    completion_response,
)
from stages.rollout.agent_session import AgentSession, EngineFailed, SessionEnded

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # an agent's transcript (aiohttp's default of 1 MiB is a long episode)
ENDED_KEPT = 4096  # ended sessions remembered, to answer "ended" (400) rather than "unknown" (404)


class AgentEndpoint:
    """Serves the sessions added to it. `await start()` binds (port 0: a free one); `url_for(sid)` is the
    base_url of a session; `aclose()` stops serving."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy"):
        self.host, self.port, self.model_name = host, port, model_name
        self.sessions: dict[str, AgentSession] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # sid -> why it ended
        self.requests = self.refused = 0
        self._runner: web.AppRunner | None = None

    # -- sessions --------------------------------------------------------------------------------------
    def add(self, session: AgentSession) -> str:
        """Serve `session`; returns its base_url."""
        if session.sid in self.sessions or session.sid in self.ended:
            raise ValueError(f"session id {session.sid!r} is already in use")
        self.sessions[session.sid] = session
        return self.url_for(session.sid)

    def remove(self, sid: str, reason: str) -> None:
        """Stop serving a session (its episode ended); later calls are told `reason`."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.end(None, reason)  # a call still in flight is cancelled and answered
            self.ended[sid] = session.ended[1] if session.ended else reason
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def url_for(self, sid: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/s/{sid}/v1"

    # -- serving ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        for prefix in ("/s/{sid}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
            app.router.add_get(f"{prefix}/models", self._models)
        app.router.add_get("/health", self._health)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(
                f"rollout.agent: cannot serve the agent endpoint on {self.host}:{self.port} ({e}); set "
                "rollout.agent.port=0 for a free port (several generators need one each)"
            ) from None
        self.port = sock.getsockname()[1]
        # access logs off: one line per model turn would drown the generator's log
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        log.info("agent endpoint serving on http://%s:%d (sessions under /s/<id>/v1)", self.host, self.port)

    async def aclose(self) -> None:
        for sid in list(self.sessions):
            self.remove(sid, "the endpoint closed")
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every refusal as an OpenAI-style error body, the reason and the fix in its message."""
        self.requests += 1
        try:
            return await handler(request)
        except RequestError as e:
            return self._refuse(e)
        except SessionEnded as e:
            return self._refuse(RequestError(400, str(e), kind="session_ended"))
        except EngineFailed as e:
            return self._refuse(
                RequestError(503, f"{e}; the episode's group is generated again", kind="engine_error")
            )
        except web.HTTPNotFound:
            return self._refuse(
                RequestError(
                    404,
                    f"no route {request.method} {request.path}: this endpoint serves POST <base_url>/chat/completions "
                    "and <base_url>/completions, GET <base_url>/models, where base_url is the one handed to the "
                    "agent_fn (http://HOST:PORT/s/<session>/v1)",
                )
            )
        except web.HTTPMethodNotAllowed as e:
            return self._refuse(
                RequestError(405, f"{request.method} {request.path}: use {', '.join(e.allowed_methods)}")
            )
        except Exception as e:  # a bug here: the agent is told, the generator's log has the traceback
            log.exception("agent endpoint: %s %s failed", request.method, request.path)
            return self._refuse(
                RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
            )

    def _refuse(self, e: RequestError) -> web.Response:
        self.refused += 1
        return web.json_response(e.body(), status=e.status)

    def _session(self, request: web.Request) -> AgentSession:
        sid = request.match_info.get("sid")
        if sid is None:  # /v1/...: the api key handed to the agent is its session id
            auth = request.headers.get("Authorization", "")
            sid = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not sid:
                raise RequestError(
                    404,
                    "no session: use the base_url handed to the agent_fn (http://HOST:PORT/s/<session>/v1), or "
                    "send its api_key (the session id) as 'Authorization: Bearer <session>'",
                )
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self.ended:
            raise SessionEnded(sid, self.ended[sid])
        raise RequestError(
            404,
            f"no session {sid!r} on this endpoint: a session exists while its episode runs; use the base_url "
            "and api_key handed to the agent_fn for this episode",
        )

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not JSON ({e}); send a JSON object") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = chat_request(await self._body(request))
        out = await session.chat(req)
        rid = f"{session.sid}-{session.turns}"
        if req.stream:
            return await self._stream(request, chat_chunks(out, rid=rid, model=self.model_name))
        return web.json_response(chat_response(out, rid=rid, model=self.model_name, logprobs=req.logprobs))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = completion_request(await self._body(request))
        out = await session.complete(req)
        rid = f"{session.sid}-{session.turns}"
        if req.stream:
            return await self._stream(request, completion_chunks(out, rid=rid, model=self.model_name))
        return web.json_response(completion_response(out, rid=rid, model=self.model_name))

    async def _stream(self, request: web.Request, chunks: list[dict]) -> web.StreamResponse:
        """Server-sent events, as OpenAI streams them; the turn is generated whole, then sent."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        if "sid" in request.match_info:
            self._session(request)  # a wrong base_url fails here, at the agent's first look
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "slipstream"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions)})
