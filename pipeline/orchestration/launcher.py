"""Start the stages as Ray actors, drive training, and shut everything down cleanly.

The driver owns the run: it creates the run directory, starts the buffer, the trainer (which binds the
weight transport) and the generators (which connect to it) inside one placement group, then pulls one
trainer step at a time while the generators stream on their own. Any stage that fails stops the run
with that stage's error; Ctrl-C stops it too; in every case the buffer's segments stay on disk.

`mode=async`: generators run continuously, bounded by run.max_staleness (admission control).
`mode=sync`:  the same actors with max_staleness=0 and the trainer waiting for each push to land, so
              each batch is generated entirely by the weights of the previous step — generate, train,
              push, repeat — and the speedup of async is measured by switching one key.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from buffer.net import is_loopback
from pipeline.config import RunConfig, effective_staleness, write_resolved
from pipeline.orchestration.metrics import MetricsWriter
from pipeline.orchestration.placement import PlacementError, check_fits, check_tp_groups, make_plan, plan_cfg
from pipeline.orchestration.progress import Progress, summary

log = logging.getLogger("slipstream")


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage and carries its error."""


# a trainer group whose rendezvous port another process took is started again this many times at most
RENDEZVOUS_ATTEMPTS = 3


def port_taken(error: Exception) -> bool:
    """Whether a stage failed because a port it was given was taken by the time it bound it (the OS
    hands a port freed by a probe to the next process that asks: Ray opens connections all the time)."""
    text = str(error)
    return "EADDRINUSE" in text or "ddress already in use" in text


def retry_if_port_taken(start, end_attempt, attempts: int = RENDEZVOUS_ATTEMPTS):
    """`start()` again (after `end_attempt(error)`) while it fails because a port was taken, up to
    `attempts` tries in all; any other failure, and the last, is raised as it came."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except StageFailed as e:
            if not port_taken(e) or attempt == attempts:
                raise
            end_attempt(e)


class _TrainerDied(Exception):
    """A trainer rank's process died mid-step (the driver restarts the group)."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


@dataclass
class RunResult:
    run_dir: Path
    status: str  # "completed" | "failed" | "interrupted"
    steps: int
    elapsed_s: float
    history: list[dict] = field(default_factory=list)
    plot: Path | None = None
    error: str = ""


def make_run_dir(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    else:
        d = Path(cfg.run.root) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while d.exists():
            d = d.with_name(f"{d.name.rsplit('.', 1)[0]}.{n}")
            n += 1
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


def effective(cfg: RunConfig) -> RunConfig:
    """The config the stages run with: sync mode is async with staleness 0 (see module docstring)."""
    bound = effective_staleness(cfg)
    if bound != cfg.run.max_staleness:
        return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, max_staleness=bound))
    return cfg


def start_ray(cfg: RunConfig) -> None:
    import ray

    from pipeline.orchestration.actors import actor_env

    if ray.is_initialized():
        return
    kw: dict = {
        "runtime_env": actor_env(),
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": True,
        "logging_level": logging.WARNING,
    }
    if cfg.cluster.address == "local":
        if cfg.cluster.num_cpus:
            kw["num_cpus"] = cfg.cluster.num_cpus
        if cfg.cluster.num_gpus:
            kw["num_gpus"] = cfg.cluster.num_gpus
        ray.init(**kw)
    else:
        token = _cluster_token()
        try:
            ray.init(address=cfg.cluster.address, **kw)
        except (ConnectionError, ray.exceptions.RayError) as e:
            hint = (
                ""
                if token
                else "; if the cluster uses Ray's token auth, put its token in RAY_AUTH_TOKEN, "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
            )
            raise StageFailed(
                f"cluster.address={cfg.cluster.address}: cannot join the Ray cluster: {e}{hint}"
            ) from None


def _cluster_token() -> str:
    """Join a cluster that uses Ray's token auth: Ray sends the token (RAY_AUTH_TOKEN, the file at
    RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) only in RAY_AUTH_MODE=token, and turns that mode on by
    itself only for a cluster it finds on its own, never for an explicit address: without this, joining
    failed with "InvalidAuthToken". A mode the user set is kept. Returns where the token came from."""
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    source = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else path if os.path.exists(path) else ""
    if source:
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config  # Ray caches its config: re-read it, as Ray does when it turns
        # the mode on itself (ray._private.authentication.authentication_token_setup._enable_token_auth)

        Config.initialize("")
    return source


class Pipeline:
    """One run: actors, the training loop and the shutdown. Use run_pipeline() unless embedding."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg, self.run_dir = effective(cfg), run_dir
        self.buffer = self.trainer = None  # self.trainer: rank 0 of self.trainers
        self.trainers: list = []
        self.generators: list = []
        self.gen_runs: dict = {}  # ObjectRef of each generator's run() -> generator name
        self.pg = self.plan = self.curve = None
        self.where: dict = {}  # stage -> node and GPUs (placement.json)
        self._last: tuple[float, int] | None = None  # (time, generated tokens) at the previous step
        self.gen_ids: list[str] = []  # each generator's current incarnation id
        self.deaths: dict[str, list[float]] = {}  # stage name -> times it died (healing budget)
        self._new_generator = None  # (index) -> actor; set by start()
        self.buffer_watch = None  # completes (with an error) when the buffer's process dies
        self._new_buffer = None  # (bind address or None) -> the buffer's address; set by start()
        self.buffer_addr = ""
        self._new_trainers = None  # (engine urls, weights bind, push_now) -> rank 0; set by start()
        self.weights_addr = ""

    # -- start-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pipeline.orchestration.actors import (
            BufferActor,
            GeneratorActor,
            TrainerActor,
            actor_env,
        )
        from stages.models import resolve_model

        cfg, r = self.cfg, self.cfg.rollout
        model_path = str(resolve_model(cfg.model))  # build/convert once, before any actor needs it
        n_gen = r.num_generators
        tc = cfg.trainer
        n_ranks = tc.ranks
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        resources = ray.cluster_resources()
        try:
            plan = make_plan(cfg, resources.get("GPU", 0))
            check_fits(plan, cfg, resources, nodes)
        except PlacementError as e:
            raise StageFailed(str(e)) from None
        self.plan = plan
        # several nodes: stages bind their node's IP instead of loopback, and every ZeroMQ socket of the
        # run is authenticated with CURVE keys made here, handed to the stages through Ray
        reachable = len(nodes) > 1
        if reachable or not all(is_loopback(a) for a in (cfg.buffer.bind, cfg.weights.bind)):
            from buffer.curve import CurveKeys

            self.curve = CurveKeys.generate()
        self.pg = placement_group(plan.bundles, strategy="PACK")
        self._wait(
            self.pg.ready(), "placement group", f"the cluster has no room for the bundles {plan.bundles}"
        )

        def on(i: int) -> dict:
            return {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                )
            }

        buffer_dir = cfg.buffer.dir or str(self.run_dir / "buffer")
        from buffer.memory import buffer_env

        # a worker process of its own, with the buffer's malloc settings from its start (buffer/memory.py)
        env = actor_env()
        user = {"GLIBC_TUNABLES": os.environ["GLIBC_TUNABLES"]} if os.environ.get("GLIBC_TUNABLES") else {}
        env["env_vars"] = buffer_env({**env["env_vars"], **user})

        def new_buffer(bind: str | None):
            """The buffer actor on its directory; a replacement binds its predecessor's address, so the
            clients' sockets reconnect by themselves and resend what was not acknowledged."""
            c = (
                cfg
                if bind is None
                else msgspec.structs.replace(cfg, buffer=msgspec.structs.replace(cfg.buffer, bind=bind))
            )
            self.buffer = BufferActor.options(runtime_env=env, **on(plan.trainer_bundles[0])).remote(
                c, buffer_dir, reachable=reachable, curve=self.curve
            )
            address = self._wait(self.buffer.address.remote(), "buffer")
            self.buffer_watch = self.buffer.watch.remote()
            return address

        self._new_buffer = new_buffer
        buffer_addr = self.buffer_addr = new_buffer(None)
        # each generator's share of a trainer batch (admission control); together exactly batch_groups,
        # else the generators could never admit a full batch per version and the trainer would starve
        bg = cfg.trainer.batch_groups
        shares = [bg // n_gen + (i < bg % n_gen) for i in range(n_gen)]

        def generators(weights_addr):
            (self.run_dir / "generators").mkdir(exist_ok=True)

            def one(i: int):
                # the generator's data position, kept across incarnations (see GeneratorActor)
                state = str(self.run_dir / "generators" / f"gen-{i}.json")
                return GeneratorActor.options(
                    num_gpus=plan.generator_gpus, **on(plan.generator_bundles[i])
                ).remote(
                    cfg,
                    i,
                    buffer_addr,
                    weights_addr,
                    shares[i],
                    state_path=state,
                    reachable=reachable,
                    curve=self.curve,
                )

            self._new_generator = one
            return [one(i) for i in range(n_gen)]

        def trainer(urls, weights_bind: str | None = None, push_now: bool = False):
            """All ranks set up together (each blocks in the process-group rendezvous until all are in).
            Ranks follow (node, GPU), so that a TP group's ranks share a node (megatron groups TP first).
            A replacement group binds its predecessor's weight address (`weights_bind`): the engines'
            receivers reconnect to it by themselves. Rank 0 picks the rendezvous port before its ranks
            bind it, so another process may take it in between: the group is started again, on a new
            port, up to RENDEZVOUS_ATTEMPTS times."""

            def end_attempt(error: StageFailed) -> None:
                log.warning("trainer: %s; starting its ranks again on another port", error)
                for a in self.trainers:
                    ray.kill(a, no_restart=True)

            return retry_if_port_taken(lambda: trainer_group(urls, weights_bind, push_now), end_attempt)

        def trainer_group(urls, weights_bind: str | None, push_now: bool):
            actors = self.trainers = [  # this attempt's, whatever fails below (a retry ends them)
                TrainerActor.options(num_gpus=plan.trainer_gpus, **on(b)).remote(n_ranks)
                for b in plan.trainer_bundles
            ]
            where = [self._wait(a.where.remote(), "trainer") for a in actors]
            order = sorted(range(len(actors)), key=lambda k: (where[k]["node_id"], where[k]["gpus"]))
            self.trainers = [actors[k] for k in order]
            self.where["trainer"] = [where[k] for k in order]
            try:
                check_tp_groups([w["node_id"] for w in self.where["trainer"]], tc.tp)
            except PlacementError as e:
                raise StageFailed(str(e)) from None
            master = self._wait(self.trainers[0].master_address.remote(len(nodes) == 1), "trainer rank 0")
            tcfg = plan_cfg(cfg, plan)
            if weights_bind:
                tcfg = msgspec.structs.replace(
                    tcfg, weights=msgspec.structs.replace(tcfg.weights, bind=weights_bind)
                )
            setups = [
                t.setup.remote(
                    k,
                    tcfg,
                    master,
                    buffer_addr,
                    model_path,
                    str(self.run_dir),
                    n_gen,
                    urls,
                    reachable=reachable,
                    curve=self.curve,
                    push_now=push_now,
                )
                for k, t in enumerate(self.trainers)
            ]
            for k, ref in enumerate(setups):
                self._wait(ref, f"trainer rank {k}")
            return self.trainers[0]

        self._new_trainers = trainer
        if r.engine == "sglang":  # servers first: the trainer's transport needs their addresses
            self.generators = generators(None)
            urls = [u for g in self.generators for u in self._wait(g.engine_urls.remote(), "SGLang engines")]
            self.trainer = trainer(urls)
            weights_addr = None
        else:  # the trainer binds the weight transport first; torch engines connect to it
            self.trainer = trainer(None)
            weights_addr = self.weights_addr = self._wait(self.trainer.weights_address.remote(), "trainer")
            self.generators = generators(weights_addr)
        self.gen_ids = [
            self._wait(g.ident.remote(), f"generator gen-{i}") for i, g in enumerate(self.generators)
        ]
        self._record_placement(buffer_addr, weights_addr)
        for i, g in enumerate(self.generators):
            self.gen_runs[g.run.remote()] = f"generator gen-{i}"

    def _record_placement(self, buffer_addr: str, weights_addr: str | None) -> None:
        """<run dir>/placement.json: where each stage runs (node, GPUs) and the addresses they use."""
        import json

        self.where["buffer"] = self._wait(self.buffer.where.remote(), "buffer")
        self.where["generators"] = [
            self._wait(g.where.remote(), f"generator gen-{i}") for i, g in enumerate(self.generators)
        ]
        record = {
            **self.where,
            "bundles": self.plan.bundles,
            "addresses": {"buffer": buffer_addr, "weights": weights_addr},
            "curve": self.curve is not None,
        }
        (self.run_dir / "placement.json").write_text(json.dumps(record, indent=1))

    def _failed(self, what: str, e: BaseException) -> StageFailed:
        """The error that ends the run when a stage failed: its innermost error in the message, and the
        whole of Ray's report (the stage's own traceback: where it raised, which the message leaves
        out) in run_dir/errors/<what>.txt, named in the message."""
        path = self.run_dir / "errors" / f"{what.replace(' ', '-')}.txt"
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_text(str(e) + "\n")
            where = f" (traceback: {path})"
        except OSError:  # a run directory that cannot be written: the message alone
            where = ""
        return StageFailed(f"{what} failed: {_root_error(e)}{where}")

    def _wait(self, ref, what: str, hint: str = "", on_death=None):
        """ray.get with the run's timeout and an error that names the stage. `on_death`: called
        instead when the actor's process died (the stage is healed), and the result is None."""
        import ray

        try:
            return ray.get(ref, timeout=self.cfg.run.timeout_s)
        except ray.exceptions.RayActorError as e:
            if on_death is None:
                raise self._failed(what, e) from None
            on_death()
            return None
        except ray.exceptions.GetTimeoutError:
            raise StageFailed(
                f"{what} did not answer within run.timeout_s={self.cfg.run.timeout_s:.0f}s"
                + (f": {hint}" if hint else "")
            ) from None
        except ray.exceptions.RayError as e:
            raise self._failed(what, e) from None

    # -- the loop ----------------------------------------------------------------------------------
    def train(self, metrics: MetricsWriter, progress: Progress) -> int:
        """Run cfg.run.steps trainer steps; returns the number of steps done."""
        import ray

        cfg = self.cfg
        # run.steps is the total: a run resumed from a checkpoint at version v trains steps v+1 .. run.steps
        start = self._wait(self.trainer.version.remote(), "trainer")
        metrics.resume_at(start)
        if start:
            log.warning(
                "resuming at step %d of run.steps=%d (the checkpoint's version)", start, cfg.run.steps
            )
        eval_ref, step = None, start
        deadline = time.monotonic() + cfg.run.time_limit_s if cfg.run.time_limit_s else float("inf")
        while step < cfg.run.steps:
            if time.monotonic() > deadline:
                log.warning(
                    "run.time_limit_s=%.0f reached after %d steps: ending the run", cfg.run.time_limit_s, step
                )
                break
            step += 1
            try:
                m = self._trainer_step(step)
            except _TrainerDied as e:  # restarted from its newest checkpoint: continue from there
                step = self._heal_trainer(e.error)
                metrics.resume_at(step)
                continue
            m["run/restarts"] = sum(len(v) for v in self.deaths.values())
            m.update(self._generator_metrics())
            m.update(self._buffer_metrics())
            self._rates(m)
            if eval_ref is not None and ray.wait([eval_ref], timeout=0)[0]:
                # a generator that died mid-evaluation is healed by the generator watch: skip this one
                m.update(self._wait(eval_ref, "evaluation", on_death=lambda: None) or {})
                eval_ref = None
            if cfg.eval.every_steps and eval_ref is None and step % cfg.eval.every_steps == 0:
                eval_ref = self.generators[0].evaluate.remote(step)  # on its engine, beside generation
            metrics.log(step, m)
            progress.update(step, m)
        if eval_ref is not None:
            m = self._wait(eval_ref, "evaluation", on_death=lambda: None)
            if m:
                metrics.log(step, m)
        return step

    def _trainer_step(self, step: int) -> dict:
        """One step on every trainer rank; rank 0's metrics. Notices at once when a generator or any
        rank dies (the other ranks would otherwise wait in a collective until its timeout)."""
        import ray

        refs = [t.step.remote() for t in self.trainers]
        rank_of = {ref: k for k, ref in enumerate(refs)}
        pending, m = set(refs), None
        watch = [self.buffer_watch] if self.buffer_watch is not None else []
        while pending:
            ready, _ = ray.wait(
                [*pending, *self.gen_runs, *watch], num_returns=1, timeout=self.cfg.run.timeout_s
            )
            if not ready:
                raise StageFailed(
                    f"trainer step {step} did not finish within run.timeout_s={self.cfg.run.timeout_s:.0f}s "
                    f"(ranks still running: {sorted(rank_of[r] for r in pending)}); see the trainer's log above"
                )
            ref = ready[0]
            if watch and ref is watch[0]:  # the buffer's process died (or it was stopped) mid-run
                self._heal_buffer(ref)
                watch = [self.buffer_watch]
                continue
            if ref in pending:
                pending.discard(ref)
                what = "trainer" if len(refs) == 1 else f"trainer rank {rank_of[ref]}"
                try:
                    out = ray.get(ref, timeout=self.cfg.run.timeout_s)  # ready: returns at once
                except ray.exceptions.RayActorError as e:  # its process died: the group is restarted
                    raise _TrainerDied(f"{what}: {_root_error(e)}") from None
                except ray.exceptions.RayError as e:  # it raised: a restart would raise the same again
                    # unless it raised because a peer rank died (gloo fails the collective at once)
                    dead = self._dead_rank(pending, rank_of)
                    if dead:
                        raise _TrainerDied(dead) from None
                    raise self._failed(what, e) from None
                if rank_of[ref] == 0:
                    m = out
                continue
            self._heal_generator(ref)
        return m

    def _dead_rank(self, pending: set, rank_of: dict, wait_s: float = 5.0) -> str:
        """A rank whose process died, among the ranks still stepping (given a few seconds to report):
        '' if none. A rank that died leaves its peers failing their collective first, on gloo."""
        import ray

        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                return f"trainer rank {rank_of[ref]}: {_root_error(e)}"
            except ray.exceptions.RayError:
                pass
        return ""

    def _heal_trainer(self, error: str) -> int:
        """A trainer rank's process died: end the whole group (the other ranks would wait in a
        collective), start a new one that resumes from the newest checkpoint in the run directory (or
        the base model), binds the same weight address, and pushes its weights to the engines at once.
        Returns the version it resumed at; the driver continues from there. Rows newer than it are
        evicted by the buffer, never trained at negative staleness."""
        import ray

        if self.cfg.rollout.engine == "sglang":
            raise StageFailed(f"{error} (a trainer with SGLang engines is not restarted yet)")
        self._count_death("trainer", error)
        log.warning("%s died; restarting the trainer from its newest checkpoint", error)
        for t in self.trainers:
            ray.kill(t, no_restart=True)
        # the dead trainer's fetch may still wait in the buffer: served, it would take a batch nobody trains
        self._wait(self.buffer.drop_fetches.remote("trainer"), "buffer")
        self.trainer = self._new_trainers(None, weights_bind=self.weights_addr, push_now=True)
        address = self._wait(self.trainer.weights_address.remote(), "trainer")
        if address != self.weights_addr:  # the port was taken meanwhile: the engines cannot follow
            raise StageFailed(f"the restarted trainer sends weights from {address}, not {self.weights_addr}")
        version = self._wait(self.trainer.version.remote(), "trainer")
        log.warning("trainer restarted at version %d", version)
        return version

    def _heal_buffer(self, watch_ref) -> None:
        """The buffer's process died: start a new one on the same directory and address (its segments
        hold every acknowledged sample). Generators resend what was not acknowledged, and the trainer
        resends its fetch; the server serves each fetch once. A buffer that was stopped, or that keeps
        dying (run.max_restarts within run.restart_window_s), or one with buffer.durable=false (nothing
        to restart from), stops the run with its name."""
        import ray

        self.buffer_watch = None
        try:
            ray.get(watch_ref, timeout=self.cfg.run.timeout_s)
            raise StageFailed("buffer stopped before the run ended")
        except ray.exceptions.RayActorError as e:
            error = _root_error(e)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise self._failed("buffer", e) from None
        if not self.cfg.buffer.durable:
            raise StageFailed(
                f"buffer failed: {error} (buffer.durable=false: no segments to restart it from)"
            )
        self._count_death("buffer", error)
        log.warning("buffer died (%s); restarting it on its directory at %s", error, self.buffer_addr)
        ray.kill(self.buffer, no_restart=True)
        address = self._new_buffer(self.buffer_addr)
        if address != self.buffer_addr:  # the port was taken meanwhile: the clients cannot follow
            raise StageFailed(
                f"buffer restarted at {address}, not at {self.buffer_addr} where its clients are"
            )

    def _count_death(self, name: str, error: str) -> None:
        """Record a death of `name`; more than run.max_restarts within run.restart_window_s stops the run."""
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(name, []) if now - t < self.cfg.run.restart_window_s] + [now]
        self.deaths[name] = deaths
        if len(deaths) > self.cfg.run.max_restarts:
            raise StageFailed(
                f"{name} died {len(deaths)} times within run.restart_window_s="
                f"{self.cfg.run.restart_window_s:.0f}s; last error: {error}"
            )

    def _heal_generator(self, ref) -> None:
        """A generator's run ended before the run did. If it raised, the run stops with its error (a
        restart would raise again). If its process died, start a new incarnation in its place, which
        connects to the trainer's weight sender and gets the current weights at once. A generator
        that dies more than `run.max_restarts` times within `run.restart_window_s` stops the run with
        its name and last error."""
        import ray

        name = self.gen_runs.pop(ref)
        i = int(name.rsplit("-", 1)[1])
        try:
            ray.get(ref, timeout=self.cfg.run.timeout_s)
            raise StageFailed(f"{name} stopped before the run ended")
        except ray.exceptions.RayActorError as e:  # the process died (killed, OOM, segfault): heal
            error = _root_error(e)
        except ray.exceptions.RayTaskError as e:  # it raised: a restart would raise the same again
            raise self._failed(name, e) from None
        if self.cfg.rollout.engine == "sglang":
            raise StageFailed(f"{name} died (SGLang generators are not restarted yet): {error}")
        self._count_death(name, error)
        log.warning(
            "%s died (%s); starting a new incarnation (%d in the window)", name, error, len(self.deaths[name])
        )
        ray.kill(self.generators[i], no_restart=True)
        try:  # a trainer that died too is restarted at the next step, with a sender that knows no engine
            ray.get(self.trainer.forget_engine.remote(self.gen_ids[i]), timeout=self.cfg.run.timeout_s)
        except ray.exceptions.RayActorError:
            pass
        except ray.exceptions.RayError as e:
            raise self._failed("trainer", e) from None
        self.generators[i] = self._new_generator(i)
        self.gen_ids[i] = self._wait(self.generators[i].ident.remote(), name)
        self.gen_runs[self.generators[i].run.remote()] = name

    def _generator_stats(self, i: int) -> dict:
        """Generator i's counters. One whose process died since the trainer step (its run() has not
        been noticed yet) is healed here, and counts nothing this step."""
        name = f"generator gen-{i}"

        def heal():
            self._heal_generator(next(r for r, n in self.gen_runs.items() if n == name))

        return self._wait(self.generators[i].stats.remote(), name, on_death=heal) or {}

    def _generator_metrics(self) -> dict:
        stats = [self._generator_stats(i) for i in range(len(self.generators))]
        out: dict = {}
        for key in (
            "samples",
            "tokens",
            "groups_started",
            "groups_finished",
            "groups_filtered",
            "groups_failed",
            "groups_aborted_stale",  # cancelled while generating: too stale to train (abort_stale_groups)
            "groups_running",
            "requests_in_flight",  # sequences the engines decode now (rollout.max_inflight_requests)
            "samples_failed",
            "admission_wait_s",
            "engine_errors",
            "engine_restarts",  # SGLang servers restarted by the generators' engine watch
        ):
            out[f"generator/{key}"] = sum(s.get(key, 0) for s in stats)
        busy = sum(s.get("engine_busy_s", 0.0) for s in stats)
        idle = sum(s.get("engine_idle_s", 0.0) for s in stats)
        if busy + idle > 0:
            out["generator/idle_share"] = idle / (busy + idle)  # since the engines started
            # the sums themselves, so that a window's share (steady state, without the start-up) can be
            # taken from two rows
            out["generator/engine_busy_s"], out["generator/engine_idle_s"] = busy, idle
        out["generator/engine_version_min"] = min(
            (s["engine_version"] for s in stats if "engine_version" in s), default=0
        )
        # dataset lines skipped as malformed (rollout.data.on_bad_line=skip), and where the data stands
        out["generator/bad_lines"] = sum(s.get("data", {}).get("bad_lines", 0) for s in stats)
        out["generator/data_epoch"] = max(s.get("data", {}).get("epoch", 0) for s in stats)
        return out

    def _rates(self, m: dict) -> None:
        """Generated and trained tokens/s since the previous step (the driver's clock)."""
        now = time.monotonic()
        gen, trained = m.get("generator/tokens", 0), m.get("tokens/total", 0.0)
        if self._last is not None:
            dt = max(now - self._last[0], 1e-9)
            m["throughput/generated_tokens_per_s"] = (gen - self._last[1]) / dt
            m["throughput/trained_tokens_per_s"] = trained / dt
        self._last = (now, gen)

    def _buffer_metrics(self) -> dict:
        # died since the step: healed now, no counters this step
        st = self._wait(
            self.buffer.stats.remote(), "buffer", on_death=lambda: self._heal_buffer(self.buffer_watch)
        )
        if st is None:
            return {}
        keys = (
            "rows",
            "complete_groups",
            "evicted_stale",
            "evicted_future",
            "evicted_groups",
            "duplicates",
            "rejected_messages",
            "reserved_mb",
            "malloc_settings",
        )
        return {f"buffer/{k}": st[k] for k in keys if isinstance(st.get(k), int | float)}

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self, failed: bool) -> dict:
        """Stop generators, finish the trainer (final checkpoint + HF export), stop the buffer."""
        import ray

        out: dict = {}
        grace = min(60.0, self.cfg.run.timeout_s)
        for g in self.generators:
            g.stop.remote()
        if self.gen_runs and not failed:
            ray.wait(list(self.gen_runs), num_returns=len(self.gen_runs), timeout=grace)
        if self.trainers and not failed:
            finish_s = finish_limit_s(self.cfg)
            try:
                refs = [t.finish.remote() for t in self.trainers]
                out = ray.get(refs, timeout=finish_s)[0]
            except ray.exceptions.GetTimeoutError:
                out["finish_error"] = (
                    f"the trainer's last push, final checkpoint and HF export did not end within {finish_s:.0f} s "
                    "(run.timeout_s, or weights.timeout_s where larger): a large model's take longer on a slow "
                    "disk; raise run.timeout_s (the last completed checkpoint stays the one a resume loads; "
                    "the HF export may be partial)"
                )
            except Exception as e:  # noqa: BLE001 - reported, the rest still shuts down
                out["finish_error"] = _root_error(e)
        closers = [g.close.remote() for g in self.generators]
        # a failed run's generators may be stuck sending to a dead buffer (their close then waits for
        # that send); they close their engines first, and are killed below anyway
        ray.wait(closers, num_returns=len(closers), timeout=min(grace, 10.0) if failed else grace)
        if self.buffer is not None:
            try:  # the buffer flushes and closes its segments: its data stays in the run directory
                ray.get(self.buffer.stop.remote(), timeout=grace)
            except Exception as e:  # noqa: BLE001
                out["buffer_error"] = _root_error(e)
        for a in [*self.generators, *self.trainers, self.buffer]:
            if a is not None:
                ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        return out


def preflight(cfg: RunConfig) -> None:
    """What can be checked before Ray starts, so that a typo fails in a second with one line instead
    of inside an actor's traceback: the model folder, the rollout hooks, and every line of a dataset file."""
    from stages.models import ModelError, resolve_model
    from stages.rollout.data import DataError, is_task, read_source
    from stages.rollout.hooks import HookError, check_hooks

    try:
        resolve_model(cfg.model)
        check_hooks(cfg.rollout)  # rollout.generate_fn / rollout_fn / filter load (a typo fails here)
    except (ModelError, HookError) as e:
        raise StageFailed(str(e)) from None
    data = cfg.rollout.data
    if data.source and not is_task(data.source):
        counters = {"bad_lines": 0}
        try:
            read_source(data.source, data, counters)
        except DataError as e:
            hint = (
                ""
                if data.on_bad_line == "skip"
                else "; or set rollout.data.on_bad_line=skip to skip bad lines"
            )
            raise StageFailed(f"rollout.data.source: {e}{hint}") from None
        if counters["bad_lines"]:
            log.warning(
                "rollout.data.source %s: %d bad line(s) will be skipped (rollout.data.on_bad_line=skip)",
                data.source,
                counters["bad_lines"],
            )


def finish_limit_s(cfg: RunConfig) -> float:
    """How long the trainer's finish (last push, final checkpoint, HF export) may take at the end of a
    run. The checkpoint writes the whole training state (a 7B model's with Adam: ~100 GB over its TP
    ranks): a stage's own limit, run.timeout_s, not a push's (the 7B runs of 2026-11-27 all ended
    "failed" at the 120 s of weights.timeout_s)."""
    return max(cfg.run.timeout_s, cfg.weights.timeout_s)


def _root_error(e: BaseException) -> str:
    """The innermost error of a Ray task failure, without Ray's wrapping."""
    cause = getattr(e, "cause", None)
    if cause is not None and cause is not e:
        return f"{type(cause).__name__}: {cause}"
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def run_pipeline(cfg: RunConfig, run_dir: Path | None = None, *, stop_ray: bool = True) -> RunResult:
    """Run one training run end to end; never leaves actors behind."""
    import ray

    run_dir = run_dir or make_run_dir(cfg)
    write_resolved(cfg, run_dir)
    t0 = time.time()
    metrics = MetricsWriter(
        run_dir,
        tensorboard=cfg.metrics.tensorboard,
        wandb_project=cfg.metrics.wandb_project,
        wandb_init={
            "entity": cfg.metrics.wandb_entity,
            "group": cfg.metrics.wandb_group,
            "mode": cfg.metrics.wandb_mode,
        },
        run_name=run_dir.name,
        config=msgspec.to_builtins(cfg),
    )
    progress = Progress(cfg.run.steps, enabled=cfg.metrics.progress)
    pipe, status, error, steps = None, "completed", "", 0
    try:
        preflight(cfg)
        start_ray(cfg)
        pipe = Pipeline(cfg, run_dir)
        pipe.start()
        steps = pipe.train(metrics, progress)
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by Ctrl-C"
    except StageFailed as e:
        status, error = "failed", str(e)
    finally:
        progress.finish()
        if pipe is not None:
            extra = pipe.shutdown(failed=status != "completed")
            if extra.get("finish_error") and status == "completed":
                status, error = "failed", f"trainer failed at the end of the run: {extra['finish_error']}"
        plot = metrics.close()
        if stop_ray and ray.is_initialized():
            ray.shutdown()
    steps = len({h["step"] for h in metrics.history})
    return RunResult(run_dir, status, steps, time.time() - t0, metrics.history, plot, error)


def print_summary(res: RunResult) -> None:
    if res.error:
        print(f"\nerror: {res.error}")
    print(summary(str(res.run_dir), res.history, res.elapsed_s, res.status))
