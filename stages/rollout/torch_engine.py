"""The built-in torch inference engine: batched sampling with a KV cache, continuous batching and
versioned in-flight weight updates. CPU by default (fp32), CUDA works too.

One background thread owns the model and runs the decode loop, so asyncio callers never block on
torch. The loop works in chunks of `chunk_tokens` decode steps; at every chunk boundary it

  1. applies pending weight updates (update_weights() blocks its caller until then). In-flight
     sequences keep their KV cache, computed under the old weights, as SGLang's `in_place` pause does;
     every token records the version that sampled it, so a response may span several versions;
  2. admits waiting requests (continuous batching): they are prefilled (identical prompts once, e.g. a
     GRPO group) and merged into the running batch by left-padding the shorter KV cache.

Sequences are left-padded; the attention mask hides padding and explicit position ids keep each
row's positions what they would be without padding, so logprobs equal a plain unpadded forward.

Colocated offload (release and wake of the weights and KV cache) is torch_offload.py's, applied by the
engine thread between decode steps too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stages.host_copy import HostStash
from stages.rollout.engine import Engine, GenRequest, GenResult, interrupted
from stages.rollout.offload import WEIGHTS
from stages.rollout.sampling import sample
from stages.rollout.stop_strings import StopStrings
from stages.rollout.torch_batch import Batch, kv_pairs, make_cache, out_cache
from stages.rollout.torch_batch import merge as _merge  # a test counts the merges through this name
from stages.rollout.torch_model import checkpoint_names
from stages.rollout.torch_model import record_routing as recorder_of  # the name is a parameter here
from stages.rollout.torch_offload import MemOp, TorchMemoryRelease

log = logging.getLogger(__name__)
Callback = Callable[[GenResult | BaseException], None]


@dataclass(eq=False)
class _Seq:
    req: GenRequest
    done: Callback
    stop: frozenset[int]
    stop_text: StopStrings | None = None  # rollout.sampling.stop: checked after every token
    matched: str | None = None  # the stop string that ended it
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # record_routing: [positions, layers, k] parts
    cancelled: bool = False  # its caller gave up (a group aborted): dropped at the next step


@dataclass(eq=False)
class _Update:
    tensors: list[tuple[str, torch.Tensor]]
    version: int
    applied: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class TorchEngine(TorchMemoryRelease, Engine):
    """Engine over an HF causal-LM folder. Thread-safe; `generate` is safe to await from asyncio."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        chunk_tokens: int = 8,
        seed: int = 0,
        version: int = 0,
        name: str = "torch-engine",
        record_routing: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1 or chunk_tokens < 1:
            raise ValueError("max_batch_size and chunk_tokens must be >= 1")
        self.device = torch.device(device)
        self.model_path = str(model_path)
        self._tokenizer = None  # loaded from the model folder at the first request with stop strings
        self._tokenizer_lock = threading.Lock()
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=getattr(torch, dtype), local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self._routers = recorder_of(self.model) if record_routing else None
        self.eos_ids = self._eos_ids()
        # transformers >= 5.2x names the KV-cache argument and output `cache` (was past_key_values)
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self._version = version
        self._cond = threading.Condition()
        self._pending: deque[_Seq] = deque()
        self._updates: list[_Update] = []
        self._memops: list[MemOp] = []  # releases wait for the running batch to finish
        self._released: set[str] = set()
        self._held = False  # no new sequence starts: something is released, or a release waits
        self._stash = HostStash(self.device, name)
        self._paused = False
        self._closed = False
        self._batch: Batch | None = None
        self._open = 0  # requests generate() submitted and not yet answered
        self._open_lock = threading.Lock()
        self._stats = dict(tokens=0, prefill_tokens=0, steps=0, busy_s=0.0, idle_s=0.0, updates=0)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for cfg in (self.model.config, getattr(self.model, "generation_config", None)):
            eos = getattr(cfg, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return frozenset(ids)

    # -- public API -------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]

        def resolver(fut: asyncio.Future) -> Callback:
            def done(res: GenResult | BaseException) -> None:
                try:
                    loop.call_soon_threadsafe(self._answered, fut, res)
                except RuntimeError:
                    # the caller's event loop is closed (its generator was killed mid-request and a new
                    # one runs on a new loop): nobody awaits this answer, but it must neither raise into
                    # the engine thread (that would end it, and hang every later caller) nor stay counted
                    self._answered(fut, res)

            return done

        seqs = self.submit(requests, [resolver(f) for f in futures])
        with self._open_lock:
            self._open += len(requests)
        for f, seq in zip(futures, seqs):  # a caller that gives up frees the sequence's row
            f.add_done_callback(lambda f, seq=seq: _drop_if_cancelled(f, seq))
        return list(await asyncio.gather(*futures))

    def _answered(self, fut: asyncio.Future, res: GenResult | BaseException) -> None:
        # on the caller's loop thread (or the engine thread when that loop is gone), hence the lock;
        # when the engine thread answers, not when the caller gives up (a cancelled request holds its
        # row until the engine's next step)
        with self._open_lock:
            self._open -= 1
        if not fut.get_loop().is_closed():
            _settle(fut, res)

    def requests_in_flight(self) -> int:
        """Requests generate() submitted and not yet answered (each counted until its own answer)."""
        return self._open

    def submit(self, requests: list[GenRequest], callbacks: list[Callback]) -> list[_Seq]:
        """Queue requests; each callback is called (from the engine thread) with its result or error.
        Returns their sequences (set `cancelled` on one to drop it)."""
        seqs = []
        for req, cb in zip(requests, callbacks):
            p = req.params
            if not req.prompt_ids:
                raise ValueError(f"request {req.rid!r} has an empty prompt")
            stop = frozenset() if p.ignore_eos else frozenset(p.stop_token_ids or self.eos_ids)
            stop_text = StopStrings(p.stop, self.tokenizer()) if p.stop and not p.ignore_eos else None
            seqs.append(_Seq(req=req, done=cb, stop=stop, stop_text=stop_text))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed; create a new one to generate")
            self._pending.extend(seqs)
            self._cond.notify_all()
        return seqs

    def tokenizer(self):
        """The model folder's tokenizer, for stop strings: loaded once, in the caller's thread (never
        the engine thread's decode loop)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from stages.models import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_path)
            return self._tokenizer

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # materialise in the caller's thread: the iterable may be a generator reading from a transport
        upd = _Update(tensors=[(n, t.detach()) for n, t in named_tensors], version=int(version))
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            self._apply_update(upd)
        else:
            with self._cond:
                self._updates.append(upd)
                self._cond.notify_all()
            upd.applied.wait()
        if upd.error is not None:
            raise upd.error

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the loop; in-flight and queued requests finish with finish_reason "abort"."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def stats(self) -> dict:
        with self._cond:
            out = dict(self._stats)
            out.update(version=self._version, running=len(self._batch.seqs) if self._batch else 0)
            out.update(queued=len(self._pending))
        return out

    # -- the decode loop (engine thread only) -----------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            t0 = time.perf_counter()
            with self._cond:
                while (
                    not self._closed
                    and not self._updates
                    and not (self._memops and self._batch is None)
                    and (self._paused or not self._has_work())
                ):
                    self._cond.wait()
                updates, self._updates = self._updates, []
                memops, self._memops = (self._memops, []) if self._batch is None else ([], self._memops)
                closed, paused = self._closed, self._paused
            self._stats["idle_s"] += time.perf_counter() - t0
            for upd in updates:
                self._apply_update(upd)
            for op in memops:
                self._apply_memop(op)
            if closed:
                self._abort_all()
                return
            if paused:
                continue
            t0 = time.perf_counter()
            try:
                # a prefill samples one token, so it counts as one of the chunk's steps: a sequence
                # alone in the engine then sees version changes exactly every chunk_tokens tokens
                steps = self.chunk_tokens - self._admit()
                for _ in range(steps):
                    if self._batch is None:
                        break
                    self._decode_step()
            except Exception as e:  # a failing step fails the requests in it, never the engine thread
                log.exception("torch engine step failed; failing %d in-flight requests", self._inflight())
                self._fail_batch(e)
            self._stats["busy_s"] += time.perf_counter() - t0

    def _has_work(self) -> bool:
        return (bool(self._pending) and not self._held) or self._batch is not None

    def _inflight(self) -> int:
        return len(self._batch.seqs) if self._batch else 0

    def _apply_update(self, upd: _Update) -> None:
        try:
            if WEIGHTS in self._released:  # the hand-over wakes the weights before it pushes
                raise RuntimeError(
                    f"weight update v{upd.version} while the engine's weights are released "
                    "(cluster.offload.rollout): resume_memory(['weights']) first"
                )
            params = checkpoint_names(self.model)
            tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
            unknown = [n for n, _ in upd.tensors if n not in params and not (tied and n == "lm_head.weight")]
            if unknown:
                raise KeyError(
                    f"weight update v{upd.version} names {len(unknown)} tensors the engine's model does "
                    f"not have (first: {unknown[:3]}); send HF parameter names of the same architecture"
                )
            for name, t in upd.tensors:
                dst = params.get(name)
                if dst is None:  # lm_head.weight of a tied model: it is the embedding, sent separately
                    continue
                if dst.shape != t.shape:
                    raise ValueError(
                        f"weight update: {name} has shape {tuple(t.shape)}, model has {tuple(dst.shape)}"
                    )
                dst.data.copy_(t.to(device=dst.device, dtype=dst.dtype))
            self._version = upd.version
            self._stats["updates"] += 1
        except Exception as e:
            upd.error = e
        finally:
            upd.applied.set()

    def _admit(self) -> int:
        """Prefill waiting requests into the batch; returns the number of engine steps taken (0/1)."""
        if self._held:  # offload: released, or a release waits for the running batch
            return 0
        room = self.max_batch_size - self._inflight()
        with self._cond:
            new = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
        for s in [s for s in new if s.cancelled or interrupted(s.req)]:  # ended while queued: never prefilled
            _deliver(s, _result(s, "abort"))
        new = [s for s in new if not (s.cancelled or interrupted(s.req))]
        if not new:
            return 0
        try:
            joined = self._prefill(new)
        except Exception as e:
            log.exception("torch engine prefill failed; failing %d requests", len(new))
            for s in new:
                _deliver(s, e)
            return 1
        self._batch = joined if self._batch is None else _merge(self._batch, joined)
        self._retire()
        return 1

    def _prefill(self, seqs: list[_Seq]) -> Batch:
        """Prefill the distinct prompts once, expand to one row per request, sample the first token."""
        uniq: dict[tuple[int, ...], int] = {}
        rows = [uniq.setdefault(tuple(s.req.prompt_ids), len(uniq)) for s in seqs]
        prompts = list(uniq)
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        if self._routers is not None:  # each prompt's positions (its left padding dropped)
            chosen = self._routers.take(ids.shape)
            for s, r in zip(seqs, rows):
                s.routed.append(chosen[r, width - len(s.req.prompt_ids) :])
        self._stats["prefill_tokens"] += int(mask.sum())
        index = torch.tensor(rows, device=self.device)
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv_pairs(out_cache(out))]
        logits = out.logits[:, -1, :].index_select(0, index)
        mask = mask.index_select(0, index)
        tokens = self._sample_into(seqs, logits)
        return Batch(seqs=seqs, cache=make_cache(kv), mask=mask, pos=mask.sum(-1), last=tokens)

    def _decode_step(self) -> None:
        b = self._batch
        mask = torch.cat([b.mask, torch.ones_like(b.mask[:, :1])], dim=1)
        out = self.model(
            input_ids=b.last[:, None],
            attention_mask=mask,
            position_ids=b.pos[:, None],
            use_cache=True,
            **{self._cache_arg: b.cache},
        )
        b.cache, b.mask, b.pos = out_cache(out), mask, b.pos + 1
        if self._routers is not None:  # the position of each row's last sampled token
            chosen = self._routers.take(b.last[:, None].shape)
            for i, s in enumerate(b.seqs):
                s.routed.append(chosen[i])
        b.last = self._sample_into(b.seqs, out.logits[:, -1, :])
        self._stats["steps"] += 1
        self._retire()

    def _sample_into(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        temps = torch.tensor([s.req.params.temperature for s in seqs], device=self.device)
        top_p = torch.tensor([s.req.params.top_p for s in seqs], device=self.device)
        top_k = torch.tensor([s.req.params.top_k for s in seqs], device=self.device)
        seeds = [s.req.params.seed for s in seqs]  # SamplingParams.seed: the draw depends on it alone
        positions = [len(s.req.prompt_ids) + len(s.out) for s in seqs]  # the sampled token's position
        tokens, logps = sample(logits, temps, top_p, self._gen, top_k, seeds=seeds, positions=positions)
        version = self._version
        for s, tok, lp in zip(seqs, tokens.tolist(), logps.tolist()):
            s.out.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
        self._stats["tokens"] += len(seqs)
        return tokens

    def _retire(self) -> None:
        """Hand back finished rows and drop them (and all-padding columns) from the batch."""
        b = self._batch
        keep: list[int] = []
        for i, s in enumerate(b.seqs):
            reason = self._finish_reason(s, int(b.pos[i]))
            if reason:
                _deliver(s, _result(s, reason))
            else:
                keep.append(i)
        if len(keep) == len(b.seqs):
            return
        if not keep:
            self._batch = None
            return
        idx = torch.tensor(keep, device=self.device)
        mask = b.mask.index_select(0, idx)
        first = int((mask.sum(0) > 0).nonzero()[0])  # leading columns that are padding in every row
        kv = [
            (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
            for k, v in kv_pairs(b.cache)
        ]
        b.cache = make_cache(kv)
        b.mask, b.pos, b.last = mask[:, first:], b.pos.index_select(0, idx), b.last.index_select(0, idx)
        b.seqs = [b.seqs[i] for i in keep]

    def _finish_reason(self, s: _Seq, next_pos: int) -> str:
        if s.cancelled or interrupted(s.req):
            return "abort"
        if s.out and s.out[-1] in s.stop:
            return "stop"
        if s.stop_text is not None and s.out:
            s.matched = s.stop_text.match(s.out)
            if s.matched is not None:
                return "stop"
        if len(s.out) >= s.req.params.max_new_tokens or next_pos >= self.max_positions:
            return "length"
        return ""

    def _fail_batch(self, err: BaseException) -> None:
        b, self._batch = self._batch, None
        for s in b.seqs if b else []:
            _deliver(s, err)

    def _abort_all(self) -> None:
        with self._cond:
            queued, self._pending = list(self._pending), deque()
        running = self._batch.seqs if self._batch else []
        self._batch = None
        for s in running + queued:
            _deliver(s, _result(s, "abort"))


# ---------------------------------------------------------------------------------------------------
def _deliver(s: _Seq, res: GenResult | BaseException) -> None:
    """Hand a sequence its answer; a callback that raises loses its own answer, never the engine thread
    (every later request would wait on a thread that is gone)."""
    try:
        s.done(res)
    except Exception:
        log.exception("torch engine: the callback of request %r raised; its answer is dropped", s.req.rid)


def _drop_if_cancelled(fut: asyncio.Future, seq: _Seq) -> None:
    if fut.cancelled():
        seq.cancelled = True  # read by the engine thread at its next step


def _settle(fut: asyncio.Future, res: GenResult | BaseException) -> None:
    if fut.done():  # the awaiting task was cancelled
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)


def _result(s: _Seq, reason: str) -> GenResult:
    return GenResult(
        rid=s.req.rid,
        response_ids=list(s.out),
        logprobs=list(s.logprobs),
        versions=list(s.versions),
        finish_reason=reason,
        meta={"stop_string": s.matched} if s.matched is not None else {},
        # prompt + response - 1 positions: the last sampled token was never fed back
        routed_experts=torch.cat(s.routed).flatten(1).to(torch.int16).numpy() if s.routed else None,
    )
