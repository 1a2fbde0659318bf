"""One run under Ray: its stages started in order, the training loop, and the shutdown.

The driver starts the buffer, the trainer (which binds the weight transport) and the generators (which
connect to it) inside one placement group, then pulls one trainer step at a time while the generators
stream on their own. Each stage is started, and restarted when its process dies, by its supervisor
(supervisors.py); healing.py decides when. Any stage that fails stops the run with that stage's error.

`mode=async`: generators run continuously, bounded by run.max_staleness (admission control).
`mode=sync`:  the same actors with a staleness bound of 0 and the trainer waiting for each push to land,
              so each batch is generated entirely by the weights of the previous step — generate, train,
              push, repeat — and the speedup of async is measured by switching one key.
              With cluster.offload (sync only) the trainer and the engines take turns on shared GPUs,
              each step a sequence of hand-overs the driver orders (handover.py).

Generators may be added or removed between steps while the run goes (elastic.py, docs/elastic.md).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pipeline.config import RunConfig
from pipeline.orchestration.calls import Calls, root_error
from pipeline.orchestration.elastic import Scaler
from pipeline.orchestration.handover import Handover
from pipeline.orchestration.healing import Healer, TrainerDied
from pipeline.orchestration.metrics import MetricsWriter
from pipeline.orchestration.progress import Progress
from pipeline.orchestration.supervisors import BufferStage, GeneratorStage, Site, TrainerGroup

log = logging.getLogger("slipstream")

# the generators' counters the driver sums over generators into generator/<key> each step
GENERATOR_COUNTERS = (
    "samples",
    "tokens",
    "groups_started",
    "groups_finished",
    "groups_filtered",
    "groups_failed",
    "groups_aborted_stale",  # cancelled while generating: too stale to train (abort_stale_groups)
    "groups_recycled",  # interrupted as stale and continued from their tokens (rollout.partial_rollout)
    "groups_running",
    "requests_in_flight",  # sequences the engines decode now (rollout.max_inflight_requests)
    "samples_failed",
    "admission_wait_s",
    "engine_errors",
    "engine_restarts",  # SGLang servers restarted by the generators' engine watch
    # prompt tokens the engines computed (not served from a prefix cache: rollout.sglang.radix_cache)
    "engine_prefill_tokens",
)
BUFFER_COUNTERS = (
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


def finish_limit_s(cfg: RunConfig) -> float:
    """How long the trainer's finish (last push, final checkpoint, HF export) may take at the end of a
    run. The checkpoint writes the whole training state (a 7B model's with Adam: ~100 GB over its TP
    ranks): a stage's own limit, run.timeout_s, not a push's (the 7B runs of 2026-11-27 all ended
    "failed" at the 120 s of weights.timeout_s)."""
    return max(cfg.run.timeout_s, cfg.weights.timeout_s)


class Pipeline:
    """One run: the stages' supervisors, the training loop and the shutdown. Use run_pipeline() unless
    embedding."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        # cfg as the user gave it, sync mode included: each actor derives what its stage runs with
        # (pipeline.config's rollout_run, trainer_run)
        self.cfg, self.run_dir = cfg, run_dir
        self.calls = Calls(run_dir, cfg.run.timeout_s)
        self.site = Site(cfg, run_dir, self.calls)
        self.buffer_stage = BufferStage(self.site)
        self.trainer_group = TrainerGroup(self.site, self.buffer_stage)
        self.generator_stage = GeneratorStage(self.site, self.buffer_stage)
        self.healer = Healer(cfg, self.calls, self.buffer_stage, self.generator_stage, self.trainer_group)
        # cluster.offload: each step is the hand-over's turns instead of one trainer call
        self.handover = (
            Handover(cfg, self.calls, self.healer, self.generator_stage) if cfg.cluster.offload.on else None
        )
        # elastic rollout: a scale request in the run directory, handled between steps
        self.scaler = Scaler(
            cfg, self.site, self.calls, self.healer, self.generator_stage, self.trainer_group
        )
        self._last: tuple[float, int] | None = None  # (time, generated tokens) at the previous step

    # the actors, for callers that kill or query them (tests, bench/fault_run.py)
    @property
    def buffer(self):
        return self.buffer_stage.actor

    @property
    def trainer(self):  # rank 0
        return self.trainer_group.rank0

    @property
    def generators(self) -> list:
        return self.generator_stage.actors

    # -- start-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.site.place()
        self.buffer_stage.start()
        if (
            self.cfg.rollout.engine == "sglang"
        ):  # servers first: the trainer's transport needs their addresses
            self.generator_stage.start(weights_address=None)
            if self.handover:  # the trainer's state needs the GPUs the servers just took
                self.handover.release_engines()
            self.trainer_group.start(engine_urls=self.generator_stage.engine_urls())
            if self.trainer_group.weights_address:  # weights.transport cpu: pushes go through the generators
                self.generator_stage.connect_weights(self.trainer_group.weights_address)
        else:  # the trainer binds the weight transport first; torch engines connect to it
            self.trainer_group.start()
            self.generator_stage.start(weights_address=self.trainer_group.weights_address)
            if self.handover:
                self.handover.release_engines()
        if self.handover:  # the engines' first weights, pushed; the trainer's state out
            self.handover.to_generate(step=0)
        self._record_placement()
        self.generator_stage.run()

    def _record_placement(self) -> None:
        """<run dir>/placement.json: where each stage runs (node, GPUs) and the addresses they use."""
        wait, gens = self.calls.wait, self.generator_stage
        record = {
            "trainer": self.trainer_group.where,
            "buffer": wait(self.buffer.where.remote(), "buffer"),
            "generators": [wait(g.where.remote(), gens.name(i)) for i, g in enumerate(gens.actors)],
            "bundles": self.site.plan.bundles,
            "addresses": {"buffer": self.buffer_stage.address, "weights": self.trainer_group.weights_address},
            "curve": self.site.curve is not None,
        }
        (self.run_dir / "placement.json").write_text(json.dumps(record, indent=1))

    # -- the loop ----------------------------------------------------------------------------------
    def train(self, metrics: MetricsWriter, progress: Progress) -> int:
        """Run cfg.run.steps trainer steps; returns the number of steps done."""
        import ray

        cfg = self.cfg
        # run.steps is the total: a run resumed from a checkpoint at version v trains steps v+1 .. run.steps
        start = self.calls.wait(self.trainer.version.remote(), "trainer")
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
            self.scaler.poll(step)  # before the step: an added generator's groups can count for it
            step += 1
            try:
                m = self.handover.step(step) if self.handover else self.healer.step(step)
            except TrainerDied as e:  # restarted from its newest checkpoint: continue from there
                step = self._heal_trainer(e.error)
                metrics.resume_at(step)
                continue
            m["run/restarts"] = self.healer.restarts
            m.update(self._generator_metrics())
            m.update(self._buffer_metrics())
            self._rates(m)
            if eval_ref is not None and ray.wait([eval_ref], timeout=0)[0]:
                # a generator that died mid-evaluation is healed by the generator watch: skip this one
                m.update(self.calls.wait(eval_ref, "evaluation", on_death=lambda: None) or {})
                eval_ref = None
            if cfg.eval.every_steps and eval_ref is None and step % cfg.eval.every_steps == 0:
                eval_ref = self.generators[0].evaluate.remote(step)  # on its engine, beside generation
            metrics.log(step, m)
            progress.update(step, m)
        if eval_ref is not None:
            m = self.calls.wait(eval_ref, "evaluation", on_death=lambda: None)
            if m:
                metrics.log(step, m)
        return step

    def _heal_trainer(self, error: str) -> int:
        """A new trainer group from the newest checkpoint; with offload the same turns as at start-up
        around it (the engines release before its state is built, then get its weights)."""
        if self.handover:
            self.handover.release_engines()
        step = self.healer.heal_trainer(error)
        if self.handover:
            self.handover.to_generate(step)
        return step

    def _generator_metrics(self) -> dict:
        stats = [self.healer.generator_stats(i) for i in range(len(self.generators))]
        out: dict = {f"generator/{key}": sum(s.get(key, 0) for s in stats) for key in GENERATOR_COUNTERS}
        # the sums above are over the generators running now: one removed takes its counts with it
        out["generators/count"] = len(stats)
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
        st = self.healer.buffer_stats()  # died since the step: healed now, no counters this step
        if st is None:
            return {}
        return {f"buffer/{k}": st[k] for k in BUFFER_COUNTERS if isinstance(st.get(k), int | float)}

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self, failed: bool) -> dict:
        """Stop generators, finish the trainer (final checkpoint + HF export), stop the buffer."""
        import ray

        out: dict = {}
        grace = min(60.0, self.cfg.run.timeout_s)
        generators, runs, ranks = self.generators, self.generator_stage.runs, self.trainer_group.ranks
        for g in generators:
            g.stop.remote()
        if runs and not failed:
            ray.wait(list(runs), num_returns=len(runs), timeout=grace)
        if self.handover and ranks and not failed and self.cfg.trainer.save_at_end:
            try:  # the trainer's final checkpoint takes its whole state back onto the GPUs
                self.handover.release_engines()
            except Exception as e:  # noqa: BLE001 - reported; the finish below says what it could do
                out["offload_error"] = root_error(e)
        if ranks and not failed:
            finish_s = finish_limit_s(self.cfg)
            try:
                refs = [t.finish.remote() for t in ranks]
                out = ray.get(refs, timeout=finish_s)[0]
            except ray.exceptions.GetTimeoutError:
                out["finish_error"] = (
                    f"the trainer's last push, final checkpoint and HF export did not end within {finish_s:.0f} s "
                    "(run.timeout_s, or weights.timeout_s where larger): a large model's take longer on a slow "
                    "disk; raise run.timeout_s (the last completed checkpoint stays the one a resume loads; "
                    "the HF export may be partial)"
                )
            except Exception as e:  # noqa: BLE001 - reported, the rest still shuts down
                out["finish_error"] = root_error(e)
        closers = [g.close.remote() for g in generators]
        # a failed run's generators may be stuck sending to a dead buffer (their close then waits for
        # that send); they close their engines first, and are killed below anyway
        ray.wait(closers, num_returns=len(closers), timeout=min(grace, 10.0) if failed else grace)
        if self.buffer is not None:
            try:  # the buffer flushes and closes its segments: its data stays in the run directory
                ray.get(self.buffer.stop.remote(), timeout=grace)
            except Exception as e:  # noqa: BLE001
                out["buffer_error"] = root_error(e)
        for a in [*generators, *ranks, self.buffer]:
            if a is not None:
                ray.kill(a)
        self.generator_stage.release_placements()  # those of generators added mid-run
        if self.site.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.site.pg)
        return out
