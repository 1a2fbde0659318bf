"""The push sequence into SGLang HTTP servers (`python -m sglang.launch_server`), SGLang 0.5.17.

Both GPU transports follow this push sequence per server, on a background thread (push), or on the
caller's for a lazy source of tensors gathered from the trainer's live weights while training waits
(push_now, weights.snapshot=direct: nothing is copied, and nothing kept for catch_up):
  POST /pause_generation {mode}            in_place keeps running requests (then flush_cache=false)
  per bucket: the transport-specific update (`_send_bucket`); the last one carries weight_version, which
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

The transports: NcclSGLangSender (nccl_sender.py: trainer and engines on different GPUs) and
CudaIpcSGLangSender (cuda_ipc_sender.py: colocated on one GPU), each a `_send_bucket` for one bucket.
Neither can run on a CPU-only machine; they are exercised by the GPU session (tests marked `gpu`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time

import torch

import stages.weights.sglang_protocol as proto
from stages.weights.base import PushHandle, WeightPushError, WeightSender
from stages.weights.buckets import bucket_that_fits, buckets_marking_last

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
        import requests

        try:
            self._post(url, proto.PAUSE, proto.pause_body(self.pause_mode), self.timeout_s, retry=True)
        except WeightPushError as e:
            # no answer to a pause: the server is hung (e.g. its scheduler blocked in the NCCL broadcast of
            # a trainer that died mid-push); its engine watch relaunches it within restart_grace_s, so it
            # counts as down, as a refused connection does
            if isinstance(e.__cause__, requests.Timeout):
                e.unreachable, e.url = True, url
            raise

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


def answer_within(fut: cf.Future, timeout_s: float, url: str):
    """A per-server call's result; a timeout is a WeightPushError naming the server, as failures are
    (the push's error handling resumes or leaves paused by that type)."""
    try:
        return fut.result(timeout=timeout_s)
    except cf.TimeoutError:
        raise WeightPushError(f"SGLang server {url} did not answer within {timeout_s:.0f}s") from None


def lost_servers(urls: list[str], cause: BaseException | None) -> WeightPushError:
    """The error of a push during which `urls` died (`.lost`: see _gone)."""
    err = WeightPushError(f"SGLang server(s) {urls} went away during the push: {cause}")
    err.lost = list(urls)
    return err


def _gone(err: BaseException | None) -> list[str]:
    """The servers `err` says died: those of a broadcast's `lost_servers`, or the one a call (`_post`) could
    not reach."""
    if getattr(err, "unreachable", False):
        return [err.url]
    return list(getattr(err, "lost", []))


def unreachable(calls: dict[str, cf.Future]) -> list[str]:
    """The servers whose finished call failed because the server could not be reached (it died)."""
    return [url for url, c in calls.items() if c.done() and getattr(c.exception(), "unreachable", False)]
