"""GPU weight transports into SGLang HTTP servers (`python -m sglang.launch_server`), SGLang 0.5.17.

Both follow the same push sequence per server, on a background thread (push), or on the caller's for
a lazy source of tensors gathered from the trainer's live weights while training waits (push_now,
weights.snapshot=direct: nothing is copied, and nothing kept for catch_up):
  POST /pause_generation {mode}            in_place keeps running requests (then flush_cache=false)
  per bucket: the transport-specific update (below); the last one carries weight_version, which
              the server sets once that load succeeded, so outputs report the trainer's version (no
              separate /update_weight_version round trip, and never on partly loaded weights)
  POST /continue_generation
and raise WeightPushError naming the server and the step on any failure or timeout. A failed pause
resumes the servers; a failed load leaves them paused (see `_push`). HTTP connections are kept alive
(one session per thread); pause and continue are retried once on a connection error.

A server that cannot be reached at all (connection refused: it died, and the generator's engine watch
is relaunching it) is left out of a push for up to `restart_grace_s` from the first push that missed
it. The relaunched server starts from the weights its engine object holds (often the base model: a
pushed-to server keeps no copy), so the sender keeps the last push's tensors while a server is behind,
and `catch_up()` sends them to it once it answers (the trainer calls it while it waits for data: with
one engine, no fresh data comes before that). A server relaunched between two pushes was missed by
none, and nothing is kept for it (a GPU snapshot held through a training step would cost its memory):
`needs_push()` finds it by its older weight_version on /model_info (asked at most every
VERSION_PROBE_S, counted once /health answers; the trainer asks after a wait for data came back empty),
and the trainer then pushes its current weights again. The next regular push reaches it too. Its
tokens carry the versions that made them, so staleness stays exact. Past the grace a push fails naming
the server. A server killed during a push's load is treated as one found down at its pause: the push
ends without it and catch_up() serves its relaunch. A server that outlived another's death mid-push
holds partly loaded weights: it stays paused, and needs_push() names it at once, so the trainer pushes
it the current weights (without an engine watch, restart_grace_s 0, that push fails, named, as any
failed load does).

NcclSGLangSender (disaggregated: trainer and engines on different GPUs). The trainer rank 0 is rank
0 of a dedicated NCCL group; server i joins with rank_offset = 1 + (sum of earlier servers' TP sizes)
via POST /init_weights_update_group, while the trainer joins with SGLang's own
`init_custom_process_group` (the two must rendezvous at the same time, hence the threads). Each bucket
is POST /update_weights_from_distributed {names, dtypes, shapes} while rank 0 broadcasts each tensor of
the bucket in that order (weights.nccl_receive=per_tensor: the server receives each into a tensor of its
own and loads them), or with load_format: flattened_bucket while rank 0 broadcasts the bucket as one
flat byte tensor (flat: one NCCL call per bucket, which SGLang 0.5.17 copies once more). auto (the
default) takes per_tensor for buckets of large tensors (a 7B model's: 1.2x faster than flat) and flat
for small ones (a 135M model's, where the NCCL calls cost more than the copies). The group spans
exactly the servers a push reaches: when one is left out (restarting) or comes back, the sender forms a
new group (a new name) with the servers of this push before it loads anything (see `_regroup`); the old
group is dropped, not destroyed.
NCCL's broadcast to a server that died waits for it until the watchdog ends the process (the default
TORCH_NCCL_ASYNC_ERROR_HANDLING), so the group is made with the watchdog only reporting, and rank 0
watches its broadcast beside the servers' load calls: when one finds its server gone (or fails, or
weights.timeout_s passes) the group is aborted and the push ends as above: without the dead server, or
failing (`_broadcast`). The broadcast call runs on a thread of its own, since NCCL's first collective
on a new group sets up the communicator and blocks until every rank does.
NCCL cannot put two ranks on one GPU: this needs the engines on other GPUs (see notes/sglang-on-gpu.md).

CudaIpcSGLangSender (colocated on one GPU): each bucket is serialized with SGLang's
MultiprocessingSerializer (CUDA IPC handles, no copy) and sent as POST /update_weights_from_tensor.
The GPU tensors must stay alive until the server answered, which the push thread guarantees.

Neither can run on a CPU-only machine; they are exercised by the GPU session (tests marked `gpu`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import secrets
import threading
import time

import torch

from stages.weights import sglang_protocol as proto
from stages.weights.base import (
    PushHandle,
    WeightPushError,
    WeightSender,
    align_nccl_env,
    bucket_that_fits,
    buckets_marking_last,
    check_offset,
    pack_into,
)
from stages.weights.config import PER_TENSOR_MIN_MEAN_MB

log = logging.getLogger(__name__)

# how often needs_push() asks the servers which weights they run (a relaunch between pushes), and how long
# one may take to answer: one that does not is not back yet, and is asked again next time
VERSION_PROBE_S = 10.0
VERSION_PROBE_TIMEOUT_S = 2.0


class _SGLangSender(WeightSender):
    snapshot_device = "cuda"  # the trainer snapshots straight into GPU memory for these transports

    def __init__(
        self,
        urls: list[str],
        *,
        bucket_mb: int = 512,
        timeout_s: float = 120.0,
        pause_mode: str = "in_place",
        restart_grace_s: float = 0.0,
        engine_tp_sizes: list[int] | None = None,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError(f"{type(self).__name__} needs CUDA; on CPU use weights.transport=cpu")
        self.urls = [u.rstrip("/") for u in urls]
        self.tp_of = dict(zip(self.urls, engine_tp_sizes or [1] * len(self.urls), strict=True))
        # the push thread's CUDA calls go to the trainer's GPU (a new thread starts on device 0)
        self.device = torch.cuda.current_device() if torch.cuda.device_count() else None
        self.bucket_bytes = bucket_mb << 20
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-push")
        self._local = threading.local()  # one keep-alive HTTP session per thread
        self.restart_grace_s = restart_grace_s
        self._down_since: dict[str, float] = {}  # unreachable servers left out of pushes, since when
        self._last: tuple[int, list] | None = None  # (version, tensors) of the last push while one is behind
        self._pushed_version: int | None = None  # the version the last push set
        self._probed_at = float("-inf")  # when needs_push() last asked the servers their weight_version
        # paused mid-load when another server of the push died; never also in _down_since (a server
        # found down is dropped from it: its relaunch holds whole weights)
        self._partly_loaded: set[str] = set()
        self._warned_small_bucket = False  # _packed_bucket_bytes said so once
        # the push thread's own CUDA stream: on the default stream (shared by threads) its copies and
        # waits would queue behind the training kernels the trainer queued meanwhile, with every
        # server paused
        self._stream = torch.cuda.Stream(self.device) if self.device is not None else None

    def _session(self):
        session = getattr(self._local, "session", None)
        if session is None:
            import requests

            session = self._local.session = requests.Session()
        return session

    def _pause(self, url: str) -> None:
        self._post(url, proto.PAUSE, proto.pause_body(self.pause_mode), self.timeout_s, retry=True)

    def _resume(self, url: str) -> None:
        self._post(url, proto.CONTINUE, {}, self.timeout_s, retry=True)

    def _post(self, url: str, route: str, body: dict, timeout: float, *, retry: bool = False) -> dict:
        """POST a JSON body; `retry`: once more on a connection error (idempotent routes only: a kept-
        alive connection may have been closed by the server's keep-alive timeout just then)."""
        import requests

        session = self._session()
        try:
            try:
                r = session.post(url + route, json=body, timeout=timeout)
            except requests.ConnectionError:
                if not retry:
                    raise
                r = session.post(url + route, json=body, timeout=timeout)
        except requests.RequestException as e:
            err = WeightPushError(f"SGLang server {url}{route} unreachable: {e}")
            err.unreachable = isinstance(e, requests.ConnectionError)
            err.url = url  # a load that finds its server gone: see _gone
            raise err from e
        if r.status_code != 200:
            err = WeightPushError(f"SGLang server {url}{route} answered {r.status_code}: {r.text[:300]}")
            err.status = r.status_code
            raise err
        try:  # some routes answer plain text; only a JSON {"success": false} is a reported failure
            out = r.json() if r.content else {}
        except ValueError:
            out = {}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightPushError(f"SGLang server {url}{route} failed: {out.get('message')}")
        return out

    def push(self, version: int, named_tensors) -> PushHandle:
        named = list(named_tensors)
        fut = self._pool.submit(self._push_on_stream, self._written(), version, named)
        return PushHandle(version, fut, self.timeout_s, f"SGLang servers {self.urls}")

    def needs_push(self) -> list[str]:
        """Servers that need the current weights pushed: those left paused with partly loaded weights
        when another server of a push died (see `_left_out`), at once; and servers relaunched since the
        last push with older weights, which nothing kept is waiting for (no push missed them; or one
        did, but it was a lazy push, push_now, which keeps nothing). Call it with no push in flight;
        [] while a left-out server waits for catch_up (and none is partly loaded)."""
        partly = [url for url in self.urls if url in self._partly_loaded]
        if partly:
            return partly
        if self._pushed_version is None or (self._down_since and self._last is not None):
            return []
        return self._relaunched_behind(self._pushed_version)

    def push_now(self, version: int, named, expect_bytes: int | None = None) -> dict:
        """A push on the calling thread, returned when done (weights.snapshot=direct): `named` is a
        lazy iterator of tensors gathered from the trainer's live weights one at a time, each step of
        which may be a collective of every trainer rank. It is consumed to the end even when the push
        fails or loads nothing, so that the other ranks, gathering in step, are not left in a gather.
        Nothing is kept for catch_up(): a server left out is found by needs_push() once it answers.
        `expect_bytes`: about how many bytes `named` holds in all, at most (sizes the bucket buffer)."""
        it = iter(named)
        try:
            res = self._push_on_stream(
                self._written(), version, it, None, None, keep=False, expect_bytes=expect_bytes
            )
            if self._stream is not None:  # training writes the weights next: after the push read them
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            return res
        finally:
            for _ in it:
                pass

    def catch_up(self) -> PushHandle | None:
        """The last push again, to the servers it left out and those it left partly loaded; None when
        none is behind (or nothing was kept: a lazy push's are named by needs_push())."""
        behind, last = [*self._down_since, *sorted(self._partly_loaded)], self._last
        if not behind or last is None:
            return None
        fut = self._pool.submit(
            self._push_on_stream, None, last[0], last[1], self._catch_up_targets(behind), behind
        )
        return PushHandle(last[0], fut, self.timeout_s, f"SGLang servers {behind} (catch-up)")

    def _catch_up_targets(self, behind: list[str]) -> list[str] | None:
        """Which servers a catch-up push goes to (None: all): just the ones behind."""
        return behind

    def _relaunched_behind(self, version: int) -> list[str]:
        """The servers that run older weights than `version` (the last push's) although no push missed
        them: the engine watch relaunched them between two pushes from the weights their engine holds,
        often the base model's. Asked at most every VERSION_PROBE_S; a server that does not answer in
        VERSION_PROBE_TIMEOUT_S is not back yet and is not counted."""
        now = time.monotonic()
        if now - self._probed_at < VERSION_PROBE_S:
            return []
        self._probed_at = now

        import requests

        def behind(url: str) -> bool:
            try:
                reported = self._model_version(url, VERSION_PROBE_TIMEOUT_S) or ""
                # and up: a server still starting may answer a pause with 5xx, which fails a push
                return (
                    reported.isdigit()
                    and int(reported) < version
                    and requests.get(url + proto.HEALTH, timeout=VERSION_PROBE_TIMEOUT_S).status_code == 200
                )
            except (WeightPushError, requests.RequestException):
                return False  # not back yet: asked again next time

        with cf.ThreadPoolExecutor(len(self.urls), thread_name_prefix="weights-probe") as probe:
            return [url for url, late in zip(self.urls, probe.map(behind, self.urls)) if late]

    def _model_version(self, url: str, timeout_s: float) -> str | None:
        """The weight_version `url` reports on /model_info (None: it reports none). A plain GET: the
        probe asks from threads that live for one probe (no keep-alive session to leave behind)."""
        import requests

        try:
            info = requests.get(url + proto.MODEL_INFO, timeout=timeout_s).json()
        except (requests.RequestException, ValueError) as e:
            raise WeightPushError(f"SGLang server {url}{proto.MODEL_INFO} unreachable: {e}") from e
        v = info.get("weight_version") if isinstance(info, dict) else None
        return None if v is None else str(v)

    def _regroup(self, live: list[str]) -> None:
        """Called with the servers of this push, all paused, before anything is loaded: a transport
        whose delivery spans a fixed set of servers makes that set `live` here."""

    def _written(self):
        """A CUDA event after what the caller's stream has queued so far (the snapshot's copies, or the
        optimizer's writes that a direct push reads), for the push's stream to wait on; None without one."""
        if self._stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def _push_on_stream(self, ready, *args, **kw) -> dict:
        """_push on the push thread's stream, after the snapshot (`ready`, a CUDA event) is written."""
        if self._stream is None:
            return self._push(*args, **kw)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            return self._push(*args, **kw)

    def _push(
        self,
        version: int,
        named,
        targets: list[str] | None = None,
        behind: list[str] | None = None,
        *,
        keep: bool = True,
        expect_bytes: int | None = None,
    ) -> dict:
        """One push; returns its phase times (s). Generation stands still for all of it: `seconds` is
        also the pause. Only the last bucket's load carries `weight_version` (SGLang records it after
        each successful load): a push that fails part-way never labels mixed weights as `version`.
        After such a failure the servers stay paused (generating from partly loaded weights would
        produce samples of no version) and the error says to restart them. `behind`: a catch-up for
        these servers, which loads nothing while none of them answers. `keep`: `named` is a list that
        may be kept for catch_up() (not a lazy iterator); else its tensors are packed into a bucket buffer
        as they come, of about `expect_bytes` when that is less than a bucket."""
        if self.device is not None:
            torch.cuda.set_device(self.device)
        t = {"pause_s": 0.0, "load_s": 0.0, "transfer_s": 0.0, "continue_s": 0.0}
        t0 = time.monotonic()
        live: list[str] = []
        urls = self.urls if targets is None else targets
        try:
            for url in urls:
                try:
                    self._pause(url)
                except WeightPushError as e:
                    self._skip_or_raise(url, e)
                    continue
                self._down_since.pop(url, None)
                live.append(url)
            if behind is not None and not set(live) & set(behind):  # still down: nothing to catch up
                for url in live:
                    self._resume(url)
                return {
                    "version": version,
                    "engines": 0,
                    "engines_skipped": len(behind),
                    "bytes": 0,
                    "seconds": time.monotonic() - t0,
                    **t,
                }
            self._regroup(live)
        except WeightPushError:
            self._resume_all()  # nothing was loaded: let generation go on, then fail this push
            raise
        t["pause_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        nbytes = 0
        try:
            # nobody to load into: a lazy `named` is left to its caller to drain (push_now). Its tensors
            # are packed into the bucket's buffer as they come (they are gathered for this push alone)
            pack_on = None if keep else self._bucket_device()
            buckets = buckets_marking_last(
                named, self._packed_bucket_bytes(pack_on), pack_on=pack_on, expect_bytes=expect_bytes
            )
            for group, last in buckets if live else ():
                nbytes += sum(x.numel() * x.element_size() for _, x in group)
                t["transfer_s"] += self._send_bucket(group, version if last else None, live)
                del group  # a lazy source gathers the next bucket now: one bucket of tensors at a time
        except WeightPushError as e:
            if not self._left_out(e, live):
                raise WeightPushError(
                    f"{e}; the SGLang servers {self.urls} are left paused with partly loaded weights: "
                    "restart them (or the run) before generating again"
                ) from e
            live = []  # the dead are gone and the partly loaded stay paused: nothing to resume
        except Exception as e:
            # not the servers': a lazy source's gather, the bucket's memory; say what is left
            raise WeightPushError(
                f"weights: the push of version {version} failed mid-way ({type(e).__name__}: {e}); the SGLang "
                f"servers {self.urls} are left paused with partly loaded weights: restart them (or the run)"
            ) from e
        t["load_s"] = time.monotonic() - t1
        t3 = time.monotonic()
        failed = []
        for url in live:  # every server that was loaded generates again, even if one cannot
            try:
                self._resume(url)
            except WeightPushError as e:
                failed.append(e)
        if failed:
            raise failed[0]
        t["continue_s"] = time.monotonic() - t3
        self._partly_loaded.difference_update(live)  # whole weights again
        # while a server is behind, keep these tensors for catch_up(); let them go once none is. A
        # lazy push (push_now) has none to keep: needs_push() finds such a server once it is back
        self._last = (version, named) if self._down_since and keep else None
        self._pushed_version = version
        return {
            "version": version,
            "engines": len(live),
            "engines_skipped": len(urls) - len(live),
            "bytes": nbytes,
            "seconds": time.monotonic() - t0,
            **t,
        }

    def _skip_or_raise(self, url: str, err: WeightPushError) -> None:
        """Leave an unreachable server out of this push while it may be restarting (restart_grace_s);
        re-raise anything else, and an outage longer than the grace."""
        # refused connections, and a server already missed that answers 5xx while it starts up again
        restarting = getattr(err, "unreachable", False) or (
            url in self._down_since and getattr(err, "status", 0) >= 500
        )
        if not (self.restart_grace_s > 0 and restarting):
            raise err
        now = time.monotonic()
        down = now - self._down_since.setdefault(url, now)
        self._partly_loaded.discard(url)  # its relaunch holds whole weights (the base model's)
        if down > self.restart_grace_s:
            raise WeightPushError(
                f"{err}; it has been unreachable for {down:.0f}s, longer than the {self.restart_grace_s:.0f}s "
                "a restart may take (rollout.sglang.startup_timeout_s + 2 x health_check_s): it is not coming back"
            ) from err
        log.warning("weights: %s unreachable for %.0fs (restarting?): left out of this push", url, down)

    def _left_out(self, err: WeightPushError, live: list[str]) -> bool:
        """Whether `err` is the death of servers of this push during its load (killed mid-push, or hung
        and relaunched by its engine watch, which does so within restart_grace_s). The dead are left
        out as if found down at the pause, and catch_up() gives each the weights once it is back. The
        ones that lived through it hold partly loaded weights: they stay paused (what they generated
        would be of no version) and needs_push() names them, so the trainer pushes them its current
        weights. A 7B run of 2026-11-27 failed here: one server hung in a load, the watch relaunched
        it, and the other, partly loaded, ended the push and the trainer."""
        lost = _gone(err)
        if not (lost and self.restart_grace_s > 0):
            return False
        now = time.monotonic()
        for url in lost:
            self._down_since.setdefault(url, now)
            self._partly_loaded.discard(url)
        survivors = [url for url in live if url not in lost]
        self._partly_loaded.update(survivors)
        log.warning(
            "weights: %s died during the push of this version (%s): left out until it is back%s",
            lost,
            err,
            f"; {survivors} stay paused with partly loaded weights until the next push" if survivors else "",
        )
        self._abort_group()
        return True

    def _abort_group(self) -> None:
        """A transport whose delivery spans a fixed set of servers ends it here (a member died)."""

    def _resume_all(self) -> None:
        """Resume every server after a push that loaded nothing; one partly loaded by an earlier push
        stays paused (its weights are of no version)."""
        for url in self.urls:
            if url in self._partly_loaded:
                continue
            try:
                self._resume(url)
            except WeightPushError as e:
                log.warning("weights: could not resume %s after a failed pause: %s", url, e)

    @property
    def flush_cache(self) -> bool:
        return self.pause_mode != "in_place"  # flushing with requests kept in place asserts in SGLang

    def _bucket_device(self) -> torch.device:
        """Where a bucket is assembled to be sent: the trainer's GPU."""
        return torch.device("cuda", self.device) if self.device is not None else torch.device("cpu")

    def _packed_bucket_bytes(self, pack_on: torch.device | None) -> int:
        """The bucket of a push packed on the trainer's GPU (weights.snapshot=direct), beside the whole
        training state: weights.bucket_mb, or less where that GPU has not twice that free (memory the
        caching allocator holds unused counts as free)."""
        if pack_on is None or pack_on.type != "cuda":
            return self.bucket_bytes
        free, _ = torch.cuda.mem_get_info(pack_on)
        free += torch.cuda.memory_reserved(pack_on) - torch.cuda.memory_allocated(pack_on)
        fits = bucket_that_fits(self.bucket_bytes, free)
        if fits < self.bucket_bytes and not self._warned_small_bucket:
            self._warned_small_bucket = True
            log.warning(
                "weights: the direct push packs %d MB buckets, not weights.bucket_mb=%d: the trainer's GPU has "
                "%.1f GiB free beside training (more buckets, more load calls per push)",
                fits >> 20,
                self.bucket_bytes >> 20,
                free / 2**30,
            )
        return fits

    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        """Deliver one bucket to `urls` (`version`: set it on the servers once loaded, or None); returns
        the seconds spent moving the bytes themselves."""
        raise NotImplementedError

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def check_flat_layout(group) -> None:
    """SGLang's FlattenedTensorBucket lays tensors back to back as bytes and the server views each
    slice as its dtype (see check_offset): checked before anything is sent."""
    offset = 0
    for name, x in group:
        check_offset(name, x, offset)
        offset += x.numel() * x.element_size()


def _within(fut: cf.Future, timeout_s: float, url: str):
    """A per-server call's result; a timeout is a WeightPushError naming the server, as failures are
    (the push's error handling resumes or leaves paused by that type)."""
    try:
        return fut.result(timeout=timeout_s)
    except cf.TimeoutError:
        raise WeightPushError(f"SGLang server {url} did not answer within {timeout_s:.0f}s") from None


def _lost(urls: list[str], cause: BaseException | None) -> WeightPushError:
    """The error of a push during which `urls` died (`.lost`: see _gone)."""
    err = WeightPushError(f"SGLang server(s) {urls} went away during the push: {cause}")
    err.lost = list(urls)
    return err


def _gone(err: BaseException | None) -> list[str]:
    """The servers `err` says died: those of a broadcast's `_lost`, or the one a call (`_post`) could
    not reach."""
    if getattr(err, "unreachable", False):
        return [err.url]
    return list(getattr(err, "lost", []))


def unreachable(calls: dict[str, cf.Future]) -> list[str]:
    """The servers whose finished call failed because the server could not be reached (it died)."""
    return [url for url, c in calls.items() if c.done() and getattr(c.exception(), "unreachable", False)]


def _in_thread(fn, *args) -> cf.Future:
    """fn(*args) on a daemon thread of its own, as a future: a call that may never return is waited for
    with a timeout, and left behind if it must be (a pool's worker would be lost with it)."""
    fut: cf.Future = cf.Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name="weights-broadcast", daemon=True).start()
    return fut


def await_broadcast(started: cf.Future, calls: dict[str, cf.Future], deadline: float) -> list[str]:
    """Wait for a broadcast (`started`: the future of its call, whose result is its work) while the
    servers' `calls` run beside it: [] once it completed, the servers found gone as soon as one call
    finds its server so (their receive will never finish), a call's own error (or the broadcast
    call's) as soon as one fails otherwise, and WeightPushError at `deadline` (monotonic) naming the
    servers still receiving."""
    t0 = time.monotonic()
    while not (started.done() and started.result().is_completed()):
        dead = unreachable(calls)
        if dead:
            return dead
        failed = [c.exception() for c in calls.values() if c.done() and c.exception() is not None]
        if failed:  # a server that answered an error is out of its receive: the broadcast cannot finish
            raise failed[0]
        if time.monotonic() > deadline:
            waiting = [url for url, c in calls.items() if not c.done()]
            raise WeightPushError(
                f"weights: the broadcast of a bucket did not finish within weights.timeout_s "
                f"({deadline - t0:.0f}s); servers still receiving: {waiting}"
            )
        # a bucket takes milliseconds to a tenth of a second: poll finely at first
        time.sleep(0.0005 if time.monotonic() - t0 < 1.0 else 0.01)
    return []


@contextlib.contextmanager
def _env(**values: str):
    """These environment variables set for the block, then as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flat_bucket(group, device) -> torch.Tensor:
    """The bucket as one uint8 tensor on `device` in SGLang's flattened_bucket layout (each tensor's
    bytes back to back, in order): a packed bucket's own (buckets_marking_last), else filled tensor by
    tensor: one buffer of the bucket's size, where building it from per-tensor device copies would
    take two (host snapshots at 7B)."""
    packed = getattr(group, "flat", None)
    if packed is not None and packed.device == torch.device(device):
        return packed
    flat = torch.empty(sum(x.numel() * x.element_size() for _, x in group), dtype=torch.uint8, device=device)
    offset = 0
    for name, x in group:
        pack_into(flat, offset, name, x)
        offset += x.numel() * x.element_size()
    return flat


def per_tensor_for(receive: str, group) -> bool:
    """Whether a bucket goes out one broadcast per tensor (weights.nccl_receive): auto says so where its
    tensors average PER_TENSOR_MIN_MEAN_MB or more, where one more NCCL call costs less than the flat
    receive's copies of the same bytes."""
    if receive != "auto":
        return receive == "per_tensor"
    total = sum(x.numel() * x.element_size() for _, x in group)
    return total >= len(group) * (PER_TENSOR_MIN_MEAN_MB << 20)


def tensors_on(group, device) -> list[torch.Tensor]:
    """The bucket's tensors, in order, each contiguous on `device`: what the per-tensor receive
    broadcasts one by one. Nothing is copied that is there already: a packed bucket's views of its flat
    buffer (weights.snapshot=direct), a GPU snapshot's tensors; a host snapshot's come over one by one."""
    device = torch.device(device)
    # non_blocking: a host snapshot is pinned; the broadcast waits for this stream first (_broadcast)
    return [
        x if x.device == device and x.is_contiguous() else x.to(device, non_blocking=True).contiguous()
        for _, x in group
    ]


class _AllWork:
    """Several async collectives' works as one: completed when every one is (gloo may run them on
    threads of its own, so the last one's completion says nothing of the others)."""

    def __init__(self, works: list):
        self.works = works
        self._done = 0  # works[:_done] are known complete: a poll does not ask them again

    def is_completed(self) -> bool:
        while self._done < len(self.works) and self.works[self._done].is_completed():
            self._done += 1
        return self._done == len(self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class NcclSGLangSender(_SGLangSender):
    def __init__(
        self,
        urls,
        *,
        master_address: str = "127.0.0.1",
        group_name: str = "slipstream-weights",
        receive: str = "auto",
        **kw,
    ):
        super().__init__(urls, **kw)
        # weights.nccl_receive. per_tensor: each tensor of a bucket is its own broadcast, which the
        # server receives straight into a tensor of that shape and loads (SGLang's receive without
        # load_format); flat: one broadcast of the whole bucket, which SGLang 0.5.17 copies once more;
        # auto: by the bucket's mean tensor size (per_tensor_for)
        if receive not in ("auto", "flat", "per_tensor"):
            raise ValueError(f"weights.nccl_receive={receive!r}: choose one of auto, flat, per_tensor")
        self.receive = receive
        self.master_address = master_address
        self.group_name = group_name
        # every group this sender tries gets a new name: a server keeps each name it joined (a failed
        # attempt's too, and an earlier trainer's, whose sender started from the same group_name)
        self._name_base = f"{group_name}-{secrets.token_hex(3)}"
        self.group_names: list[str] = []
        self._group = None
        self._members: list[str] = []  # the servers in self._group, in rank order
        self._version_at: dict[str, str] = {}  # the version the last push set on each server
        # long-lived threads for the per-server calls that run beside the broadcast: their keep-alive
        # sessions persist from push to push
        self._http = cf.ThreadPoolExecutor(len(self.urls), thread_name_prefix="weights-http")
        self._rank0 = cf.ThreadPoolExecutor(1, thread_name_prefix="weights-rendezvous")
        # no group yet: the first push forms it (_regroup), with the servers it reaches, while they
        # generate (a server paused for a push may not serve the join request)

    def _join(self, urls: list[str]) -> None:
        """Form a trainer<->engines NCCL group with `urls` (every one of them and rank 0 rendezvous
        together). Each group gets a new name: a server that was in an earlier one still holds it."""
        from buffer.net import free_port

        align_nccl_env()  # no-op after init_distributed; a standalone sender needs it before its group
        name = f"{self._name_base}-{len(self.group_names)}"
        self.group_names.append(name)
        port = free_port()
        sizes = [self.tp_of[u] for u in urls]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        joins = [
            self._http.submit(
                self._post,
                url,
                proto.JOIN_GROUP,
                proto.join_group_body(self.master_address, port, off, world, name, "nccl"),
                self.timeout_s,
            )
            for url, off in zip(urls, offsets)
        ]
        forming = self._rank0.submit(self._new_group, f"tcp://{self.master_address}:{port}", world, name)
        # a server that refuses to join would leave rank 0 waiting in the rendezvous: fail at its answer
        cf.wait([forming, *joins], timeout=self.timeout_s, return_when=cf.FIRST_EXCEPTION)
        for url, j in zip(urls, joins):
            if j.done() and j.exception() is not None:
                raise WeightPushError(f"weights: {url} did not join NCCL group {name}: {j.exception()}")
        if forming.done() and forming.exception() is not None:
            raise WeightPushError(f"weights: NCCL group {name} did not form: {forming.exception()}")
        if not all(f.done() for f in (forming, *joins)):
            raise WeightPushError(
                f"weights: NCCL group {name} with {urls} did not form within {self.timeout_s:.0f}s "
                f"(weights.timeout_s); is {self.master_address}:{port} reachable from the servers?"
            )
        self._group = forming.result()
        self._members, self._group_name = list(urls), name
        log.info("weights: NCCL group %s formed with %d engine ranks (%s)", name, world - 1, ", ".join(urls))

    def _new_group(self, init_method: str, world: int, name: str):
        """Rank 0 of a new group (SGLang's own helper, as the servers use); its rendezvous gives up
        after weights.timeout_s (SGLang's default is 30 minutes)."""
        from datetime import timedelta

        from sglang.srt.utils import init_custom_process_group

        # the watchdog of this group only reports: by default it ends the whole trainer process when a
        # collective times out, and a server killed mid-push makes one; the push aborts the group
        # itself instead (_broadcast). Read when the group is made, so set only around that
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
            return init_custom_process_group(
                backend="nccl",
                init_method=init_method,
                world_size=world,
                rank=0,
                group_name=name,
                # past the push's own deadline (weights.timeout_s), at which it aborts the group itself
                timeout=timedelta(seconds=2 * self.timeout_s),
            )

    def _catch_up_targets(self, behind: list[str]) -> list[str] | None:
        # every server: the group is re-formed once with all of them, not once for the server that
        # came back and again at the next regular push (the others get the version they hold)
        return None

    def _regroup(self, live: list[str]) -> None:
        """Make the group exactly `live`: the first push, a server was left out, one came back, or one
        was relaunched since the last push (it reports another weight version than that push set, the
        base model's: a new process holds none of our groups, and a load naming one would fail inside
        it). The servers are paused; a join is only asked of generating servers, so they go on
        generating while the new group forms and are paused again. That includes a server partly
        loaded when another died mid-push (`_left_out`), healed by this push: for the seconds of the
        join it generates from those weights, its tokens labeled with the older version it reports
        and carrying the logprobs of the weights it ran, which TIS weighs them by. The old group is
        dropped, not destroyed: destroying a communicator whose peer died can block, here and in the
        servers."""
        if not live:  # every server is down: no group holds, the one that comes back forms a new one
            self._group, self._members = None, []
            return
        if live == self._members and not self._relaunched(live):
            return
        for url in live:
            self._resume(url)
        log.warning("weights: the servers changed (%s -> %s): forming a new NCCL group", self._members, live)
        self._group, self._members = None, []  # a failed join leaves no group to broadcast to
        self._join(live)
        for url in live:
            self._pause(url)

    def _relaunched(self, urls: list[str]) -> list[str]:
        """The servers that report another weight version than the last push set on them."""
        known = [u for u in urls if u in self._version_at]
        answers = [self._http.submit(self._model_version, u, self.timeout_s) for u in known]
        return [u for u, a in zip(known, answers) if _within(a, self.timeout_s, u) != self._version_at[u]]

    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        if urls != self._members:  # _regroup made them equal; anything else would hang the broadcast
            raise WeightPushError(f"weights: NCCL group {self._members} is not this push's servers {urls}")
        per_tensor = per_tensor_for(self.receive, group)
        if not per_tensor:  # only a flat bucket lays tensors of several dtypes back to back
            check_flat_layout(group)
        body = proto.distributed_body(
            *proto.describe(group),
            self._group_name,
            flat=not per_tensor,
            flush_cache=self.flush_cache,
            version=version,
        )
        # built before any server is asked to receive: a failure here leaves them paused, not waiting
        # in a receive that never comes
        device = self._bucket_device()
        parts = tensors_on(group, device) if per_tensor else [flat_bucket(group, device)]
        calls = {
            url: self._http.submit(self._post, url, proto.LOAD_DISTRIBUTED, body, self.timeout_s)
            for url in urls
        }
        moved = self._broadcast(parts, calls)  # the servers wait in their receive meanwhile
        for url, c in calls.items():
            _within(c, self.timeout_s, url)  # one that received, then died in its load: _gone
        if version is not None:
            self._version_at.update({url: str(version) for url in urls})
        return moved

    def _broadcast(self, parts: list[torch.Tensor], calls: dict[str, cf.Future]) -> float:
        """Rank 0's broadcast of one bucket (`parts`: the flat bucket, or each of its tensors in order)
        while the servers' load `calls` run; returns its seconds (the floor of any push). A server that
        dies meanwhile would leave NCCL waiting for it until its watchdog ends the trainer's process (a
        2-GPU kill test did): the broadcast is watched beside the calls, and the group aborted when one
        of them finds its server gone, or at weights.timeout_s."""
        # this stream only (the push thread's): the bucket is written; NCCL's stream waits on it, and
        # after the call this stream waits on NCCL's. (A CPU group in the tests has no stream.)
        on_gpu = parts[0].is_cuda
        sync = torch.cuda.current_stream().synchronize if on_gpu else (lambda: None)
        sync()
        t0 = time.monotonic()
        try:
            # NCCL sets up a new group's communicator in its first collective, blocking until every rank
            # does: a server that died after joining would hold this thread there for good. Started on
            # a thread of its own, the call is waited for like the broadcast, and left behind if it must
            stream = torch.cuda.current_stream() if on_gpu else None
            started = _in_thread(self._start_broadcast, parts, stream)
            dead = await_broadcast(started, calls, t0 + self.timeout_s)
            if not dead:
                started.result().wait()  # raises what the backend saw (gloo: a peer that closed its socket)
        except Exception as e:
            # the calls say whether a server died (gloo fails the broadcast itself when one does)
            cf.wait(list(calls.values()), timeout=5.0)
            dead = unreachable(calls)
            if not dead:
                self._abort_group()
                if isinstance(e, WeightPushError):
                    raise
                raise WeightPushError(f"weights: the broadcast to {list(calls)} failed: {e}") from e
        if dead:
            self._abort_group()
            raise _lost(dead, calls[dead[0]].exception())
        sync()
        return time.monotonic() - t0

    def _start_broadcast(self, parts: list[torch.Tensor], stream) -> _AllWork:
        """Rank 0's broadcast calls, one per part in order (async: their works are returned), on the
        push's stream and device."""

        # the group as the push saw it: an abort (or a regroup) may set self._group while this thread
        # still issues calls, which must then stop, not go to no group (the trainer's default group) or
        # to the next push's
        group = self._group

        def start():
            works = []
            for x in parts:
                if self._group is not group:
                    raise WeightPushError("weights: the weight group was given up during its broadcast")
                works.append(torch.distributed.broadcast(x, src=0, group=group, async_op=True))
            return _AllWork(works)

        if stream is None:
            return start()
        torch.cuda.set_device(parts[0].device)
        with torch.cuda.stream(stream):
            return start()

    def _abort_group(self) -> None:
        """End the group's communicator, so that a broadcast no server will finish returns, and never use
        the group again (the next push forms a new one)."""
        group, name = self._group, getattr(self, "_group_name", None)
        self._group, self._members = None, []
        if group is None:
            return
        try:  # the group's own abort: ncclCommAbort, which does not wait for the dead peer
            group.abort()
        except Exception as e:  # noqa: BLE001 - a group that cannot abort is left to its own timeout
            log.warning("weights: could not abort the weight group %s: %s", name, e)

    def close(self) -> None:
        super().close()
        self._http.shutdown(wait=True)
        self._rank0.shutdown(wait=False)  # a rendezvous that failed ends at its own timeout


class CudaIpcSGLangSender(_SGLangSender):
    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        check_flat_layout(group)

        t0 = time.monotonic()
        dev = torch.device("cuda", torch.cuda.current_device())
        # a packed bucket (a direct push) is on this GPU, back to back in its flat buffer already. The
        # buffer is refilled by the next bucket once the server answered: SGLang copies the weights out
        # of the mapped memory in its load, before it answers
        tensors = (
            group
            if getattr(group, "flat", None) is not None
            else [(n, t.to(dev).contiguous()) for n, t in group]
        )
        for url in urls:
            body, flat = proto.ipc_bucket_body(
                tensors, self.tp_of[url], dev
            )  # alive until the server answered
            self._post(url, proto.LOAD_TENSOR, proto.with_version(body, version), self.timeout_s)
            del flat
        return time.monotonic() - t0  # IPC: the handles travel, the engine maps and copies the bytes
