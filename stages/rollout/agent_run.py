"""`rollout.agent_fn`: agents written against the OpenAI client, trained unchanged.

    async def my_agent(base_url: str, api_key: str, record: dict, session_id: str, **generate_kwargs):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        ... any loop of client.chat.completions.create(...) / client.completions.create(...) calls ...
        return reward   # a float, or None to have rollout.reward score the episode

Each episode of a group (rollout.group_size per prompt) is one call of the function with its own session
(stages/rollout/agent_session.py) on the generator's endpoint (agent_endpoint.py). `record` is the prompt
row: {"prompt": chat messages (the data.system_prompt included; the text without the chat template),
"label", "metadata", "index", "text": the prompt as the model sees it}; sending record["prompt"] as the
first messages reproduces exactly the prompt tokens of the built-in generators.

`AgentGenerateFn` takes the place of the generator's GenerateFn (generate_fn.py), so a group of episodes is
admitted, counted against the request cap, aborted past run.max_staleness, retried after an engine error
and scored, filtered and streamed like any group. An episode's calls all go to the group's engine (an
EnginePool keeps a session on one engine: GenRequest.affinity). How an episode ends:
- the function returns: each segment as its last model turn ended (completed, or truncated by a length cap);
- it runs past rollout.agent.timeout_s (cancelled) or calls past rollout.agent.max_turns (refused): truncated,
  with what it made;
- it raises, or returns something that is no reward: failed, the traceback in `error` and
  metadata["failure"]; the group's other episodes, and the run, go on;
- the engine fails under one of its calls: the whole group is generated again (rollout.engine_retries);
- its group is cancelled (past the staleness bound, or shut down): its calls in flight are answered 400
  and the function is cancelled.
Samples: one per segment (a diverging agent makes several), `group_size` the group's count of them. A
segment's metadata["agent"] has the session, the episode, why the segment began, and each model turn's
[start, length, crc32] in the response as the engine returned it (an audit can check the Sample against
it); every segment of an episode has the episode's reward: the agent's, or rollout.reward's score of the
last segment (the one that ends the episode).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import secrets
import time
import traceback
from typing import Any

import msgspec

from buffer.record import I32, Sample, Status, pack
from stages.reward.config import RewardConfig
from stages.reward.registry import RewardScorer
from stages.rollout.agent_endpoint import AgentEndpoint
from stages.rollout.agent_session import AgentSession
from stages.rollout.config import AgentConfig, RolloutConfig
from stages.rollout.engine import SamplingParams
from stages.rollout.generate_fn import GenerateFn
from stages.rollout.hooks import (
    EngineCallError,
    HookError,
    fill_response,
    gather_or_cancel,
    hook_name,
    load_hook,
)
from stages.rollout.multiturn import TurnTemplate
from stages.rollout.scoring import REWARDED_BY, score_samples

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # how long a cancelled agent_fn may take to stop before it is left behind, logged
EPISODE_ENDED = "its episode ended"  # why a session of a finished episode takes no more calls
FAILURES_LOGGED = 5  # tracebacks of failed episodes written to the log in full (each one is in its sample)


class Episode:
    """One agent_fn call's outcome: its session, and how it ended."""

    def __init__(self, index: int, session: AgentSession):
        self.index, self.session = index, session
        self.status: Status | None = None  # forced on every segment (failed); None = as each ended
        self.error = ""
        self.reward: float | None = None
        self.note = ""  # what else happened (an agent error after the session had ended)


class AgentGenerateFn(GenerateFn):
    """rollout.agent_fn, called once per episode; see the module docstring."""

    def __init__(
        self, fn: Any, *, kwargs: dict[str, Any], tokenizer: Any, agent: AgentConfig, reward: RewardConfig
    ):
        if not inspect.iscoroutinefunction(fn):
            raise HookError(f"rollout.agent_fn {hook_name(fn)}: must be an `async def` function")
        super().__init__(fn, per_sample=False, kwargs=kwargs, tokenizer=tokenizer)
        try:  # a generate_kwargs key the function does not take fails now, not in every episode
            inspect.signature(fn).bind("base_url", "api_key", {}, "session_id", **self.kwargs)
        except TypeError as e:
            raise HookError(
                f"rollout.agent_fn {self.name}: cannot be called as fn(base_url, api_key, record, session_id"
                f"{''.join(f', {k}=...' for k in self.kwargs)}) ({e}); rollout.generate_kwargs are passed "
                "as keyword arguments"
            ) from None
        self.cfg, self.scorer = agent, RewardScorer.from_config(reward)
        self.endpoint: AgentEndpoint | None = None
        self._starting: asyncio.Task | None = None
        self._closer: asyncio.Task | None = None
        self._template: TurnTemplate | None = None
        self.failures_logged = 0

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, tokenizer: Any) -> AgentGenerateFn:
        return cls(
            load_hook(rollout_cfg.agent_fn, "rollout.agent_fn"),
            kwargs=rollout_cfg.generate_kwargs,
            tokenizer=tokenizer,
            agent=rollout_cfg.agent,
            reward=rollout_cfg.reward,
        )

    # -- the endpoint ----------------------------------------------------------------------------------
    async def serving(self) -> AgentEndpoint:
        """The endpoint, started in the running loop at its first episode. It closes when the loop's last
        tasks are cancelled (the end of asyncio.run), or with aclose()."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting.get_loop() is not loop:
            self._starting = loop.create_task(self._start())
        return await asyncio.shield(self._starting)  # one start, however many groups wait for it

    async def _start(self) -> AgentEndpoint:
        ep = AgentEndpoint(host=self.cfg.host, port=self.cfg.port, model_name=self.cfg.model_name)
        await ep.start()
        self.endpoint = ep
        # held here: the loop keeps only a weak reference to a task, and a collected one would close it
        self._closer = asyncio.get_running_loop().create_task(self._close_with_the_loop(ep))
        return ep

    @staticmethod
    async def _close_with_the_loop(ep: AgentEndpoint) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await ep.aclose()

    async def aclose(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()

    def template(self) -> TurnTemplate:
        if self._template is None:
            self._template = TurnTemplate(self.tokenizer)  # raises TemplateError without a chat template
        return self._template

    # -- a group ---------------------------------------------------------------------------------------
    async def __call__(
        self, *, gid: str, prompt: Any, blanks: list[Sample], params: SamplingParams, engine: Any
    ) -> list[Sample]:
        endpoint = await self.serving()
        episodes = await gather_or_cancel(
            *(self._episode(endpoint, i, b, prompt, params, engine) for i, b in enumerate(blanks))
        )
        samples = [(ep, s) for ep in episodes for s in self._samples(ep, blanks[ep.index], prompt)]
        await self._score(samples)
        out = []
        for k, (_, s) in enumerate(samples):
            s = msgspec.structs.replace(s, uid=f"{gid}-{k}", group_index=k, group_size=len(samples))
            problem = s.array_problem()
            if problem:  # the episode's arrays are ours: a mismatch is a bug here, not the agent's
                raise HookError(f"rollout.agent_fn {self.name}: sample {s.uid}: {problem}")
            out.append(s)
        return out

    async def _episode(
        self, endpoint: AgentEndpoint, i: int, blank: Sample, prompt: Any, params: SamplingParams, engine: Any
    ) -> Episode:
        sid = f"{blank.uid}.{secrets.token_hex(4)}"  # a retried group's sessions are new ones
        agent: asyncio.Task | None = None

        def engine_failed(_e: BaseException) -> None:
            if agent is not None:
                agent.cancel()  # the group is generated again: this episode's agent has nothing left to do

        session = AgentSession(
            sid,
            engine,
            params,
            self.tokenizer,
            template=self.template,
            max_turns=self.cfg.max_turns,
            on_engine_error=engine_failed,
        )
        ep = Episode(i, session)
        url = endpoint.add(session)
        record = _record(prompt)
        agent = asyncio.ensure_future(self.fn(url, sid, record, sid, **copy.deepcopy(self.kwargs)))
        try:
            done, _ = await asyncio.wait({agent}, timeout=self.cfg.timeout_s)
            if session.engine_error is not None:
                raise EngineCallError(f"{type(session.engine_error).__name__}: {session.engine_error}")
            if not done:
                session.end(
                    Status.TRUNCATED,
                    f"its time budget (rollout.agent.timeout_s={self.cfg.timeout_s:g}) is spent",
                )
            elif agent.cancelled():
                self._fail(ep, "was cancelled from inside (not by the time budget or its group)")
            elif agent.exception() is not None:
                e = agent.exception()
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                self._fail(ep, f"raised {type(e).__name__}: {e}\n{tb[-3000:]}")
            else:
                self._set_reward(ep, agent.result())
            return ep
        except asyncio.CancelledError:
            session.end(Status.ABORTED, "its group was cancelled (past run.max_staleness, or shutting down)")
            raise
        finally:
            endpoint.remove(sid, EPISODE_ENDED)
            forget = getattr(engine, "forget_affinity", None)  # an EnginePool keeps no finished session
            if forget is not None:
                forget(sid)
            if not agent.done():
                agent.cancel()
                await _stopped(agent, self.name)

    def _fail(self, ep: Episode, what: str) -> None:
        reason = f"rollout.agent_fn {self.name} {what}"
        if ep.session.ended is not None:  # it ended first (a budget spent, the engine's abort): the
            ep.note = reason[:2000]  # agent's error follows from a refused call, and the ending stands
            return
        ep.status, ep.error = Status.FAILED, reason[:4000]
        if self.failures_logged < FAILURES_LOGGED:
            self.failures_logged += 1
            log.warning("agent episode %s failed: %s", ep.session.sid, reason)

    def _set_reward(self, ep: Episode, got: Any) -> None:
        if got is None:
            return
        if isinstance(got, bool) or not isinstance(got, int | float):
            self._fail(
                ep,
                f"returned {got!r:.80} ({type(got).__name__}): return the episode's reward as a float, or None "
                "to have rollout.reward score it",
            )
            return
        ep.reward = float(got)

    def _samples(self, ep: Episode, blank: Sample, prompt: Any) -> list[Sample]:
        """The episode's samples, one per segment with a model turn (uid and group fields set later)."""
        s, segs = ep.session, [seg for seg in ep.session.segments if seg.turns]
        forced, why = s.ended if s.ended is not None else (None, "")
        meta = {"session": s.sid, "episode": ep.index, "calls": s.calls, "segments": len(segs)}
        if why and why != EPISODE_ENDED:
            meta["ended"] = why
        if ep.note:
            meta["agent_error"] = ep.note
        if not segs:  # no model turn at all: nothing to train on, and the reason why
            error = ep.error or f"rollout.agent_fn {self.name} made no model call through its base_url" + (
                f" (session: {why})" if why else ""
            )
            out = copy.copy(blank)
            out.metadata = {**blank.metadata, "agent": meta, "failure": error}
            return [
                fill_response(
                    out, response_ids=[], rollout_logprobs=[], versions=[], status=Status.FAILED, error=error
                )
            ]
        samples = []
        for k, seg in enumerate(segs):
            last = k == len(segs) - 1
            status = ep.status or (forced if last and forced is not None else seg.status())
            if last and forced == Status.TRUNCATED and not seg.truncated_by:
                seg.truncated_by = why
            out = copy.copy(blank)
            if seg.prompt_ids != list(prompt.ids):  # the agent's own first messages, or a later segment
                out.prompt_ids = pack(seg.prompt_ids, I32)
                out.prompt = self.tokenizer.decode(seg.prompt_ids, skip_special_tokens=False)
            seg.fill(out, status, ep.error, {**meta, "segment": k, **seg.meta()})
            if ep.error:
                out.metadata["failure"] = ep.error
            samples.append(out)
        return samples

    async def _score(self, samples: list[tuple[Episode, Sample]]) -> None:
        """Every segment gets its episode's reward: the agent's, or rollout.reward's on the last segment."""
        by_episode: dict[int, list[Sample]] = {}
        for ep, s in samples:
            by_episode.setdefault(ep.index, []).append(s)
        episodes = {ep.index: ep for ep, _ in samples}
        to_score = [ss[-1] for i, ss in by_episode.items() if episodes[i].reward is None]
        await score_samples(self.scorer, self.tokenizer, to_score)
        for i, ss in by_episode.items():
            ep, last = episodes[i], ss[-1]
            for s in ss:
                s.finished_at = time.time()
                if ep.reward is not None:
                    s.reward = ep.reward
                elif s is not last:
                    s.reward, s.reward_parts = last.reward, dict(last.reward_parts)
                    if last.status == Status.FAILED and s.status != Status.FAILED:  # its scoring failed
                        s.status, s.error = Status.FAILED, last.error
                s.metadata[REWARDED_BY] = "agent_fn" if ep.reward is not None else "reward_fn"


def _record(prompt: Any) -> dict:
    """The prompt row an agent_fn gets (a copy: it may change it)."""
    return copy.deepcopy(
        {
            "prompt": prompt.messages or prompt.text,
            "label": prompt.label,
            "metadata": prompt.metadata,
            "index": prompt.index,
            "text": prompt.text,
        }
    )


async def _stopped(task: asyncio.Task, name: str) -> None:
    """Wait (bounded) for a cancelled agent_fn to stop; one that swallows the cancellation is left behind."""
    done, _ = await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
    if not done:
        log.error(
            "rollout.agent_fn %s did not stop within %.0fs of being cancelled (does it catch CancelledError?); "
            "left running",
            name,
            CANCEL_WAIT_S,
        )
    elif not task.cancelled() and task.exception() is not None:
        task.exception()  # retrieved: it ended the way it was told to, not worth a warning
