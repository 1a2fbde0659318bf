"""One agent episode as tokens: the calls an agent makes through the endpoint, matched against the episode
so far and kept as the exact token ids the model saw and produced.

Rules (those of stages/rollout/multiturn.py, for calls that arrive as OpenAI messages):
- A call whose messages begin with the episode's transcript (every message so far, the model's own turns
  as they were returned) extends it: the model's earlier turns are the engine's tokens, never decoded and
  re-encoded, and only the new messages are appended, as the chat template's tokens for them
  (multiturn.TurnTemplate: loss_mask 0, logprob 0.0, the version of the model token before them).
- A call that does not (an agent that edits, drops or reorders the transcript, switches between chat and
  text completions, or a template that re-renders earlier turns) starts a new segment: its whole history
  rendered by the chat template as a new prompt. The earlier segment keeps what the model did produce,
  and the episode records where and why it diverged; each segment becomes one Sample, so no Sample holds
  tokens in a context the model never saw.
- /v1/completions calls are matched the same way on text: a prompt that begins with the episode's text
  so far (its prompt and the completions returned) appends the rest, tokenised alone; a prompt of token
  ids is matched on ids.
- rollout.sampling.max_new_tokens is each segment's response budget (model and appended tokens, as in
  multiturn.Conversation); a model turn may be capped lower by the request's max_tokens. Appended tokens
  that leave no room for a model turn are cut off, and the episode ends `truncated`.
- Calls of one session are served one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffer.record import Sample, Status
from stages.rollout.agent_messages import (
    ChatRequest,
    CompletionRequest,
    Message,
    RequestError,
    TurnOut,
    read_tool_calls,
    returned_message,
)
from stages.rollout.engine import GenRequest, GenResult, SamplingParams, stop_token_of
from stages.rollout.hooks import fill_response
from stages.rollout.multiturn import TemplateError, TurnTemplate

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class SessionEnded(Exception):
    """A call on a session that takes no more calls (answered 400, naming the reason)."""

    def __init__(self, sid: str, reason: str):
        super().__init__(
            f"session {sid!r} has ended: {reason}; it takes no more calls (the agent_fn should return)"
        )


class EngineFailed(RuntimeError):
    """The engine failed under a call (answered 503); the episode's group is retried."""


def token_crc(ids: list[int]) -> int:
    """A checksum of token ids as the engine returned them (metadata spans: audits check the Sample)."""
    return zlib.crc32(np.asarray(ids, dtype="<i4").tobytes())


def turn_mismatches(sample: Sample) -> int:
    """How many model turns of an agent episode's Sample are not the engine's tokens (checked against
    the [start, length, crc32] metadata["agent"]["turns"] recorded as the engine answered), counting
    loss_mask 1 outside those turns as one more: 0 for a token-exact sample."""
    ids = sample.array("response_ids").tolist()
    mask = sample.array("loss_mask").tolist()
    model = [0] * len(ids)
    bad = 0
    for start, n, crc in (sample.metadata.get("agent") or {}).get("turns", []):
        span = ids[start : start + n]
        bad += len(span) != n or token_crc(span) != crc or any(m != 1 for m in mask[start : start + n])
        model[start : start + n] = [1] * len(span)
    return bad + (mask != model)


@dataclass(eq=False)
class Segment:
    """A run of calls that extend one another: one prompt, one response of model and appended tokens."""

    mode: str  # "chat" or "text" (/v1/completions)
    prompt_ids: list[int]
    started_by: str  # why a segment began here: "first call", or how the call diverged
    diverged_at: int | None = None  # the first message (chat) that differed from the episode's
    keys: list[tuple] = field(default_factory=list)  # chat: the messages the tokens stand for
    text: str | None = None  # text mode, text prompts: the text the tokens stand for
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[list[int]] = field(default_factory=list)  # [start, length, crc] of each model turn
    last_finish: str = ""
    last_stop: int | None = None  # the stop token that ended the last model turn (TurnTemplate glue)
    routed_experts: Any = None  # the last turn's (covers every position before it)
    retokenize_diffs: int = 0  # model turns whose text re-encodes to other tokens (kept as generated)
    truncated_by: str = ""

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_env(self, ids: list[int], version: int) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.last_stop = None

    def add_model(self, res: GenResult) -> None:
        ids = [int(t) for t in res.response_ids]
        self.turns.append([len(self.response_ids), len(ids), token_crc(ids)])
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in res.logprobs]
        self.versions += [int(v) for v in res.versions]
        self.last_finish = res.finish_reason
        self.last_stop = stop_token_of(res)  # None after a stop string: its last token is text
        self.routed_experts = res.routed_experts

    def status(self) -> Status:
        """As its last model turn ended (a turn cut by max_tokens or the budget: truncated)."""
        if self.truncated_by:
            return Status.TRUNCATED
        return FINISH_STATUS.get(self.last_finish, Status.ABORTED)

    def fill(self, sample: Sample, status: Status, error: str, meta: dict) -> Sample:
        sample.metadata = {**sample.metadata, "model_turns": len(self.turns), "agent": meta}
        if self.truncated_by:
            sample.metadata["truncated_by"] = self.truncated_by
        return fill_response(
            sample,
            response_ids=self.response_ids,
            rollout_logprobs=self.logprobs,
            versions=self.versions,
            loss_mask=self.loss_mask,
            status=status,
            error=error,
            routed_experts=self.routed_experts,
        )

    def meta(self) -> dict:
        return {
            "started_by": self.started_by,
            "diverged_at": self.diverged_at,
            "mode": self.mode,
            "turns": self.turns,
            "retokenize_diffs": self.retokenize_diffs,
        }


class AgentSession:
    """The calls of one episode (session id `sid`) on `engine`, with the run's sampling `params`.

    template: returns the run's TurnTemplate (raises TemplateError if the tokenizer has none);
    on_engine_error: called when the engine fails under a call (the episode then ends: see agent_run).
    """

    def __init__(
        self,
        sid: str,
        engine: Any,
        params: SamplingParams,
        tokenizer: Any,
        *,
        template: Callable[[], TurnTemplate],
        max_turns: int,
        on_engine_error: Callable[[BaseException], None] | None = None,
    ):
        self.sid, self.engine, self.params, self.tok = sid, engine, params, tokenizer
        self._template, self.max_turns, self.on_engine_error = template, max_turns, on_engine_error
        self.budget = params.max_new_tokens
        self.segments: list[Segment] = []
        self.turns = 0  # model turns answered, over every segment
        self.calls = 0  # requests received (refused ones included)
        self.ended: tuple[Status | None, str] | None = None  # (the status it forces, or None; why)
        self.engine_error: BaseException | None = None
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future | None = None

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def end(self, status: Status | None, reason: str) -> None:
        """Take no more calls (the first reason given is kept); a turn in flight is cancelled (its request
        leaves the engine). status: what the episode ends as, or None for as its last turn ended."""
        if self.ended is None:
            self.ended = (status, reason)
        if self._inflight is not None and not self._inflight.done():
            self._inflight.cancel()

    # -- chat ------------------------------------------------------------------------------------------
    async def chat(self, req: ChatRequest) -> TurnOut:
        async with self._lock:
            self._admit()
            seg, msgs = self.current, req.messages
            why, add = self._extends_chat(seg, msgs)
            if why is None:
                target = seg
            else:
                target = Segment(
                    mode="chat",
                    prompt_ids=self._render(msgs, req.tools),
                    started_by=why[0],
                    diverged_at=why[1],
                )
            res = await self._turn(target, add, req.max_tokens)
            out = self._out(target, res, chat=True, parse_tools=req.parse_tools, logprobs=req.logprobs)
            target.keys = [m.key for m in msgs] + [returned_message(out).key]
            return out

    def _extends_chat(self, seg: Segment | None, msgs: list[Message]) -> tuple[tuple | None, list[int]]:
        """(None, tokens to append) if `msgs` extend `seg`; else ((why, message index), [])."""
        if seg is None:
            return ("first call", None), []
        if seg.mode != "chat":
            return ("a /v1/chat/completions call after /v1/completions calls", 0), []
        keys, n = [m.key for m in msgs], len(seg.keys)
        if keys[:n] != seg.keys:
            i = next((i for i, (a, b) in enumerate(zip(keys, seg.keys)) if a != b), min(len(keys), n))
            if i == len(keys):
                return (f"the call's messages end before the episode's messages[{i}]", i), []
            return (f"the call's messages[{i}] differs from the episode's", i), []
        new = msgs[n:]
        if any(m.tool_calls for m in new):  # TurnTemplate renders role and text only
            return ("an assistant message with tool_calls written by the agent", n), []
        try:
            plain = [{"role": m.role, "content": m.content} for m in new]
            return None, self._template().tokens(plain, after_stop_token=seg.last_stop)
        except TemplateError as e:  # e.g. a template that drops earlier reasoning: the model sees a re-render
            return (f"the chat template cannot append to the episode ({e})", n), []

    def _render(self, msgs: list[Message], tools: list[dict] | None) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise RequestError(
                400, "the model's tokenizer has no chat template: use /v1/completions with the prompt text"
            )
        try:
            text = self.tok.apply_chat_template(
                [m.template for m in msgs], tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a role or a field the template refuses (jinja raise_exception)
            raise RequestError(
                400, f"the chat template cannot render these messages: {e}", "messages"
            ) from None
        return list(self.tok(text, add_special_tokens=False).input_ids)

    # -- text completions ------------------------------------------------------------------------------
    async def complete(self, req: CompletionRequest) -> TurnOut:
        async with self._lock:
            self._admit()
            seg, prompt = self.current, req.prompt
            why, add = self._extends_text(seg, prompt)
            if why is None:
                target = seg
            else:
                ids = prompt if isinstance(prompt, list) else self.tok(prompt).input_ids
                target = Segment(mode="text", prompt_ids=[int(t) for t in ids], started_by=why)
            res = await self._turn(target, add, req.max_tokens)
            out = self._out(target, res, chat=False, parse_tools=False, logprobs=False)
            target.text = prompt + out.text if isinstance(prompt, str) else None
            return out

    def _extends_text(self, seg: Segment | None, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if seg is None:
            return "first call", []
        if seg.mode != "text":
            return "a /v1/completions call after /v1/chat/completions calls", []
        if isinstance(prompt, list):
            ctx = seg.context
            if prompt[: len(ctx)] == ctx:
                return None, [int(t) for t in prompt[len(ctx) :]]
            return "the prompt's token ids do not begin with the episode's", []
        if seg.text is not None and prompt.startswith(seg.text):
            rest = prompt[len(seg.text) :]
            return None, list(self.tok(rest, add_special_tokens=False).input_ids) if rest else []
        return "the prompt does not begin with the episode's text so far", []

    # -- one model turn --------------------------------------------------------------------------------
    def _admit(self) -> None:
        self.calls += 1
        if self.ended is not None:
            raise SessionEnded(self.sid, self.ended[1])
        if self.turns >= self.max_turns:
            self.end(Status.TRUNCATED, f"its turn budget (rollout.agent.max_turns={self.max_turns}) is spent")
            raise SessionEnded(self.sid, self.ended[1])

    async def _turn(self, target: Segment, add: list[int], max_tokens: int | None) -> GenResult | None:
        """Append `add` and one model turn to `target` (a new segment joins the episode with its first
        turn): nothing is recorded unless the engine answers, so a failed or cancelled call changes
        nothing. None when the appended tokens leave no room for a model turn (the episode then ends)."""
        room = self.budget - len(target.response_ids) - len(add)
        if room <= 0:
            target.add_env(add[: self.budget - len(target.response_ids)], target.versions[-1])
            target.truncated_by = "environment tokens"
            self.end(None, f"its response budget (rollout.sampling.max_new_tokens={self.budget}) is spent")
            return None
        res = await self._generate(target.context + add, min(room, max_tokens or room))
        if self.ended is not None:  # ended while the answer was on its way: its samples may be made already
            raise SessionEnded(self.sid, self.ended[1])
        if target is not self.current:
            self.segments.append(target)
        if add:
            target.add_env(add, target.versions[-1])  # a segment extended has a model turn before them
        target.add_model(res)
        self.turns += 1
        if res.finish_reason == "abort":
            self.end(
                Status.ABORTED, "the engine aborted its turn (shutting down, or the request was cancelled)"
            )
        elif len(target.response_ids) >= self.budget:
            self.end(None, f"its response budget (rollout.sampling.max_new_tokens={self.budget}) is spent")
        return res

    async def _generate(self, ids: list[int], room: int) -> GenResult:
        req = GenRequest(
            prompt_ids=ids,
            params=dataclasses.replace(self.params, max_new_tokens=room),
            rid=f"{self.sid}-{self.turns}",
            affinity=self.sid,  # an EnginePool keeps the episode on one engine
        )
        self._inflight = asyncio.ensure_future(self.engine.generate([req]))
        try:
            (res,) = await self._inflight
            return res
        except asyncio.CancelledError:
            # end() cancelled the request, not the caller: the call is answered, naming why
            if self.ended is not None and not asyncio.current_task().cancelling():
                raise SessionEnded(self.sid, self.ended[1]) from None
            raise
        except Exception as e:
            self.engine_error = e
            self.end(Status.ABORTED, f"the engine failed under it ({type(e).__name__}: {e})")
            if self.on_engine_error is not None:
                self.on_engine_error(e)
            raise EngineFailed(f"the engine failed: {type(e).__name__}: {e}") from e
        finally:
            self._inflight = None

    def _out(
        self, seg: Segment, res: GenResult | None, *, chat: bool, parse_tools: bool, logprobs: bool
    ) -> TurnOut:
        """What the agent is answered; the text is decoded to be read, never re-encoded into the episode."""
        if res is None:
            return TurnOut(
                text="",
                content="",
                finish_reason="length",
                prompt_tokens=len(seg.context),
                completion_tokens=0,
            )
        ids = list(res.response_ids)
        body = ids[:-1] if stop_token_of(res) is not None else ids  # a stop string's text stays
        text = self.tok.decode(body, skip_special_tokens=False)
        if list(self.tok(text, add_special_tokens=False).input_ids) != body:
            seg.retokenize_diffs += 1  # what a proxy that re-encodes the text would have trained on wrongly
        finish = "length" if res.finish_reason == "length" else "stop"
        out = TurnOut(
            text=text,
            content=text,
            finish_reason=finish,
            prompt_tokens=len(seg.context) - len(ids),
            completion_tokens=len(ids),
        )
        if chat and parse_tools:
            out.content, out.tool_calls = read_tool_calls(text, f"call-{self.sid}-{self.turns}")
            if out.tool_calls and finish == "stop":
                out.finish_reason = "tool_calls"
        if logprobs:
            out.logprobs = [
                (self.tok.decode([t], skip_special_tokens=False), lp) for t, lp in zip(body, res.logprobs)
            ]
        return out
