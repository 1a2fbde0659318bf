"""Which stage runs where: the placement group's bundles, and the GPUs each actor drives.

Ray decides the GPUs. Every GPU-using actor asks its bundle for them (`num_gpus`), so Ray picks which
GPUs of which node it gets, and the actor turns `ray.get_gpu_ids()` into the device it drives
(`local_gpus`, then `trainer_device` / `rollout_on_gpus`). The actors still see every GPU of their
node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, see actors.actor_env): NCCL between the trainer and
SGLang servers, and CUDA IPC between colocated processes, need the peers' GPUs visible.

Bundles (one placement group, PACK: as few nodes as fit):
  trainer rank bundles  {CPU 1, GPU 1} each on CUDA (tp*pp*cp*dp of them), {CPU 1} on CPU; the buffer
                        sits in the first one (it needs no CPU of its own: it mostly waits on sockets)
  generator bundles     {CPU 1, GPU engines_per_generator * rollout.sglang.tp_size} (SGLang; one GPU
                        for a torch engine on CUDA); colocated (cluster.colocate) generator i shares
                        trainer bundle i's GPU instead, half a GPU each in Ray's accounting
  plus cluster.trainer_resources in the trainer's bundles and cluster.rollout_resources in the others
  (custom Ray resources that pin the stages to nodes)

The keys follow slime's: cluster.trainer_num_nodes / trainer_gpus_per_node (--actor-num-nodes,
--actor-num-gpus-per-node), cluster.rollout_num_gpus (--rollout-num-gpus), rollout.sglang.tp_size
(--rollout-num-gpus-per-engine), cluster.colocate (--colocate).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import RunConfig


class PlacementError(RuntimeError):
    """The cluster cannot hold the run as configured; the message names the keys."""


@dataclass(frozen=True)
class Plan:
    bundles: list[dict]  # the placement group's bundles, in order
    trainer_bundles: list[int]  # bundle of each trainer actor (ranks are given after placement)
    generator_bundles: list[int]
    trainer_gpus: float  # num_gpus of each trainer actor (0, 1, or 0.5 when colocated)
    generator_gpus: float  # num_gpus of each generator actor
    trainer_device: str  # "cuda" or "cpu": what every rank runs on

    @property
    def gpus(self) -> float:
        return sum(b.get("GPU", 0) for b in self.bundles)


def trainer_on_gpu(cfg: RunConfig, cluster_gpus: float) -> bool:
    """trainer.device=auto trains on GPUs when the Ray cluster has any."""
    return cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and cluster_gpus > 0)


def engine_gpus(cfg: RunConfig) -> int:
    """GPUs one generator's engines need of their own (0: CPU engines, or colocated on the trainer's)."""
    r = cfg.rollout
    if cfg.cluster.colocate:
        return 0
    if r.engine == "sglang":
        return r.engines_per_generator * r.sglang.tp_size
    return 1 if r.device.startswith("cuda") else 0


def make_plan(cfg: RunConfig, cluster_gpus: float) -> Plan:
    tc, r = cfg.trainer, cfg.rollout
    ranks = tc.ranks
    on_gpu = trainer_on_gpu(cfg, cluster_gpus)
    colocate = cfg.cluster.colocate
    if colocate and not on_gpu:
        raise PlacementError(
            "cluster.colocate=true puts the engines on the trainer's GPUs, but the trainer runs on CPU"
        )
    n_gen = r.num_generators  # held-out evaluation runs on generator 0's engine: no bundle of its own
    trainer_bundle = {"CPU": 1 + (1 if colocate else 0), "GPU": 1} if on_gpu else {"CPU": 1}
    bundles = [dict(trainer_bundle) for _ in range(ranks)]
    if colocate:
        if n_gen > ranks:
            raise PlacementError(
                f"cluster.colocate=true: {n_gen} generators (rollout.num_generators) need a trainer GPU each, "
                f"and the trainer has {ranks} (trainer.tp*pp*cp*dp)"
            )
        for i in range(n_gen, ranks):
            bundles[i]["CPU"] = 1  # only the first n_gen trainer bundles host a generator
        gen_bundles = list(range(n_gen))
    else:
        gen_bundles = list(range(ranks, ranks + n_gen))
        bundles += [generator_bundle(cfg) for _ in range(n_gen)]  # rollout_resources included
    for b in bundles[:ranks]:  # pins to nodes (cluster.*_resources); colocated: the trainer's
        b.update(cfg.cluster.trainer_resources)
    return Plan(
        bundles=bundles,
        trainer_bundles=list(range(ranks)),
        generator_bundles=gen_bundles,
        trainer_gpus=(0.5 if colocate else 1.0) if on_gpu else 0.0,
        generator_gpus=0.5 if colocate else float(engine_gpus(cfg)),
        trainer_device="cuda" if on_gpu else "cpu",
    )


def check_offload(plan: Plan, cfg: RunConfig) -> None:
    """cluster.offload frees each side's GPU memory for the other: with engines on GPUs of their own
    that frees memory nobody takes and only lengthens every step, so a GPU trainer needs
    cluster.colocate. A CPU trainer takes turns anyway (the host's memory is what both share): the path
    the CPU tests run."""
    o = cfg.cluster.offload
    if o.on and plan.trainer_device == "cuda" and not cfg.cluster.colocate:
        keys = "/".join(k for k in ("train", "rollout") if getattr(o, k))
        raise PlacementError(
            f"cluster.offload.{keys}=true hands GPU memory between the trainer and the engines, which share "
            "GPUs only with cluster.colocate=true; set it (weights.transport=cuda_ipc for SGLang), or turn "
            "cluster.offload off for engines on GPUs of their own"
        )


def check_fits(plan: Plan, cfg: RunConfig, resources: dict, nodes: list[dict]) -> None:
    """Fail now, naming the keys and what Ray has, rather than after run.timeout_s of waiting for a
    placement group that can never be ready."""
    tc, r = cfg.trainer, cfg.rollout
    ranks = tc.ranks
    need_cpu = sum(b.get("CPU", 0) for b in plan.bundles)
    have_cpu, have_gpu = resources.get("CPU", 0), resources.get("GPU", 0)
    if have_cpu < need_cpu:
        raise PlacementError(
            f"the cluster has no room for {need_cpu:g} CPUs ({ranks} trainer rank(s) = trainer.tp*pp*cp*dp, "
            f"{r.num_generators} generator(s)); lower "
            f"rollout.num_generators or the trainer's parallel sizes, or set cluster.num_cpus (Ray has {have_cpu:g} CPUs)"
        )
    trainer_gpus = ranks if plan.trainer_device == "cuda" else 0
    rollout_gpus = plan.gpus - trainer_gpus
    if have_gpu < plan.gpus:
        raise PlacementError(
            f"the run needs {plan.gpus:g} GPUs: {trainer_gpus} for the trainer (trainer.tp*pp*cp*dp = "
            f"{tc.tp}*{tc.pp}*{tc.cp}*{tc.dp}) and {rollout_gpus:g} for the engines (rollout.num_generators="
            f"{r.num_generators} x engines_per_generator={r.engines_per_generator} x rollout.sglang.tp_size="
            f"{r.sglang.tp_size}{', colocated' if cfg.cluster.colocate else ''}); Ray has {have_gpu:g} GPUs "
            f"on {len(nodes)} node(s). Lower those keys, set cluster.colocate=true, add GPUs, or train on the CPU "
            "(trainer.device=cpu; trainer.device=auto trains on GPUs whenever the cluster has any)"
        )
    for key in {k for b in plan.bundles for k in b} - {"CPU", "GPU"}:
        need = sum(b.get(key, 0) for b in plan.bundles)
        if resources.get(key, 0) < need:
            raise PlacementError(
                f"cluster.trainer_resources / rollout_resources ask for {need:g} of the resource {key!r}, and "
                f"Ray has {resources.get(key, 0):g}: start the nodes with `ray start --resources "
                f"'{{\"{key}\": N}}'` or drop the key"
            )
    # a generator's engines are one actor's subprocesses: its GPUs must all be on one node
    per_node = max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0)
    widest = max((b.get("GPU", 0) for b in plan.bundles), default=0)
    if widest > per_node:
        raise PlacementError(
            f"one generator needs {widest:g} GPUs on one node (rollout.engines_per_generator x "
            f"rollout.sglang.tp_size), and the largest node has {per_node:g}; use more generators with "
            "fewer engines each"
        )


def generator_bundle(cfg: RunConfig) -> dict:
    """The bundle of one generator that is not colocated: its CPU, its engines' GPUs, and
    cluster.rollout_resources (make_plan's, and that of a generator added mid-run: docs/elastic.md)."""
    g = engine_gpus(cfg)
    bundle = {"CPU": 1, "GPU": g} if g else {"CPU": 1}
    bundle.update(cfg.cluster.rollout_resources)
    return bundle


def check_room(bundle: dict, count: int, available: dict) -> None:
    """Whether `count` more bundles like `bundle` fit what the cluster has free now (ray's available
    resources); else PlacementError naming what is short. A placement group the cluster cannot hold
    would wait for ever: an added generator is refused instead, and the run goes on."""
    for key, each in bundle.items():
        need, have = each * count, available.get(key, 0)
        if each and have < need:
            raise PlacementError(
                f"{count} more generator(s) need {need:g} {key} ({bundle} each) and the cluster has {have:g} "
                f"{key} free: add a node to the Ray cluster (ray start --address=...), start the run with a "
                "larger cluster.num_cpus / num_gpus for a local Ray, or ask for fewer generators"
            )


def check_tp_groups(rank_nodes: list[str], tp: int) -> None:
    """Every tensor-parallel group on one node. Megatron numbers TP fastest (ranks k*tp .. k*tp+tp-1 form
    a group, ranks in (node, GPU) order), and TP all-reduces every layer's activations: across the
    network that would be the run's bottleneck, so it is refused rather than run slowly. CP, DP and PP
    groups may span nodes."""
    for start in range(0, len(rank_nodes), tp):
        group = rank_nodes[start : start + tp]
        if len(set(group)) > 1:
            raise PlacementError(
                f"trainer ranks {start}..{start + tp - 1} form one TP group (trainer.tp={tp}) but Ray placed "
                f"them on {len(set(group))} nodes; give every trainer node a multiple of trainer.tp GPUs "
                "(cluster.trainer_gpus_per_node) or pin the trainer with cluster.trainer_resources"
            )


def local_gpus() -> list[int]:
    """This actor's GPUs (from Ray) as CUDA device indices of its process. Ray's ids are the node's;
    when the node itself was started with CUDA_VISIBLE_DEVICES, its ids are positions in that list."""
    import ray

    ids = [str(i) for i in ray.get_gpu_ids()]
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    return sorted(visible.index(i) if visible and i in visible else int(i) for i in ids)


def rollout_on_gpus(cfg: RunConfig, gpus: list[int], name: str) -> RunConfig:
    """cfg with this generator's engines on the GPUs Ray gave it: SGLang engine i on
    gpus[i*tp:(i+1)*tp] (SGLang takes a base GPU and counts up, so they must be consecutive), a torch
    engine on gpus[0]. No GPUs: cfg unchanged (CPU engines, or a run outside Ray)."""
    import msgspec

    r = cfg.rollout
    if not gpus:
        return cfg
    if r.engine == "sglang":
        if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
            raise PlacementError(
                f"{name}: Ray gave GPUs {gpus}, not consecutive; SGLang engines take consecutive GPUs from "
                "a base GPU. Use one engine per generator (rollout.engines_per_generator=1, more "
                "rollout.num_generators), or rollout.sglang.tp_size=1"
            )
        sg = msgspec.structs.replace(r.sglang, base_gpu_id=gpus[0])
        return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(r, sglang=sg))
    if r.device.startswith("cuda"):
        return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(r, device=f"cuda:{gpus[0]}"))
    return cfg


def plan_cfg(cfg: RunConfig, plan: Plan) -> RunConfig:
    """The config the trainer ranks run with: the device the plan chose, and weights.transport=auto
    made explicit for SGLang engines (CUDA IPC when colocated, NCCL to GPUs of their own). The sender's
    own auto rule counts the GPUs its process sees, which says nothing about where the engines are."""
    import msgspec

    t = msgspec.structs.replace(cfg.trainer, device=plan.trainer_device)
    w = cfg.weights
    if w.transport == "auto" and cfg.rollout.engine == "sglang":
        w = msgspec.structs.replace(w, transport="cuda_ipc" if cfg.cluster.colocate else "nccl")
    return msgspec.structs.replace(cfg, trainer=t, weights=w)
