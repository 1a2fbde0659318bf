"""Healing: noticing that a stage's process died and restarting it through its supervisor.

The driver waits on a trainer step and, beside it, on every generator's run() and the buffer's watch,
so it notices at once whichever dies (`Healer.step`). A stage whose process died (killed, OOM,
segfault) is restarted through its supervisor (supervisors.py), the same code that started it; a
stage that *raised* stops the run with its error (a restart would raise the same again), and so does
one that dies more than run.max_restarts times within run.restart_window_s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pipeline.orchestration.calls import StageFailed, root_error

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.orchestration.calls import Calls
    from pipeline.orchestration.supervisors import BufferStage, GeneratorStage, TrainerGroup

log = logging.getLogger("slipstream")


class TrainerDied(Exception):
    """A trainer rank's process died mid-step (the driver restarts the group)."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


class Healer:
    """The run's stages, watched: each death is counted against the restart budget, then healed."""

    def __init__(
        self,
        cfg: RunConfig,
        calls: Calls,
        buffer: BufferStage,
        generators: GeneratorStage,
        trainer: TrainerGroup,
    ):
        self.cfg, self.calls = cfg, calls
        self.buffer, self.generators, self.trainer = buffer, generators, trainer
        self.deaths: dict[str, list[float]] = {}  # stage name -> times it died (healing budget)

    @property
    def restarts(self) -> int:
        return sum(len(v) for v in self.deaths.values())

    def count_death(self, name: str, error: str) -> None:
        """Record a death of `name`; more than run.max_restarts within run.restart_window_s stops the run."""
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(name, []) if now - t < self.cfg.run.restart_window_s] + [now]
        self.deaths[name] = deaths
        if len(deaths) > self.cfg.run.max_restarts:
            raise StageFailed(
                f"{name} died {len(deaths)} times within run.restart_window_s="
                f"{self.cfg.run.restart_window_s:.0f}s; last error: {error}"
            )

    # -- the watch ---------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        """One step on every trainer rank; rank 0's metrics."""
        return self.on_ranks(step, "step")

    def on_ranks(self, step: int, method: str) -> Any:
        """`method` of TrainerActor on every rank (a step, or a turn of the hand-over: handover.py);
        rank 0's answer. Notices at once when a generator or any rank dies (the other ranks would
        otherwise wait in a collective until its timeout)."""
        import ray

        timeout_s = self.cfg.run.timeout_s
        refs = [getattr(t, method).remote() for t in self.trainer.ranks]
        rank_of = {ref: k for k, ref in enumerate(refs)}
        pending, m = set(refs), None
        watch = [self.buffer.watch] if self.buffer.watch is not None else []
        while pending:
            ready, _ = ray.wait([*pending, *self.generators.runs, *watch], num_returns=1, timeout=timeout_s)
            if not ready:
                call = "step" if method == "step" else f"{method} of step"
                raise StageFailed(
                    f"trainer {call} {step} did not finish within run.timeout_s={timeout_s:.0f}s "
                    f"(ranks still running: {sorted(rank_of[r] for r in pending)}); see the trainer's log above"
                )
            ref = ready[0]
            if watch and ref is watch[0]:  # the buffer's process died (or it was stopped) mid-run
                self.heal_buffer(ref)
                watch = [self.buffer.watch]
                continue
            if ref in pending:
                pending.discard(ref)
                what = "trainer" if len(refs) == 1 else f"trainer rank {rank_of[ref]}"
                try:
                    out = ray.get(ref, timeout=timeout_s)  # ready: returns at once
                except ray.exceptions.RayActorError as e:  # its process died: the group is restarted
                    raise TrainerDied(f"{what}: {root_error(e)}") from None
                except ray.exceptions.RayError as e:  # it raised: a restart would raise the same again
                    # unless it raised because a peer rank died (gloo fails the collective at once)
                    dead = self._dead_rank(pending, rank_of)
                    if dead:
                        raise TrainerDied(dead) from None
                    raise self.calls.failed(what, e) from None
                if rank_of[ref] == 0:
                    m = out
                continue
            self.heal_generator(ref)
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
                return f"trainer rank {rank_of[ref]}: {root_error(e)}"
            except ray.exceptions.RayError:
                pass
        return ""

    # -- restarts ----------------------------------------------------------------------------------
    def _refuse_sglang_with_offload(self, name: str, error: str) -> None:
        """SGLang stages of a run with cluster.offload are not restarted: a new server or trainer would
        come up beside the other side's whole state in the middle of a turn (out of memory, or a KV
        cache sized from what that left), and the hand-over's turns would have to take it in."""
        if self.cfg.rollout.engine == "sglang" and self.cfg.cluster.offload.on:
            raise StageFailed(
                f"{name} died: {error} (a run with SGLang engines and cluster.offload is not healed yet; "
                "it resumes from its checkpoint when started again in its run directory)"
            )

    def heal_trainer(self, error: str) -> int:
        """A trainer rank's process died: restart the whole group from the newest checkpoint in the run
        directory (or the base model). Returns the version it resumed at; the driver continues from
        there. Rows newer than it are evicted by the buffer, never trained at negative staleness.
        SGLang servers keep generating meanwhile; the new group pushes to the same URLs at once (a server
        the dead one left paused mid-push takes that push whole and continues; NCCL pushes form a weight
        group of a new name with them)."""
        self._refuse_sglang_with_offload("trainer", error)
        self.count_death("trainer", error)
        log.warning("%s died; restarting the trainer from its newest checkpoint", error)
        version = self.trainer.restart()
        log.warning("trainer restarted at version %d", version)
        return version

    def heal_buffer(self, watch_ref: Any) -> None:
        """The buffer's process died: start a new one on the same directory and address (its segments
        hold every acknowledged sample). Generators resend what was not acknowledged, and the trainer
        resends its fetch; the server serves each fetch once. A buffer that was stopped, or that keeps
        dying (run.max_restarts within run.restart_window_s), or one with buffer.durable=false (nothing
        to restart from), stops the run with its name."""
        import ray

        self.buffer.watch = None
        try:
            ray.get(watch_ref, timeout=self.cfg.run.timeout_s)
            raise StageFailed("buffer stopped before the run ended")
        except ray.exceptions.RayActorError as e:
            error = root_error(e)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise self.calls.failed("buffer", e) from None
        if not self.cfg.buffer.durable:
            raise StageFailed(
                f"buffer failed: {error} (buffer.durable=false: no segments to restart it from)"
            )
        self.count_death("buffer", error)
        log.warning("buffer died (%s); restarting it on its directory at %s", error, self.buffer.address)
        self.buffer.restart()

    def heal_generator(self, ref: Any) -> None:
        """A generator's run ended before the run did. If it raised, the run stops with its error (a
        restart would raise again). If its process died, start a new incarnation in its place, which
        connects to the trainer's weight sender and gets the current weights at once. A generator
        that dies more than `run.max_restarts` times within `run.restart_window_s` stops the run with
        its name and last error."""
        import ray

        name = self.generators.runs.pop(ref)
        i = int(name.rsplit("-", 1)[1])
        try:
            ray.get(ref, timeout=self.cfg.run.timeout_s)
            raise StageFailed(f"{name} stopped before the run ended")
        except ray.exceptions.RayActorError as e:  # the process died (killed, OOM, segfault): heal
            error = root_error(e)
        except ray.exceptions.RayTaskError as e:  # it raised: a restart would raise the same again
            raise self.calls.failed(name, e) from None
        self._refuse_sglang_with_offload(name, error)
        self.count_death(name, error)
        log.warning(
            "%s died (%s); starting a new incarnation (%d in the window)", name, error, len(self.deaths[name])
        )
        # pushes stop waiting for the dead engine (its process is gone already: nothing can reconnect
        # under its id). A trainer that died too is restarted at the next step, with a sender that
        # knows no engine. Its SGLang servers are ended and started again at the same URLs (restart).
        try:
            ray.get(
                self.trainer.rank0.forget_engine.remote(self.generators.ids[i]),
                timeout=self.cfg.run.timeout_s,
            )
        except ray.exceptions.RayActorError:
            pass
        except ray.exceptions.RayError as e:
            raise self.calls.failed("trainer", e) from None
        self.generators.restart(i)

    def heal_generator_at(self, i: int) -> None:
        """Generator i's process died (noticed by a call other than its run()): heal it."""
        name = self.generators.name(i)
        run = next((r for r, n in self.generators.runs.items() if n == name), None)
        if run is None:  # at start-up (its run not begun): nothing to continue from
            raise StageFailed(f"{name} died before the run began")
        self.heal_generator(run)

    def generator_stats(self, i: int) -> dict:
        """Generator i's counters. One whose process died since the trainer step (its run() has not
        been noticed yet) is healed here, and counts nothing this step."""
        name = self.generators.name(i)
        heal = lambda: self.heal_generator_at(i)  # noqa: E731 - a callback, named for the call below
        return self.calls.wait(self.generators.actors[i].stats.remote(), name, on_death=heal) or {}

    def buffer_stats(self) -> dict | None:
        """The buffer's counters; None when its process died since the step (healed now)."""
        return self.calls.wait(
            self.buffer.actor.stats.remote(), "buffer", on_death=lambda: self.heal_buffer(self.buffer.watch)
        )
