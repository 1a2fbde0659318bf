"""Elastic rollout: generators added to or removed from a run while it goes (docs/elastic.md).

A request is a file in the run directory, `scale.request.json` ({"generators": N}), which
`bin/run-pipeline scale RUN_DIR --generators N` writes atomically (a temporary file renamed over it).
The driver looks for it between trainer steps (`Scaler.poll`), takes it (renamed away, so a request
written meanwhile is the next one, never lost), and answers in `scale.status.json` with the request's
id: applied, refused (why, and what to do), unchanged, or malformed (the file is kept as
`scale.request.rejected.json`). Nothing in a request can stop the run.

Scaling runs on the driver's thread, between steps, like healing: a generator that died is healed
before the request is read or, dying during it, by the same calls (`on_death`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pipeline.orchestration.placement import PlacementError
from pipeline.orchestration.supervisors import shares_of

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.orchestration.calls import Calls
    from pipeline.orchestration.healing import Healer
    from pipeline.orchestration.supervisors import GeneratorStage, Site, TrainerGroup

log = logging.getLogger("slipstream")

REQUEST_FILE = "scale.request.json"
STATUS_FILE = "scale.status.json"
REJECTED_FILE = "scale.request.rejected.json"
PLACE_S = 60.0  # an added generator's bundle is placed within this long, or the request is refused


class ScaleRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    generators: int  # how many generators the run is to have
    id: str = ""  # the requester's, echoed in the status so that it knows the answer is its own


class ScaleStatus(msgspec.Struct, kw_only=True):
    id: str
    outcome: str  # "applied" | "unchanged" | "refused" | "malformed"
    generators: int  # how many the run has now
    step: int  # the last trainer step before the request was handled
    message: str


def write_request(run_dir: str | Path, generators: int) -> ScaleRequest:
    """The request, written so that the driver reads either none or all of it (rename is atomic)."""
    req = ScaleRequest(generators=generators, id=uuid.uuid4().hex[:12])
    path = Path(run_dir) / REQUEST_FILE
    tmp = path.with_name(f"{REQUEST_FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(req))
    os.replace(tmp, path)
    return req


def read_status(run_dir: str | Path) -> ScaleStatus | None:
    try:
        return msgspec.json.decode((Path(run_dir) / STATUS_FILE).read_bytes(), type=ScaleStatus)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def wait_status(run_dir: str | Path, request_id: str, timeout_s: float) -> ScaleStatus | None:
    """The driver's answer to request `request_id`; None if none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = read_status(run_dir)
        if st is not None and st.id == request_id:
            return st
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def take_request(run_dir: Path) -> ScaleRequest | str | None:
    """The pending request, taken out of the directory; an error message for a malformed one (its file
    kept as REJECTED_FILE); None when there is none."""
    path, taken = run_dir / REQUEST_FILE, run_dir / f"{REQUEST_FILE}.taken"
    try:
        os.replace(path, taken)  # a request written from now on is a new file: the next one
    except FileNotFoundError:
        return None
    raw = taken.read_bytes()
    try:
        req = msgspec.json.decode(raw, type=ScaleRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        os.replace(taken, run_dir / REJECTED_FILE)
        return (
            f"scale request {path} is malformed ({e}); ignored, the run goes on unchanged. Write it with "
            f"`bin/run-pipeline scale {run_dir} --generators N`, or as the JSON object "
            f'{{"generators": N}}; the rejected file is kept as {run_dir / REJECTED_FILE}'
        )
    taken.unlink()
    return req


class Scaler:
    """The driver's side: `poll(step)` between steps handles the pending request, if any."""

    def __init__(
        self,
        cfg: RunConfig,
        site: Site,
        calls: Calls,
        healer: Healer,
        generators: GeneratorStage,
        trainer: TrainerGroup,
    ):
        self.cfg, self.site, self.calls, self.healer = cfg, site, calls, healer
        self.generators, self.trainer = generators, trainer

    def poll(self, step: int) -> ScaleStatus | None:
        req = take_request(self.site.run_dir)
        if req is None:
            return None
        n = len(self.generators.actors)
        if isinstance(req, str):
            log.warning("%s", req)
            return self._answer(ScaleStatus(id="", outcome="malformed", generators=n, step=step, message=req))
        why = self.refusal(req.generators)
        if why:
            msg = f"scale request to {req.generators} generator(s) refused, the run goes on with {n}: {why}"
            log.warning("%s", msg)
            status = ScaleStatus(id=req.id, outcome="refused", generators=n, step=step, message=msg)
            return self._answer(status)
        if req.generators == n:
            msg = f"the run has {n} generator(s) already"
            return self._answer(
                ScaleStatus(id=req.id, outcome="unchanged", generators=n, step=step, message=msg)
            )
        try:
            how = self._grow(req.generators) if req.generators > n else self._shrink(req.generators)
        except PlacementError as e:  # no room for an added generator: nothing was started
            msg = f"scale request to {req.generators} generator(s) refused, the run goes on with {n}: {e}"
            log.warning("%s", msg)
            status = ScaleStatus(id=req.id, outcome="refused", generators=n, step=step, message=msg)
            return self._answer(status)
        msg = (
            f"generators: {n} -> {req.generators} after step {step} ({how}); shares {self.generators.shares}"
        )
        log.warning("%s", msg)
        status = ScaleStatus(id=req.id, outcome="applied", generators=req.generators, step=step, message=msg)
        return self._answer(status)

    def refusal(self, n: int) -> str:
        """Why the run cannot have `n` generators ('' if it can), saying what to do instead."""
        cfg, bg = self.cfg, self.cfg.trainer.batch_groups
        restart = f"stop the run and start it again in its directory (it resumes from its checkpoint) with rollout.num_generators={n}"
        if not 1 <= n <= bg:
            return (
                f"each generator needs at least one group of every trainer batch (trainer.batch_groups={bg}): "
                f"ask for 1 to {bg} generators"
            )
        if cfg.cluster.offload.on:
            return (
                "cluster.offload is on: every step hands the GPUs between the trainer and all generators' "
                "engines in turns (handover.py), and a generator joining or leaving between those turns "
                f"would hold memory the trainer's turn needs; {restart}"
            )
        if cfg.rollout.engine == "sglang" and cfg.weights.transport != "cpu":
            return (
                f"rollout.engine=sglang with weights.transport={cfg.weights.transport}: the trainer pushes into "
                "the SGLang servers it was started with, so a server added later would never get weights "
                "and pushes to a removed one would fail; with weights.transport=cpu each generator takes the "
                f"pushes itself and generators come and go; or {restart}"
            )
        if cfg.cluster.colocate:
            return (
                "cluster.colocate=true: generator i shares trainer rank i's GPU, fixed when the run was "
                f"placed; {restart}"
            )
        return ""

    def _grow(self, n: int) -> str:
        """Existing generators take their smaller shares first, then the new ones join with theirs:
        never more than one window's worth admitted at once. Raises PlacementError before starting any
        when the cluster has no room."""
        gens = self.generators
        old, own = len(gens.actors), len(self.site.plan.generator_bundles)
        # an index that had a bundle in the run's own group at start gets it back; the others need room
        beyond = max(0, n - max(old, own))
        pgs = self.site.reserve_generators(beyond, PLACE_S) if beyond else []
        gens.shares = shares_of(self.cfg.trainer.batch_groups, n)
        self._reshare(old)
        for i in range(old, n):
            gens.add(pgs.pop(0) if i >= own else None)
        self.trainer.expect_engines(n)  # a trainer restarted later waits for every engine
        return f"added {', '.join(gens.ids[old:])}"

    def _shrink(self, n: int) -> str:
        """The last generators leave one by one (drained: their groups in flight are streamed; pushes
        stop waiting for their engines first), then the others take the larger shares."""
        gens, left = self.generators, []
        self.trainer.expect_engines(n)
        while len(gens.actors) > n:
            gid, how = gens.remove_last(drain_s=self.cfg.run.timeout_s)
            # a push in progress stops waiting for it (its bye usually said so already)
            if self.trainer.rank0 is not None:
                self.calls.wait(
                    self.trainer.rank0.forget_engine.remote(gid), "trainer", on_death=lambda: None
                )
            left.append(f"{gid} {how}")
        gens.shares = shares_of(self.cfg.trainer.batch_groups, n)
        self._reshare(n)
        return f"removed {'; '.join(left)}"

    def _reshare(self, count: int) -> None:
        """Generators 0..count-1 take their shares in `generators.shares`; one that died meanwhile is
        healed (a new incarnation starts with its new share)."""
        gens = self.generators
        for i in range(count):
            heal = lambda i=i: self.healer.heal_generator_at(i)  # noqa: E731 - the call's on_death
            self.calls.wait(gens.actors[i].set_share.remote(gens.shares[i]), gens.name(i), on_death=heal)

    def _answer(self, status: ScaleStatus) -> ScaleStatus:
        path = self.site.run_dir / STATUS_FILE
        tmp = path.with_name(f"{STATUS_FILE}.tmp")
        tmp.write_bytes(msgspec.json.encode(status))
        os.replace(tmp, path)
        return status
