"""SGLang engines on GPUs: one `sglang.launch_server` process per engine, driven over HTTP.

`SGLangEngine` owns its server process (launched in its own process group, logged to a file, killed by
that group on close), streams `/generate` with `return_logprob` and turns the output into `GenResult`s
with per-token logprobs and per-token policy versions. Weight updates follow one protocol whatever the
source: pause_generation (in_place or retract) -> load (CUDA IPC tensors, NCCL broadcast, or disk) ->
/update_weight_version -> continue_generation, each phase timed. `EnginePool` spreads requests over
several engines by least outstanding requests. The weight-update calls are sglang_updates.py's (a base
class of SGLangEngine), the process helpers sglang_process.py's.

SGLang is imported lazily (only the IPC push needs it in this process), so this module imports on
machines without SGLang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import torch

import stages.weights.sglang_protocol as proto
from buffer.net import free_port
from stages.rollout.config import SGLangConfig
from stages.rollout.engine import Engine, GenRequest, GenResult, interrupted
from stages.rollout.routing import RoutingRows
from stages.rollout.sglang_lora import LoraServing, ServedAdapters
from stages.rollout.sglang_process import (
    EngineError,
    SGLangMemory,
    dump_stacks,
    kill_group,
    log_tail,
    sse_events,
)
from stages.rollout.sglang_updates import SGLangWeightUpdates
from stages.rollout.sglang_version import SGLangVersion
from stages.rollout.sglang_wire import as_version, cache_namespace, finish_reason, generate_body
from stages.rollout.stop_strings import StopStrings

log = logging.getLogger(__name__)


UNREACHABLE_BACKOFF_S = 2.0  # no new request for this long after one could not connect


class SGLangEngine(SGLangWeightUpdates, SGLangVersion, SGLangMemory, Engine):
    """One SGLang HTTP server on `cfg.tp_size` GPUs starting at `gpu_id`, and the client that drives it.

    Generation is async (call from asyncio); control calls (weight updates, pause, health, restart)
    are blocking and thread-safe, so a weight transport may call them from its own thread.
    """

    def __init__(
        self,
        model_path: str | Path,
        cfg: SGLangConfig | None = None,
        *,
        dtype: str = "bfloat16",
        version: int = 0,
        name: str = "sglang-0",
        gpu_id: int | None = None,
        port: int | None = None,
        start: bool = True,
        fp32_lm_head: bool = False,
        record_routing: bool = False,
        lora: LoraServing | None = None,
    ):
        self.cfg = cfg or SGLangConfig()
        self.lora, self.served = lora, ServedAdapters()  # LoRA serving: trainer.lora.push=adapter
        self.fp32_lm_head = fp32_lm_head
        # MoE routing replay: the server returns each request's experts (--enable-return-routed-experts)
        self.routing = RoutingRows.of_model(model_path) if record_routing else None
        self.model_path = str(model_path)
        self._tokenizer = None  # the model folder's, loaded at the first request with stop strings
        self._tokenizer_lock = threading.Lock()
        self.dtype = dtype
        self.name = name
        self.gpu_id = self.cfg.base_gpu_id if gpu_id is None else gpu_id
        self.port = port or self.cfg.port or free_port(self.cfg.host)
        self.url = f"http://{self.cfg.host}:{self.port}"
        self.log_dir = Path(self.cfg.log_dir or tempfile.mkdtemp(prefix="slipstream-sglang-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}.log"
        self._version = version
        # radix_cache: new requests' prefix-cache namespace (SGLang's extra_key), moved on by each update;
        # its epoch counts the relaunches and the times the version went back (cache_epoch)
        self.versions_went_back = 0
        self.cache_namespace = cache_namespace(version, 0)
        # what restart() relaunches from: (folder, version); a push from tensors is kept as a host copy
        self._base = (self.model_path, version)
        self._disk: tuple[str, int] | None = None
        self._held: dict[str, torch.Tensor] = {}
        self._held_version: int | None = None
        self._held_pending = False  # tensors held but their version not yet set (inside `updating`)
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._update_lock = threading.RLock()
        self._unloads: threading.Thread | None = None  # an adapter push's unloads, after it (sglang_updates)
        self.last_unload_s = 0.0
        self.outstanding = 0  # requests sent and not yet answered
        self.restarting = False  # True while restart() relaunches the server
        # when a request last could not reach the server; cleared once it answers /health
        self._unreachable_at: float | None = None
        self._health_misses = 0  # /health checks missed in a row (check_health)
        self.restarts = 0  # a restart loses NCCL groups: a transport re-inits when this changes
        self._state_lock = threading.Lock()  # restart's (restarts, _version) are read as one
        self.last_update: dict[str, float] = {}
        self._stats = {
            "requests": 0,
            "tokens": 0,
            "prefill_tokens": 0,
            "updates": 0,
            "update_s": 0.0,
            "gen_s": 0.0,
        }
        # busy = at least one request outstanding (the server has work); the rest of the time since the
        # engine was made is idle: what the pipeline's `generator/idle_share` reports
        self._busy_s, self._busy_since, self._made_at = 0.0, None, time.perf_counter()
        self._init_memory()  # colocated offload: nothing released yet (sglang_process.SGLangMemory)
        if start:
            self.start()

    # -- process ---------------------------------------------------------------------------------
    def _command(self, model_path: str, version: int) -> list[str]:
        c = self.cfg
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
        cmd += ["--host", c.host, "--port", str(self.port), "--tp-size", str(c.tp_size)]
        cmd += ["--mem-fraction-static", str(c.mem_fraction_static), "--base-gpu-id", str(self.gpu_id)]
        cmd += ["--dtype", self.dtype, "--skip-tokenizer-init", "--weight-version", str(version)]
        # deltas, not the cumulative output, in each streamed chunk (cumulative is O(n^2) bytes)
        cmd += ["--incremental-streaming-output", "--stream-interval", str(c.stream_interval)]
        if c.disable_cuda_graph:
            cmd.append("--disable-cuda-graph")
        if not c.radix_cache:
            cmd.append("--disable-radix-cache")
        if self.fp32_lm_head:  # logits in fp32, as the trainer computes them (model.fp32_lm_head)
            cmd.append("--enable-fp32-lm-head")
        if self.routing is not None:
            cmd.append("--enable-return-routed-experts")
        cmd += self.lora.launch_args() if self.lora is not None else []
        return cmd + [str(a) for a in c.extra_args]

    def start(self, model_path: str | None = None, version: int | None = None) -> float:
        """Launch the server and wait until /health answers; returns the seconds it took."""
        t0 = time.perf_counter()
        path, version = model_path or self.model_path, self._version if version is None else version
        cmd = self._command(path, version)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%F %T')} launching: {' '.join(cmd)}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=proto.align_nccl_env(dict(os.environ)),
            )
        # a forgotten engine must not keep its GPU: end the group when this object goes away
        self._finalizer = weakref.finalize(self, kill_group, self._proc, 2.0)
        self._wait_healthy(self.cfg.startup_timeout_s)
        if self.cfg.freeze_gc:
            self._freeze_gc()
        self._unreachable_at = None
        self._health_misses = 0
        self._version = version
        threading.Thread(
            target=self._follow_version, args=(self._proc,), name=f"{self.name}-version", daemon=True
        ).start()
        secs = time.perf_counter() - t0
        log.info("%s: SGLang up at %s (pid %d) in %.1fs", self.name, self.url, self._proc.pid, secs)
        return secs

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineError(
                    f"{self.name}: the SGLang server exited with code {self._proc.returncode} while "
                    f"starting; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self._get_status("/health", 2.0) == 200:
                return
            time.sleep(0.5)
        kill_group(self._proc)
        raise EngineError(
            f"{self.name}: the SGLang server did not answer /health within {timeout_s:.0f}s and was "
            f"stopped. Raise rollout.sglang.startup_timeout_s if it was still loading; last lines of "
            f"{self.log_path}:\n{log_tail(self.log_path)}"
        )

    def _freeze_gc(self) -> None:
        """The server has warmed itself up by the time /health answers, so what its processes hold then
        lives as long as they do; frozen, a full collection no longer walks it (SGLang's advice in its
        own long-GC warning). An SGLang without the endpoint still serves: say so and go on."""
        try:
            self._post("/freeze_gc", {}, timeout=max(self.cfg.health_timeout_s, 1.0))
        except Exception as e:  # noqa: BLE001 - best effort: a server that answers /health must not fail here
            why = "generation may stall for a full collection at times (rollout.sglang.freeze_gc=false skips this)"
            log.warning("%s: could not freeze the server's garbage collector (%s); %s", self.name, e, why)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _stop(self) -> None:
        if self._proc is not None:
            kill_group(self._proc)
            self._finalizer.detach()
            self._proc = None

    def close(self) -> None:
        self.finish_unloads(10.0)  # not a server ended under an unload's request (a warning for nothing)
        self._stop()

    def check_health(self) -> bool:
        """False when the server process is gone, or when /health has not answered 200 in time at two
        checks in a row. SGLang answers /health by generating a token, which a server paused for a
        weight push cannot do: one miss may be a long push (a 7B model's first push paused for 2.8 s;
        a push held up by another server held a healthy one paused for 34 s, and the engine watch
        relaunched it). A process that exited fails at once."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        if self._requests_held:  # released for the trainer (offload): /health needs a token generated
            return True
        if self._get_status("/health", self.cfg.health_timeout_s) == 200:
            self._unreachable_at = None
            self._health_misses = 0
            return True
        self._health_misses += 1
        return self._health_misses < 2

    def available(self) -> bool:
        """False while restart() relaunches the server, once its process has exited, and for
        UNREACHABLE_BACKOFF_S after a request could not reach it (or until /health answers): requests
        sent then would only fail. A back-off, not a flag: without an engine watch nothing would clear it."""
        if self.restarting:
            return False
        since = self._unreachable_at
        if since is not None and time.monotonic() - since < UNREACHABLE_BACKOFF_S:
            return False
        return self._proc is None or self._proc.poll() is None

    def version_and_relaunches(self) -> tuple[int, int]:
        with self._state_lock:
            return self._version, self.restarts

    def restart(self) -> float:
        """Relaunch a dead or hung server and bring it back to the newest weights it can re-sync to.

        Sources, newest first: the host copy of the last tensor push (written out as a checkpoint),
        the last disk update, the original model. After an NCCL push with keep_weights_copy off the
        engine comes back older than before: `version` says which, and the transport re-pushes (and
        re-inits its NCCL group, which died with the server: `restarts` counts these).
        """
        with self._update_lock:
            t0 = time.perf_counter()
            self.restarting = True  # the pool sends new requests elsewhere meanwhile
            try:
                if self._health_misses >= 2 and self._proc is not None:  # hung (check_health): say where
                    dump_stacks(self._proc.pid, self.log_path)
                self._stop()
                path, version = self._resync_source()
                # the older version from now on (a pool's version drops while this one is down), and
                # together with the relaunch that explains it (version_and_relaunches)
                with self._state_lock:
                    self.restarts += 1
                    self._version = version
                    self.cache_namespace = cache_namespace(version, self.cache_epoch)
                self.served.forget()  # relaunched with no adapter: the base serves until the catch-up push
                self.start(path, version)
                self.release_again()  # relaunched mid-hand-over (offload): the trainer keeps its memory
            finally:
                self.restarting = False
            secs = time.perf_counter() - t0
            log.warning("%s: restarted at version %d from %s in %.1fs", self.name, version, path, secs)
            return secs

    # -- HTTP ------------------------------------------------------------------------------------
    def _get_status(self, path: str, timeout: float) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.cfg.control_timeout_s) as r:
                text = r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            raise EngineError(f"{self.name}: POST {path} -> HTTP {e.code}: {e.read()[:1000]!r}") from None
        except OSError as e:
            alive = self._proc is not None and self._proc.poll() is None
            raise EngineError(
                f"{self.name}: POST {path} failed ({e}); server {'alive' if alive else 'dead'}; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path, 20)}"
            ) from None
        out = json.loads(text) if text.strip().startswith("{") else {"text": text}
        if out.get("success") is False:
            raise EngineError(f"{self.name}: POST {path} was refused: {out.get('message')}")
        return out

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        import aiohttp

        await self.enter(len(requests))  # held while released (offload); outstanding from here on,
        # each request until its own answer is in (_answered)
        start_v = self._version
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        t0 = time.perf_counter()
        made = 0
        try:
            async with aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
            ) as session:
                tasks = []
                for r in requests:
                    # a done callback, not a `finally` in the request's coroutine: a task cancelled
                    # before it first ran (its group aborted at once) never enters its body
                    task = asyncio.ensure_future(self._generate_one(session, r, start_v))
                    task.add_done_callback(self._answered)
                    tasks.append(task)
                    made += 1
                out = await asyncio.gather(*tasks)
        finally:
            for _ in range(len(requests) - made):  # never sent: an error before their task was made
                self._answered()
        self._stats["requests"] += len(out)
        self._stats["tokens"] += sum(len(r.response_ids) for r in out)
        self._stats["prefill_tokens"] += sum(
            r.meta.get("prompt_tokens", 0) - r.meta.get("cached_tokens", 0) for r in out
        )
        self._stats["gen_s"] += time.perf_counter() - t0
        return list(out)

    def _answered(self, _task: asyncio.Future | None = None) -> None:
        """One request is done (answered, failed or cancelled): it stops counting as outstanding now,
        not when its batch's last one is: a group's long tail must not hold its siblings' places."""
        self.outstanding -= 1
        if self.outstanding == 0 and self._busy_since is not None:
            self._busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    def requests_in_flight(self) -> int:
        return self.outstanding

    async def _generate_one(self, session, req: GenRequest, start_v: int) -> GenResult:
        p = req.params
        stop_text = StopStrings(p.stop, self.tokenizer()) if p.stop and not p.ignore_eos else None
        if stop_text is not None and self.routing is not None:
            raise ValueError(
                "rollout.sampling.stop with trainer.routing_replay on SGLang: SGLang sends a response's "
                "routed experts when it finishes, and a stop string ends the request before; stop on "
                "tokens (rollout.sampling.stop_token_ids) or use the torch engine"
            )
        adapter = self.served.acquire()  # LoRA serving: the request's adapter, and so its one version
        payload = generate_body(
            req,
            self.name,
            cache_key=self.cache_namespace if self.cfg.radix_cache else None,
            routed_experts=self.routing is not None,
            adapter=adapter[1] if adapter is not None else None,
        )
        try:
            fixed = None if adapter is None else adapter[0]
            return await self._stream(session, req, payload, stop_text, start_v, fixed)
        finally:
            if adapter is not None:
                self.served.release(adapter[1])

    async def _stream(
        self, session, req: GenRequest, payload: dict, stop_text, start_v: int, fixed: int | None
    ) -> GenResult:
        """One /generate stream. Under LoRA serving every token has the request's adapter's version
        (`fixed`). Otherwise SGLang stamps each streamed chunk with the server's weight_version when the
        chunk is built, not per token. Updates bump the version while generation is paused, so
        every token first seen in a chunk whose stamp equals the previous chunk's was made by those
        weights; a chunk whose stamp changed can hold tokens from before the update (buffered by
        stream_interval or by the overlapped last batch of the pause), so its tokens get the older version
        (staleness is then over- never under-estimated, by at most one chunk per update)."""
        import aiohttp

        routed = None
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        prev, finish, meta, stop_string = start_v, None, {}, None
        try:
            async with session.post(self.url + "/generate", json=payload) as resp:
                if resp.status != 200:
                    raise EngineError(
                        f"{self.name}: /generate -> HTTP {resp.status}: {(await resp.text())[:500]}"
                    )
                async for out in sse_events(resp):
                    if "error" in out:
                        finish = finish or {"type": "abort", "message": str(out["error"])[:200]}
                        break
                    meta = out.get("meta_info", {})
                    stamp = as_version(meta.get("weight_version"), prev)
                    v = fixed if fixed is not None else stamp if stamp == prev else min(prev, stamp)
                    for lp, tid, *_ in meta.get("output_token_logprobs") or ():
                        ids.append(int(tid))
                        lps.append(float(lp))
                        vers.append(v)
                    prev = stamp
                    finish = meta.get("finish_reason") or finish
                    routed = meta.get("routed_experts") or routed
                    n_new = len(meta.get("output_token_logprobs") or ())
                    hit = stop_text.first_match(ids, len(ids) - n_new) if stop_text and n_new else None
                    end_here = hit is not None
                    if hit is not None:  # a stop string: keep up to the token that completed it
                        cut, stop_string = hit
                        del ids[cut:], lps[cut:], vers[cut:]
                        finish = {"type": "stop"}
                    elif not meta.get("finish_reason") and interrupted(req):  # partial rollout: ends here
                        finish, end_here = {"type": "abort"}, True
                    if end_here:
                        # closing the stream ends the request: SGLang aborts one whose client went away
                        # (http_server.py: is_disconnected, then the abort task)
                        resp.close()
                        break
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if isinstance(e, aiohttp.ClientConnectionError | OSError) and not isinstance(e, TimeoutError):
                self._unreachable_at = time.monotonic()  # not there (a slow answer is not that)
            raise EngineError(
                f"{self.name}: /generate failed ({type(e).__name__}: {e}); check_health() and restart() "
                f"recover a dead server; log: {self.log_path}"
            ) from None
        reason = finish_reason(finish) if finish else "abort"
        return GenResult(
            rid=req.rid,
            response_ids=ids,
            logprobs=lps,
            versions=vers,
            finish_reason=reason,
            meta={
                "engine": self.name,
                "retractions": meta.get("num_retractions", 0),
                # prompt tokens, and those of them served from the prefix cache (not prefilled)
                "prompt_tokens": int(meta.get("prompt_tokens") or len(req.prompt_ids)),
                "cached_tokens": int(meta.get("cached_tokens") or 0),
            }
            | ({"stop_string": stop_string} if stop_string is not None else {}),
            routed_experts=self.routing.decode(routed) if routed and self.routing is not None else None,
        )

    def tokenizer(self):
        """The model folder's tokenizer, for stop strings (the server runs without one)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from stages.models import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_path)
            return self._tokenizer

    def stats(self) -> dict:
        now = time.perf_counter()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        s = dict(self._stats, version=self._version, restarts=self.restarts, outstanding=self.outstanding)
        s.update(busy_s=busy, idle_s=max(0.0, now - self._made_at - busy))
        s["tokens_per_s"] = s["tokens"] / s["gen_s"] if s["gen_s"] else 0.0
        return s
