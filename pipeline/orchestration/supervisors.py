"""Stage supervisors: the buffer, the generators and the trainer group, each started and restarted by
one object, so that start-up and healing take the same path.

`start()` makes a stage's actors and waits until they answer; `restart()` ends what is left of them
and starts them again on the addresses their peers already know (the buffer's bind, the trainer's
weight sender), so the peers' sockets reconnect by themselves. What decides *whether* a stage is
restarted (its restart budget, whether it raised or its process died) is healing.py's; what the actors
run is actors.py's. All of a run's actors live in one placement group (`Site.place`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from buffer.net import is_loopback
from pipeline.orchestration.calls import Calls, StageFailed, root_error
from pipeline.orchestration.placement import (
    PlacementError,
    check_fits,
    check_offload,
    check_room,
    check_tp_groups,
    generator_bundle,
    make_plan,
    plan_cfg,
)

if TYPE_CHECKING:
    from buffer.curve import CurveKeys
    from pipeline.config import RunConfig
    from pipeline.orchestration.placement import Plan

log = logging.getLogger("slipstream")

# a trainer group whose rendezvous port another process took is started again this many times at most
RENDEZVOUS_ATTEMPTS = 3


def port_taken(error: Exception) -> bool:
    """Whether a stage failed because a port it was given was taken by the time it bound it (the OS
    hands a port freed by a probe to the next process that asks: Ray opens connections all the time)."""
    text = str(error)
    return "EADDRINUSE" in text or "ddress already in use" in text


def retry_if_port_taken(
    start: Callable[[], Any], end_attempt: Callable[[StageFailed], None], attempts: int = RENDEZVOUS_ATTEMPTS
) -> Any:
    """`start()` again (after `end_attempt(error)`) while it fails because a port was taken, up to
    `attempts` tries in all; any other failure, and the last, is raised as it came."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except StageFailed as e:
            if not port_taken(e) or attempt == attempts:
                raise
            end_attempt(e)


class Site:
    """Where a run's stages live and how they reach each other: the config they run with, the run
    directory, the placement group and its plan, and the CURVE keys of a run that spans nodes. Made
    empty with the run; `place()` fills in the placement once Ray is up."""

    def __init__(self, cfg: RunConfig, run_dir: Path, calls: Calls):
        self.cfg, self.run_dir, self.calls = cfg, run_dir, calls
        self.plan: Plan | None = None
        self.pg = None  # the placement group
        self.curve: CurveKeys | None = None
        self.reachable = False  # stages bind their node's IP instead of loopback
        self.single_node = True
        self.model_path = ""

    def place(self) -> None:
        """Resolve the model, plan the bundles and reserve them (fails naming the keys when the cluster
        cannot hold the run, rather than waiting run.timeout_s for a placement group that never comes)."""
        import ray
        from ray.util.placement_group import placement_group

        from stages.models import resolve_model

        cfg = self.cfg
        self.model_path = str(resolve_model(cfg.model))  # build/convert once, before any actor needs it
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        resources = ray.cluster_resources()
        try:
            self.plan = make_plan(cfg, resources.get("GPU", 0))
            check_fits(self.plan, cfg, resources, nodes)
            check_offload(self.plan, cfg)
        except PlacementError as e:
            raise StageFailed(str(e)) from None
        # several nodes: stages bind their node's IP instead of loopback, and every ZeroMQ socket of the
        # run is authenticated with CURVE keys made here, handed to the stages through Ray
        self.single_node = len(nodes) == 1
        self.reachable = len(nodes) > 1
        if self.reachable or not all(is_loopback(a) for a in (cfg.buffer.bind, cfg.weights.bind)):
            from buffer.curve import CurveKeys

            self.curve = CurveKeys.generate()
        self.pg = placement_group(self.plan.bundles, strategy="PACK")
        self.calls.wait(
            self.pg.ready(), "placement group", f"the cluster has no room for the bundles {self.plan.bundles}"
        )

    def reserve_generators(self, count: int, timeout_s: float) -> list:
        """One placement group of one generator's bundle each, for generators added mid-run beyond the
        run's own group (Ray cannot grow a placement group). PlacementError, naming what is short, when
        the cluster has no room for all of them now or they are not placed within `timeout_s`; none is
        kept then."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = generator_bundle(self.cfg)
        check_room(bundle, count, ray.available_resources())
        pgs = [placement_group([dict(bundle)], strategy="PACK") for _ in range(count)]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=count, timeout=timeout_s)
        if len(ready) < count:  # another job took the room meanwhile
            for pg in pgs:
                remove_placement_group(pg)
            raise PlacementError(
                f"{count} generator bundle(s) {bundle} were not placed within {timeout_s:.0f}s: the cluster's "
                "free resources went to something else; ask again once there is room"
            )
        return pgs

    def on(self, bundle: int) -> dict:
        """Actor options that put it on `bundle` of the run's placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            )
        }


class BufferStage:
    """The buffer actor on its directory. A restart binds its predecessor's address, so the clients'
    sockets reconnect by themselves and resend what was not acknowledged."""

    def __init__(self, site: Site):
        self.site = site
        self.actor = None
        self.address = ""  # where the clients connect; a restart keeps it
        self.watch = None  # completes (with an error) when the buffer's process dies
        self.directory = site.cfg.buffer.dir or str(site.run_dir / "buffer")

    def start(self) -> str:
        self.address = self._launch(bind=None)
        return self.address

    def restart(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        address = self._launch(bind=self.address)
        if address != self.address:  # the port was taken meanwhile: the clients cannot follow
            raise StageFailed(f"buffer restarted at {address}, not at {self.address} where its clients are")

    def _launch(self, bind: str | None) -> str:
        from buffer.memory import buffer_env
        from pipeline.orchestration.actors import BufferActor, actor_env

        # a worker process of its own, with the buffer's malloc settings from its start (buffer/memory.py)
        env = actor_env()
        user = {"GLIBC_TUNABLES": os.environ["GLIBC_TUNABLES"]} if os.environ.get("GLIBC_TUNABLES") else {}
        env["env_vars"] = buffer_env({**env["env_vars"], **user})
        bc = (
            self.site.cfg.buffer if bind is None else msgspec.structs.replace(self.site.cfg.buffer, bind=bind)
        )
        site = self.site
        self.actor = BufferActor.options(runtime_env=env, **site.on(site.plan.trainer_bundles[0])).remote(
            bc, self.directory, reachable=site.reachable, curve=site.curve
        )
        address = site.calls.wait(self.actor.address.remote(), "buffer")
        self.watch = self.actor.watch.remote()
        return address


def shares_of(batch_groups: int, n: int) -> list[int]:
    """Each of `n` generators' share of a trainer batch (admission control); together exactly
    batch_groups, else the generators could never admit a full batch per version and the trainer
    would starve."""
    return [batch_groups // n + (i < batch_groups % n) for i in range(n)]


class GeneratorStage:
    """rollout.num_generators generator actors, each streaming into the buffer. A restart of one is a
    new incarnation (a new generator id) that picks up its predecessor's data position and gets the
    current weights from the trainer's sender at once. Generators are added and removed mid-run at the
    end of the list (`add`, `remove_last`; elastic.py decides when), so generator 0, which runs the
    held-out evaluation, stays."""

    def __init__(self, site: Site, buffer: BufferStage):
        self.site, self.buffer = site, buffer
        self.shares = shares_of(site.cfg.trainer.batch_groups, site.cfg.rollout.num_generators)
        self.extra_pgs: dict[int, object] = {}  # placement groups of generators added beyond the run's
        self.actors: list = []
        self.ids: list[str] = []  # each generator's current incarnation id
        # each generator's SGLang servers' ports: the servers outlive a generator that dies, and an engine
        # watch relaunches one on its port (under a new pid)
        self.ports: list[list[int]] = []
        self.runs: dict = {}  # ObjectRef of each generator's run() -> its name
        self.weights_address: str | None = None

    @staticmethod
    def name(i: int) -> str:
        return f"generator gen-{i}"

    def start(self, weights_address: str | None) -> None:
        """Every generator at once (their engines load side by side), then each one's id. They start
        generating at `run()`."""
        self.weights_address = weights_address
        (self.site.run_dir / "generators").mkdir(exist_ok=True)
        self.actors = [self._launch(i) for i in range(len(self.shares))]
        self.ids = [self.site.calls.wait(g.ident.remote(), self.name(i)) for i, g in enumerate(self.actors)]
        self.ports = [self._ports_of(i) for i in range(len(self.actors))]

    def run(self) -> None:
        for i in range(len(self.actors)):
            self._run(i)

    def connect_weights(self, address: str) -> None:
        """Generators started before the trainer (SGLang servers, whose addresses the trainer needs) take
        their weights from its sender at `address` (weights.transport cpu): a receiver each, now, and in
        every generator launched from here on (heals, additions)."""
        self.weights_address = address
        for i, g in enumerate(self.actors):
            self.site.calls.wait(g.connect_weights.remote(address), self.name(i))

    def add(self, pg=None) -> int:
        """One more generator, at the end, on placement group `pg` (None: its bundle of the run's own
        group, which a generator of that index had at start). It joins at the trainer's version
        (ElasticGenerator.join) and starts generating at once; returns its index. `shares` must already
        hold its share."""
        i = len(self.actors)
        if pg is not None:
            self.extra_pgs[i] = pg
        self.actors.append(self._launch(i, joining=True))
        self.ids.append(self.site.calls.wait(self.actors[i].ident.remote(), self.name(i)))
        self.ports.append(self._ports_of(i))
        self._run(i)
        return i

    def remove_last(self, drain_s: float) -> tuple[str, str]:
        """Take the last generator out of the run: no new group, its groups in flight streamed into the
        buffer (drained) for at most `drain_s`, then its actor and placement ended. Groups not streamed
        by then were never acknowledged: nothing of theirs reached the buffer, and their prompts stay
        unsettled in its data position. Returns (its generator id, how it left)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        i = len(self.actors) - 1
        actor, name = self.actors[i], self.name(i)
        run = next((r for r, n in self.runs.items() if n == name), None)
        self.runs.pop(run, None)  # its run() ending is no longer a death to heal
        actor.stop.remote()
        how = "drained"
        if run is not None:
            done, _ = ray.wait([run], timeout=drain_s)
            if not done:
                how = f"aborted: its groups in flight were not streamed within {drain_s:.0f}s (run.timeout_s)"
            else:
                try:
                    ray.get(run, timeout=0)
                except ray.exceptions.RayError as e:  # died or failed while draining: it leaves anyway
                    how = f"aborted: {root_error(e)}"
        # the receiver says bye to the trainer's sender, the sink closes; bounded, then killed regardless
        ray.wait([actor.close.remote()], timeout=min(drain_s, 30.0))
        ray.kill(actor, no_restart=True)
        pg = self.extra_pgs.pop(i, None)
        if pg is not None:
            remove_placement_group(pg)
        del self.actors[i]
        if i < len(self.ports):
            self.ports.pop(i)
        return self.ids.pop(i), how

    def release_placements(self) -> None:
        """The placement groups of generators added mid-run (at shutdown, after their actors)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.extra_pgs.values():
            remove_placement_group(pg)
        self.extra_pgs.clear()

    def restart(self, i: int) -> None:
        """A new incarnation in generator i's place. SGLang servers outlive the process that started
        them (their own sessions): its predecessor's are ended first, on its node, and the new ones start
        on the same ports, so the trainer's sender finds them at the URLs it pushes to, as it finds a
        server the engine watch relaunched (and catches it up)."""
        import ray

        ray.kill(self.actors[i], no_restart=True)
        ports = self.ports[i] if i < len(self.ports) else []
        if ports:
            self._end_servers(i, ports)
        self.actors[i] = self._launch(i, ports=ports or None)
        self.ids[i] = self.site.calls.wait(self.actors[i].ident.remote(), self.name(i))
        if i < len(self.ports):
            self.ports[i] = self._ports_of(i)
        self._run(i)

    def _ports_of(self, i: int) -> list[int]:
        from urllib.parse import urlsplit

        urls = self.site.calls.wait(self.actors[i].engine_urls.remote(), self.name(i))
        return [urlsplit(u).port for u in urls]

    def _end_servers(self, i: int, ports: list[int], timeout_s: float = 120.0) -> None:
        """End generator i's orphaned SGLang servers (those listening on `ports`) on its node: their GPU
        memory and ports go to its successor's."""
        import ray

        from stages.rollout.sglang_process import end_orphaned_servers

        task = ray.remote(num_cpus=0)(end_orphaned_servers).options(**self._where(i))
        held = self.site.calls.wait(task.remote(ports, timeout_s), f"{self.name(i)}'s SGLang servers")
        if held:
            raise StageFailed(
                f"{self.name(i)} died and its SGLang servers on ports {held} still run after "
                f"{timeout_s:.0f}s of SIGKILL: their GPUs are not free for a new incarnation"
            )

    def engine_urls(self) -> list[str]:
        """The SGLang servers of every generator (the trainer's sender pushes to them)."""
        return [
            u for g in self.actors for u in self.site.calls.wait(g.engine_urls.remote(), "SGLang engines")
        ]

    def _run(self, i: int) -> None:
        self.runs[self.actors[i].run.remote()] = self.name(i)

    def _where(self, i: int) -> dict:
        """Generator i's placement: its bundle of the run's group, or the group it was added on."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self.extra_pgs.get(i)
        if pg is None:
            return self.site.on(self.site.plan.generator_bundles[i])
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}

    def _launch(self, i: int, joining: bool = False, ports: list[int] | None = None):
        from pipeline.orchestration.actors import GeneratorActor

        site = self.site
        # the generator's data position, kept across incarnations (see GeneratorActor)
        state = str(site.run_dir / "generators" / f"gen-{i}.json")
        return GeneratorActor.options(num_gpus=site.plan.generator_gpus, **self._where(i)).remote(
            site.cfg,
            i,
            self.buffer.address,
            self.weights_address,
            self.shares[i],
            state_path=state,
            reachable=site.reachable,
            curve=site.curve,
            joining=joining,
            ports=ports,
        )


class TrainerGroup:
    """The trainer's ranks, one actor each, set up together (each blocks in the process-group rendezvous
    until all are in). Ranks follow (node, GPU), so that a TP group's ranks share a node (megatron groups
    TP first). Rank 0 alone fetches from the buffer, holds the weight sender and answers the driver.

    A restart ends every rank (the survivors would wait in a collective for the dead one), drops the
    dead group's fetch from the buffer, and starts a group that resumes from the newest checkpoint,
    binds the same weight address (the engines' receivers reconnect to it by themselves) and pushes
    its weights at once."""

    def __init__(self, site: Site, buffer: BufferStage):
        self.site, self.buffer = site, buffer
        self.ranks: list = []
        self.where: list[dict] = []  # each rank's node and GPUs, in rank order
        self.engine_urls: list[str] | None = None  # SGLang servers the sender pushes to
        # where generators' weight receivers connect (None: the sender pushes into SGLang servers itself)
        self.weights_address: str | None = None
        self.engines = site.cfg.rollout.num_generators  # a push waits for this many (expect_engines)

    @property
    def rank0(self):
        return self.ranks[0] if self.ranks else None

    def start(self, engine_urls: list[str] | None = None) -> None:
        self.engine_urls = engine_urls
        self._launch(weights_bind=None, push_now=False)
        # torch engines, and SGLang servers with weights.transport cpu, connect to rank 0's sender
        self.weights_address = self.site.calls.wait(self.rank0.weights_address.remote(), "trainer")

    def restart(self) -> int:
        """Returns the version the new group resumed at."""
        calls = self.site.calls
        self.stop()
        # the dead trainer's fetch may still wait in the buffer: served, it would take a batch nobody trains
        calls.wait(self.buffer.actor.drop_fetches.remote("trainer"), "buffer")
        self._launch(weights_bind=self.weights_address, push_now=True)
        address = calls.wait(self.rank0.weights_address.remote(), "trainer")
        if address != self.weights_address:  # the port was taken meanwhile: the engines cannot follow
            raise StageFailed(
                f"the restarted trainer sends weights from {address}, not {self.weights_address}"
            )
        return calls.wait(self.rank0.version.remote(), "trainer")

    def expect_engines(self, count: int) -> None:
        """The run has `count` generators now (elastic rollout): pushes wait for that many engines, a
        restarted group's included. A rank 0 that died meanwhile is restarted at the next step, with it."""
        self.engines = count
        if self.rank0 is not None:
            self.site.calls.wait(self.rank0.expect_engines.remote(count), "trainer", on_death=lambda: None)

    def stop(self) -> None:
        import ray

        for a in self.ranks:
            ray.kill(a, no_restart=True)

    def _launch(self, weights_bind: str | None, push_now: bool) -> None:
        """Rank 0 picks the rendezvous port before its ranks bind it, so another process may take it in
        between: the group is started again, on a new port, up to RENDEZVOUS_ATTEMPTS times."""

        def end_attempt(error: StageFailed) -> None:
            log.warning("trainer: %s; starting its ranks again on another port", error)
            self.stop()

        retry_if_port_taken(lambda: self._attempt(weights_bind, push_now), end_attempt)

    def _attempt(self, weights_bind: str | None, push_now: bool) -> None:
        from pipeline.orchestration.actors import TrainerActor

        site, calls, plan = self.site, self.site.calls, self.site.plan
        actors = self.ranks = [  # this attempt's, whatever fails below (a retry ends them)
            TrainerActor.options(num_gpus=plan.trainer_gpus, **site.on(b)).remote(site.cfg.trainer.ranks)
            for b in plan.trainer_bundles
        ]
        where = [calls.wait(a.where.remote(), "trainer") for a in actors]
        order = sorted(range(len(actors)), key=lambda k: (where[k]["node_id"], where[k]["gpus"]))
        self.ranks = [actors[k] for k in order]
        self.where = [where[k] for k in order]
        try:
            check_tp_groups([w["node_id"] for w in self.where], site.cfg.trainer.tp)
        except PlacementError as e:
            raise StageFailed(str(e)) from None
        master = calls.wait(self.rank0.master_address.remote(site.single_node), "trainer rank 0")
        tcfg = plan_cfg(site.cfg, plan)
        if weights_bind:
            tcfg = msgspec.structs.replace(
                tcfg, weights=msgspec.structs.replace(tcfg.weights, bind=weights_bind)
            )
        setups = [
            t.setup.remote(
                k,
                tcfg,
                master,
                self.buffer.address,
                site.model_path,
                str(site.run_dir),
                self.engines,
                self.engine_urls,
                reachable=site.reachable,
                curve=site.curve,
                push_now=push_now,
            )
            for k, t in enumerate(self.ranks)
        ]
        for k, ref in enumerate(setups):
            calls.wait(ref, f"trainer rank {k}")
