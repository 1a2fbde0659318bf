"""Colocated offload (cluster.offload, run.mode=sync): the trainer and the engines take turns on the same
GPUs, each handing its memory back while the other works. The driver orders every move, with a typed
call on each side's actors, in one place (slime's train.py: generate, offload rollout, train, offload
train, onload rollout weights, update weights, onload rollout KV cache):

    generate phase   the engines generate the next batch; the trainer's state is on the host
      fetch          trainer ranks: the batch, once generated (TrainerActor.fetch)
    hand-over 1      generators: release weights + KV cache, once no request is in flight
                     (GeneratorActor.release_memory; offload.rollout)
    train phase      trainer ranks: state back, one step, checkpoint when due, then gradients and
                     optimizer state handed back at once (TrainerActor.train_turn; offload.train)
    hand-over 2      generators: wake the weights (GeneratorActor.resume_memory([weights]))
                     trainer ranks: push them the new weights and wait until they are applied, then
                     hand their weights back too (TrainerActor.push_turn)
                     generators: wake the KV cache; generation goes on

So at no moment does a GPU hold both sides' full state: at the push it holds the trainer's weights
(its gradients and optimizer state gone) and the engines' weights, without their KV cache. Start-up
and a restarted trainer take the same path: the engines release before the trainer's state is built,
and hand-over 2 gives them their first weights (SGLang's released weights hold nothing until pushed;
with LoRA, whose pushes leave the unadapted weights out, SGLang keeps its weights: `engine_tags`).

Every wait is bounded: the calls by run.timeout_s (longer where cluster.offload.timeout_s is), and
inside them a release waits cluster.offload.timeout_s for the requests in flight, naming them when it
gives up; a wake that cannot get its memory back names who holds the GPU (stages/host_copy.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pipeline.orchestration.turns import Turn, total
from stages.rollout.offload import KV_CACHE, TAGS, WEIGHTS

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.orchestration.calls import Calls
    from pipeline.orchestration.healing import Healer
    from pipeline.orchestration.supervisors import GeneratorStage


def engine_tags(cfg: RunConfig) -> list[str]:
    """What the engines hand back while the trainer steps. SGLang with LoRA keeps its weights and releases
    only its KV cache: a released weight comes back empty (SGLang 0.5.17 keeps no copy), and LoRA pushes
    send only the adapted tensors, so the embeddings, norms and LM head would never be written again (the
    torch engine's release keeps a host copy, so it releases both)."""
    if not cfg.cluster.offload.rollout:
        return []
    if cfg.rollout.engine == "sglang" and cfg.trainer.lora.rank:
        return [KV_CACHE]
    return list(TAGS)


class Handover:
    """The driver's side: each step's turns (`step`), and the engines' release before a trainer's state
    is built (`release_engines`, at start-up and before a restarted trainer) with the hand-over that
    gives them their weights (`to_generate`)."""

    def __init__(self, cfg: RunConfig, calls: Calls, healer: Healer, generators: GeneratorStage):
        self.offload = cfg.cluster.offload
        self.tags = engine_tags(cfg)
        self.calls, self.healer, self.generators = calls, healer, generators
        # a call waits for its own bounded waits inside, and a little more
        self.wait_s = max(cfg.run.timeout_s, self.offload.timeout_s + 60.0)

    def step(self, step: int) -> dict:
        """One sync step as turns; the step's metrics (rank 0's, the hand-overs' figures added)."""
        t0 = time.perf_counter()
        wait = self.healer.on_ranks(step, "fetch")
        m = self._release_metrics(self.release_engines())
        m.update(self.healer.on_ranks(step, "train_turn"))
        m.update(self.to_generate(step))
        m["time/data_wait_s"] = wait
        m["time/step_s"] = time.perf_counter() - t0  # the whole cycle: generate, turns, train, push
        return m

    def release_engines(self) -> list[Turn]:
        return self._on_generators("release_memory", self.tags)

    def to_generate(self, step: int) -> dict:
        """Hand-over 2: the engines' weights, the push, the trainer's weights out, the engines' KV cache."""
        woke = self._on_generators("resume_memory", [t for t in self.tags if t == WEIGHTS])
        m = self.healer.on_ranks(step, "push_turn")
        woke2 = self._on_generators("resume_memory", [t for t in self.tags if t == KV_CACHE])
        m["onload/rollout_s"] = max(a.seconds + b.seconds for a, b in zip(woke, woke2))
        return m

    def _release_metrics(self, turns: list[Turn]) -> dict:
        m = {"offload/rollout_s": max(t.seconds for t in turns)}
        before, after = total([t.bytes_before for t in turns]), total([t.bytes_after for t in turns])
        if before is not None and after is not None:  # the phase that ended, the phase that begins
            m["memory/rollout_gb/generate"], m["memory/rollout_gb/train"] = before / 1e9, after / 1e9
        return m

    def _on_generators(self, method: str, tags: list[str]) -> list[Turn]:
        """`method(tags)` on every generator at once. One whose process died meanwhile is healed (a new
        incarnation, awake) and takes the call too; one that raised stops the run with its error."""
        gens = self.generators
        refs = [getattr(g, method).remote(tags) for g in gens.actors]
        out = []
        for i, ref in enumerate(refs):
            turn = self.calls.wait(
                ref,
                gens.name(i),
                on_death=lambda i=i: self.healer.heal_generator_at(i),
                timeout_s=self.wait_s,
            )
            if turn is None:
                turn = self.calls.wait(
                    getattr(gens.actors[i], method).remote(tags), gens.name(i), timeout_s=self.wait_s
                )
            out.append(turn)
        return out
