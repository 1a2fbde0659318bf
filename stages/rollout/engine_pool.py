"""Several SGLang engines behind one Engine: requests go to the engine with the fewest outstanding ones,
and weight updates run on every engine at once (a collective needs all ranks together).

Session affinity: a request with an `affinity` key (GenRequest.affinity; an agent episode's session id)
goes to the engine its key's first request went to, as long as that engine is available; the load
balancing is then across keys, not across the calls of one episode (whose later turns extend the earlier
ones' context, which that engine may still hold in its prefix cache). A key whose engine is down or being
restarted moves to the least loaded engine that is up, and stays there.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stages.rollout.config import SGLangConfig
from stages.rollout.engine import Engine, GenRequest, GenResult
from stages.rollout.sglang_engine import SGLangEngine
from stages.rollout.sglang_lora import LoraServing

MAX_AFFINITY_KEYS = 65536  # keys remembered (least recently used dropped): far more than episodes in flight


class EnginePool(Engine):
    """Several engines behind one Engine: each request goes to the engine with the fewest outstanding
    (or, with an affinity key, to the engine that key is pinned to: see the module docstring)."""

    def __init__(self, engines: list[SGLangEngine]):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self._dispatching = 0  # requests handed to an engine whose generate() has not run yet
        self._pinned: OrderedDict[str, int] = OrderedDict()  # affinity key -> engine index

    @classmethod
    def launch(
        cls,
        model_path: str | Path,
        cfg: SGLangConfig,
        n: int,
        *,
        dtype: str = "bfloat16",
        version: int = 0,
        fp32_lm_head: bool = False,
        name: str = "sglang",
        record_routing: bool = False,
        lora: LoraServing | None = None,
        ports: list[int] | None = None,
    ) -> EnginePool:
        """Start `n` engines at once on GPUs base_gpu_id + i*tp_size (ports: `ports`, else cfg.port + 10 i,
        else free), named (and logged as) `name`-i: several generators' pools share one log directory."""
        if ports is not None and len(ports) != n:
            raise ValueError(f"{n} SGLang engines but {len(ports)} ports: {ports}")

        def make(i: int) -> SGLangEngine:
            port = ports[i] if ports else cfg.port + 10 * i if cfg.port else None
            gpu = cfg.base_gpu_id + i * cfg.tp_size
            return SGLangEngine(
                model_path,
                cfg,
                dtype=dtype,
                version=version,
                name=f"{name}-{i}",
                gpu_id=gpu,
                port=port,
                fp32_lm_head=fp32_lm_head,
                record_routing=record_routing,
                lora=lora,
            )

        with ThreadPoolExecutor(n) as ex:
            futs = [ex.submit(make, i) for i in range(n)]
        started = [f.result() for f in futs if f.exception() is None]
        errors = [f.exception() for f in futs if f.exception() is not None]
        if errors:
            for e in started:
                e.close()
            raise errors[0]
        return cls(started)

    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        # an engine that is down or being restarted (engine_watch) takes no new requests while another
        # one is up
        up = [e.available() for e in self.engines]
        load = [e.outstanding if ok or not any(up) else float("inf") for e, ok in zip(self.engines, up)]
        parts: list[list[int]] = [[] for _ in self.engines]
        for i, req in enumerate(requests):
            k = self._engine_for(req.affinity, up, load)
            parts[k].append(i)
            load[k] += 1
        used = [(e, [requests[i] for i in p]) for e, p in zip(self.engines, parts) if p]
        if len(used) == 1:  # counted by the engine from this call on
            outs = [await used[0][0].generate(used[0][1])]
        else:
            outs = await self._dispatch(used)
        results: list[GenResult | None] = [None] * len(requests)
        for p, out in zip([p for p in parts if p], outs):
            for i, r in zip(p, out):
                results[i] = r
        return results  # type: ignore[return-value]

    def _engine_for(self, key: str, up: list[bool], load: list[float]) -> int:
        """The engine index for a request: its key's engine while that one is up (or none is), else the
        least loaded, which a key is then pinned to."""
        k = self._pinned.get(key) if key else None
        if k is not None and (up[k] or not any(up)):
            self._pinned.move_to_end(key)
            return k
        k = min(range(len(load)), key=load.__getitem__)
        if key:
            self._pinned[key] = k
            self._pinned.move_to_end(key)
            while len(self._pinned) > MAX_AFFINITY_KEYS:
                self._pinned.popitem(last=False)
        return k

    def forget_affinity(self, key: str) -> None:
        """Drop an affinity key (its episode ended): the pool keeps no state for finished episodes."""
        self._pinned.pop(key, None)

    def pinned(self, key: str) -> int | None:
        """The engine index `key` is pinned to, or None."""
        return self._pinned.get(key)

    async def _dispatch(self, used: list[tuple[SGLangEngine, list[GenRequest]]]) -> list[list[GenResult]]:
        """Each engine's share at once. An engine counts its requests when its generate() first runs, a
        loop step later; until then they count here, so the generator's request cap never sees requests
        that nobody counts (nor keeps counting those of a share cancelled before it ran)."""
        pending = [len(reqs) for _, reqs in used]
        self._dispatching += sum(pending)

        def handed_over(k: int) -> None:
            self._dispatching -= pending[k]
            pending[k] = 0

        async def one(k: int, engine: SGLangEngine, reqs: list[GenRequest]) -> list[GenResult]:
            handed_over(k)
            return await engine.generate(reqs)

        tasks = [asyncio.ensure_future(one(k, e, reqs)) for k, (e, reqs) in enumerate(used)]
        for k, task in enumerate(tasks):
            task.add_done_callback(lambda _t, k=k: handed_over(k))  # a share cancelled before it ran
        return await asyncio.gather(*tasks)

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    @property
    def serves_adapters(self) -> bool:
        """Whether pushes are LoRA adapters the servers apply over their base (sglang_lora.py)."""
        return all(e.serves_adapters for e in self.engines)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def tp_sizes(self) -> list[int]:
        return [e.cfg.tp_size for e in self.engines]

    def _each(self, fn) -> list:
        """Run fn(engine_index, engine) on every engine at once (collectives need all ranks together)."""
        with ThreadPoolExecutor(len(self.engines)) as ex:
            return list(ex.map(lambda ie: fn(*ie), enumerate(self.engines)))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list[dict]:
        named = list(named_tensors)
        return [e.update_weights(named, version) for e in self.engines]

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> list[dict]:
        """All engines join one group: engine i takes ranks rank_offset + i*tp_size ...; world_size counts
        the trainer's rank 0 plus every engine rank."""
        return self._each(
            lambda i, e: e.init_weights_update_group(
                master_address, master_port, rank_offset + i * e.cfg.tp_size, world_size, group_name
            )
        )

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, *, version=None
    ) -> list[dict]:
        return self._each(
            lambda i, e: e.update_weights_from_distributed(names, dtypes, shapes, group_name, version=version)
        )

    def pause(self) -> None:
        self._each(lambda i, e: e.pause())

    def resume(self) -> None:
        self._each(lambda i, e: e.resume())

    def check_health(self) -> list[bool]:
        return self._each(lambda i, e: e.check_health())

    def restart_unhealthy(self) -> list[int]:
        """Restart every engine that fails check_health(), one after another; returns their indices."""
        bad = [i for i, ok in enumerate(self.check_health()) if not ok]
        for i in bad:
            self.engines[i].restart()
        return bad

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def available(self) -> bool:
        return any(e.available() for e in self.engines)

    def version_and_relaunches(self) -> tuple[int, int]:
        pairs = [e.version_and_relaunches() for e in self.engines]  # each engine's pair is consistent
        return min(v for v, _ in pairs), sum(n for _, n in pairs)

    def requests_in_flight(self) -> int:
        return sum(e.requests_in_flight() for e in self.engines) + self._dispatching

    def stats(self) -> dict:
        """Each engine's stats by name, and the sums over engines the generator reports (busy_s, idle_s,
        tokens, prefill_tokens; updates of the engine that applied the fewest)."""
        per = {e.name: e.stats() for e in self.engines}
        out: dict = dict(per)
        for k in ("busy_s", "idle_s", "tokens", "prefill_tokens"):
            out[k] = sum(s.get(k, 0) for s in per.values())
        out["updates"] = min((s.get("updates", 0) for s in per.values()), default=0)
        return out
