"""Token-exact multi-turn rollouts: a conversation kept as the token ids the model saw and produced.

Rules (each one a known source of wrong training data in multi-turn RL):
- Model output is never decoded and re-encoded: a turn's tokens go into the response as the engine
  sampled them (a re-tokenisation can split text differently, and the trainer would then score tokens
  the policy never produced). Text is decoded only to read a turn (find a tool call).
- A new message (a tool result, a user reply) is appended as the chat template's own tokens for it:
  the text the template adds after the model's turn, rendered once for the new messages, tokenised
  alone (`TurnTemplate`). Earlier turns are never re-rendered. Several messages at once (consecutive
  tool results) are rendered together, since some templates group them.
- loss_mask is 1 on model tokens and 0 on everything the environment added. Environment tokens carry
  logprob 0.0 and the version of the model token before them; the trainer never uses either (mask 0),
  and the version keeps the sample's staleness that of its oldest model token.
- Each model turn is an ordinary engine request on the whole context so far, so its per-token
  versions and logprobs follow the single-turn rule across weight updates.
- The response (model and environment tokens) never exceeds its budget: what would pass it is cut
  off and the sample ends `truncated`. A tool that raises or times out ends the sample `failed`, the
  reason in `error` and metadata["failure"]; the other samples of the group are not affected.
- Sync tools run in a thread pool of their own (TOOL_THREADS threads), not the event loop's default
  executor, which the reward scorer and the buffer polling use: a tool that hangs past its timeout
  keeps its thread until it returns, and can only starve other tool calls (which then time out).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from buffer.record import Sample, Status
from stages.rollout.engine import GenResult, SamplingParams, stop_token_of
from stages.rollout.hooks import EngineHandle, fill_response

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}

TOOL_THREADS = 32  # threads for sync tools, per process (shared by every conversation)
_tool_pool: ThreadPoolExecutor | None = None
_tool_pool_lock = threading.Lock()


def _tool_executor() -> ThreadPoolExecutor:
    global _tool_pool
    with _tool_pool_lock:
        if _tool_pool is None:
            _tool_pool = ThreadPoolExecutor(max_workers=TOOL_THREADS, thread_name_prefix="slipstream-tool")
        return _tool_pool


_MARK = "\x1fslipstream-turn\x1f"  # dummy assistant content; found again in the rendered text


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn; the message says why and what to do."""


class TurnTemplate:
    """The chat template's tokens for new messages after a model turn.

    Rendered on a fixed dummy conversation: [user, assistant] without a generation prompt is the text
    before the new messages, [user, assistant, *messages] with one is the text after. What the second
    adds, plus what the template writes after an assistant turn's content (e.g. "<|im_end|>\\n", of which
    the model itself generated the stop token), are the tokens to append.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat template, so messages cannot be appended per turn; append "
                "token ids (Conversation.append_tokens) or text (append_text) instead"
            )
        self.tok = tokenizer
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        before = self._render(base, generation_prompt=False)
        at = before.rfind(_MARK)
        if at < 0:
            raise TemplateError(
                "the chat template drops the assistant's content; it cannot be extended per turn"
            )
        self._base, self._before = base, before
        self.after_turn = before[at + len(_MARK) :]  # what the template writes after the model's content
        self._cache: dict[tuple, list[int]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def tokens(self, messages: Sequence[dict[str, str]], *, after_stop_token: int | None) -> list[int]:
        """Token ids to append after a model turn for `messages`, ending with the generation prompt of
        the next model turn. `after_stop_token`: the stop token that ended the model's turn (its text
        is then not written again), or None if the turn ended without one."""
        key = (tuple((m["role"], m["content"]) for m in messages), after_stop_token)
        if key in self._cache:
            return list(self._cache[key])
        after = self._render([*self._base, *messages], generation_prompt=True)
        if not after.startswith(self._before):
            raise TemplateError(
                "the chat template renders earlier turns differently once a message follows them (e.g. it "
                "drops past reasoning), so appending per turn would not match what the model saw; use a "
                "template that only appends, or build the conversation's tokens yourself"
            )
        glue = self.after_turn
        if after_stop_token is not None:
            stop_text = self.tok.decode([after_stop_token], skip_special_tokens=False)
            if stop_text and glue.startswith(stop_text):
                glue = glue[len(stop_text) :]
        text = glue + after[len(self._before) :]
        ids = list(self.tok(text, add_special_tokens=False).input_ids)
        self._cache[key] = ids
        return list(ids)


class Conversation:
    """One sample's multi-turn response, built token by token.

    engine: the generate_fn's EngineHandle; params: its sampling params (params.max_new_tokens is the
    response budget unless `max_response_tokens` is given; `max_turn_tokens` caps a single model turn).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        engine: EngineHandle,
        params: SamplingParams,
        *,
        template: TurnTemplate | None = None,
        tokenizer=None,
        max_response_tokens: int | None = None,
        max_turn_tokens: int | None = None,
    ):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.engine, self.params, self.template = engine, params, template
        self.tok = tokenizer if tokenizer is not None else getattr(template, "tok", None)
        self.budget = max_response_tokens or params.max_new_tokens
        self.max_turn_tokens = max_turn_tokens or self.budget
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.status: Status | None = None  # None while the conversation may go on
        self.error = ""
        self.metadata: dict[str, Any] = {}
        self.model_turns = 0
        self.routed_experts = None  # MoE routing replay: the last model turn's GenResult.routed_experts
        self._last_stop: int | None = None  # stop token that ended the last model turn
        self._finished = False

    @property
    def done(self) -> bool:
        """True once the sample has ended (truncated, failed, aborted, or finish() was called)."""
        return self._finished or (self.status is not None and self.status != Status.COMPLETED)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.response_ids)

    # -- model turns -------------------------------------------------------------------------------
    async def generate(self, **overrides) -> GenResult | None:
        """One model turn on the whole context (prompt + response so far); its tokens are appended with
        loss_mask 1. overrides: SamplingParams fields for this turn (e.g. stop_token_ids). Returns the
        engine's result, or None if the conversation had already ended."""
        if self.done:
            return None
        room = min(
            self.remaining, self.max_turn_tokens, overrides.pop("max_new_tokens", self.max_turn_tokens)
        )
        params = dataclasses.replace(self.params, max_new_tokens=room, **overrides)
        (res,) = await self.engine.generate(self.prompt_ids + self.response_ids, params)
        self.response_ids += res.response_ids
        self.loss_mask += [1] * len(res.response_ids)
        self.logprobs += res.logprobs
        self.versions += res.versions
        self.routed_experts = res.routed_experts  # the last turn's covers every position before it
        self.model_turns += 1
        self.status = _FINISH.get(res.finish_reason, Status.ABORTED)
        self._last_stop = stop_token_of(res)  # None after a stop string: its last token is text
        if res.finish_reason == "stop" and self.remaining <= 0:
            self._finished = True  # nothing fits after it: the conversation ends here, completed
        return res

    def turn_text(self, res: GenResult) -> str:
        """A model turn's text (without its stop token; with all of a stop string), to read it: never
        re-encoded."""
        ids = res.response_ids[:-1] if stop_token_of(res) is not None else res.response_ids
        return self.tok.decode(ids, skip_special_tokens=False)

    # -- environment turns -------------------------------------------------------------------------
    def append_messages(self, messages: Sequence[dict[str, str]]) -> None:
        """Append chat messages (e.g. [{"role": "tool", "content": "42"}]) as the template's tokens for
        them, followed by the generation prompt of the next model turn (loss_mask 0)."""
        if self.template is None:
            raise TemplateError("append_messages needs Conversation(template=TurnTemplate(tokenizer))")
        self.append_tokens(self.template.tokens(messages, after_stop_token=self._last_stop))

    def append_text(self, text: str) -> None:
        """Append environment text, tokenised alone (loss_mask 0)."""
        self.append_tokens(self.tok(text, add_special_tokens=False).input_ids)

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        """Append environment tokens (loss_mask 0, logprob 0.0, the version of the token before them).
        Tokens past the budget are cut off and the sample ends truncated."""
        if self.done:
            return
        ids = [int(t) for t in token_ids]
        if len(ids) >= self.remaining:  # no room left for the model's next turn either
            ids = ids[: self.remaining]
            self.status = Status.TRUNCATED
            self.metadata["truncated_by"] = "environment tokens"
        else:
            self.status = None  # the model speaks next
        version = self.versions[-1] if self.versions else self.engine.version
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self._last_stop = None

    async def call_tool(self, fn: Callable[..., Any], *args, timeout_s: float = 30.0, **kwargs) -> Any:
        """fn(*args, **kwargs) (async, or sync in a thread of the tools' own pool of TOOL_THREADS),
        within timeout_s (for a sync tool, time queued for a thread included). If it raises or times out
        the sample ends failed, with the reason in `error` and metadata["failure"], and None is returned.
        A timed-out async tool is cancelled; a timed-out sync tool cannot be stopped: it keeps its pool
        thread until it returns (its result is ignored), so a tool that can hang should time out itself."""
        name = getattr(fn, "__name__", "tool")
        try:
            if asyncio.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
            call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
            running = asyncio.get_running_loop().run_in_executor(_tool_executor(), call)
            return await asyncio.wait_for(running, timeout_s)
        except TimeoutError:
            self.fail(f"tool {name} timed out after {timeout_s:g}s")
        except Exception as e:
            self.fail(f"tool {name} raised {type(e).__name__}: {e}")
        return None

    def fail(self, reason: str) -> None:
        """End the sample as failed (not trained on; the rest of its group is)."""
        self.status, self.error = Status.FAILED, reason[:2000]
        self.metadata["failure"] = self.error

    def finish(self) -> None:
        """End the conversation here (after a model turn that stopped: the sample is completed)."""
        self._finished = True

    def fill(self, sample: Sample) -> Sample:
        """Write the response into `sample` (in place) and return it."""
        status = self.status
        if status is None:  # ended after environment tokens (e.g. the turn limit): no stop token closes it
            status = Status.TRUNCATED
            self.metadata.setdefault("truncated_by", "no model turn after the last environment tokens")
        sample.metadata = {**sample.metadata, **self.metadata, "model_turns": self.model_turns}
        return fill_response(
            sample,
            response_ids=self.response_ids,
            rollout_logprobs=self.logprobs,
            versions=self.versions,
            loss_mask=self.loss_mask,
            status=status,
            error=self.error,
            routed_experts=self.routed_experts,
        )
