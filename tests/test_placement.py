"""GPUs come from Ray: the placement plan for a config, the clear error when the cluster lacks what a
config asks for, and (on a Ray with logical GPUs, no CUDA needed) the GPUs each trainer rank and each
generator's engines actually get: every engine on GPUs of its own, across generators."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.orchestration.placement import PlacementError, check_fits, check_tp_groups, make_plan, plan_cfg

SGLANG = ["rollout.engine=sglang", "trainer.device=cuda", "trainer.batch_groups=8"]


def _cfg(*extra):
    return load_config(None, list(extra))


def test_cpu_default_asks_ray_for_no_gpu():
    plan = make_plan(_cfg(), cluster_gpus=0)
    assert plan.gpus == 0 and plan.trainer_device == "cpu" and plan.generator_gpus == 0
    assert plan.bundles == [{"CPU": 1}, {"CPU": 1}]  # trainer rank 0 (+ buffer), generator 0


def test_disaggregated_plan_gives_each_rank_one_gpu_and_each_generator_its_engines():
    cfg = _cfg(*SGLANG, "trainer.tp=2", "rollout.num_generators=2", "rollout.engines_per_generator=2")
    plan = make_plan(cfg, cluster_gpus=6)
    assert [b.get("GPU", 0) for b in plan.bundles] == [1, 1, 2, 2]
    assert plan.trainer_bundles == [0, 1] and plan.generator_bundles == [2, 3]
    assert (plan.trainer_gpus, plan.generator_gpus) == (1.0, 2.0)
    assert plan_cfg(cfg, plan).weights.transport == "nccl"  # auto made explicit: engines on other GPUs


def test_colocated_generators_share_the_trainer_gpus():
    cfg = _cfg(*SGLANG, "trainer.dp=2", "rollout.num_generators=2", "cluster.colocate=true")
    plan = make_plan(cfg, cluster_gpus=2)
    assert plan.gpus == 2 and plan.generator_bundles == [0, 1]
    assert plan.trainer_gpus == plan.generator_gpus == 0.5
    assert plan_cfg(cfg, plan).weights.transport == "cuda_ipc"


def test_a_cluster_without_the_gpus_is_named_with_the_keys_and_what_ray_has():
    cfg = _cfg(*SGLANG, "trainer.tp=2", "rollout.num_generators=2", "rollout.engines_per_generator=2")
    plan = make_plan(cfg, cluster_gpus=4)
    nodes = [{"Resources": {"GPU": 4, "CPU": 16}}]
    with pytest.raises(PlacementError) as e:
        check_fits(plan, cfg, {"CPU": 16, "GPU": 4}, nodes)
    msg = str(e.value)
    assert "needs 6 GPUs" in msg and "Ray has 4 GPUs on 1 node(s)" in msg
    assert "trainer.tp*pp*cp*dp" in msg and "rollout.num_generators" in msg
    # 8 GPUs over two nodes of 4: a generator's 4 engines x tp 2 cannot span nodes
    cfg = _cfg(*SGLANG, "rollout.engines_per_generator=4", "rollout.sglang.tp_size=2")
    with pytest.raises(PlacementError, match="one generator needs 8 GPUs on one node"):
        check_fits(make_plan(cfg, 9), cfg, {"CPU": 16, "GPU": 9}, [{"Resources": {"GPU": 4.5}}] * 2)


def test_slime_style_keys_derive_dp_and_reject_what_disagrees():
    cfg = _cfg("cluster.trainer_num_nodes=2", "cluster.trainer_gpus_per_node=4", "trainer.tp=2")
    assert cfg.trainer.dp == 4  # 8 GPUs / tp 2
    with pytest.raises(ConfigError, match="trainer_gpus_per_node = 8 trainer GPUs"):
        _cfg("cluster.trainer_num_nodes=2", "cluster.trainer_gpus_per_node=4", "trainer.tp=2", "trainer.dp=2")
    with pytest.raises(ConfigError, match="cluster.rollout_num_gpus=4.*= 2 GPUs"):
        _cfg(*SGLANG, "cluster.rollout_num_gpus=4", "rollout.sglang.tp_size=2")
    with pytest.raises(ConfigError, match="cluster.colocate=true"):
        _cfg(*SGLANG, "weights.transport=cuda_ipc")


@pytest.fixture(scope="module")
def ray_with_gpus():
    """A local Ray that advertises 6 logical GPUs: Ray assigns them like real ones, no CUDA needed."""
    ray = pytest.importorskip("ray")
    from pipeline.orchestration.launcher import start_ray

    if ray.is_initialized():
        ray.shutdown()
    start_ray(_cfg("cluster.num_cpus=8", "cluster.num_gpus=6"))
    yield ray
    ray.shutdown()


def test_ray_gives_every_rank_and_every_engine_gpus_of_its_own(ray_with_gpus):
    ray = ray_with_gpus
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pipeline.orchestration.actors import TrainerActor
    from pipeline.orchestration.placement import local_gpus, rollout_on_gpus

    cfg = _cfg(*SGLANG, "trainer.tp=2", "rollout.num_generators=2", "rollout.engines_per_generator=2")
    plan = make_plan(cfg, cluster_gpus=6)
    check_fits(plan, cfg, ray.cluster_resources(), [n for n in ray.nodes() if n["Alive"]])
    pg = placement_group(plan.bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=60)

    def on(i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    @ray.remote
    def engine_gpus(name):
        # what GeneratorActor does first: its engines on the GPUs Ray gave it
        c = rollout_on_gpus(cfg, local_gpus(), name)
        return local_gpus(), c.rollout.sglang.base_gpu_id

    try:
        ranks = [
            TrainerActor.options(num_gpus=plan.trainer_gpus, scheduling_strategy=on(b)).remote(2)
            for b in plan.trainer_bundles
        ]
        trainer = [ray.get(a.where.remote(), timeout=60)["gpus"] for a in ranks]
        gens = [
            ray.get(
                engine_gpus.options(num_gpus=plan.generator_gpus, scheduling_strategy=on(b)).remote(
                    f"gen-{i}"
                ),
                timeout=60,
            )
            for i, b in enumerate(plan.generator_bundles)
        ]
        for a in ranks:
            ray.kill(a)
    finally:
        remove_placement_group(pg)
    assert all(len(g) == 1 for g in trainer)
    engine = [g for gpus, _ in gens for g in gpus]
    used = [g for t in trainer for g in t] + engine
    assert sorted(used) == list(range(6)), used  # six GPUs, each used by exactly one process
    for gpus, base in gens:  # SGLang's base GPU is the first of the generator's own consecutive pair
        assert len(gpus) == 2 and base == gpus[0] and gpus[1] == gpus[0] + 1


def test_a_tp_group_across_two_nodes_is_refused_naming_the_ranks():
    check_tp_groups(["a", "a", "b", "b"], tp=2)  # each pair on one node
    with pytest.raises(PlacementError, match=r"ranks 2\.\.3 form one TP group \(trainer.tp=2\).*2 nodes"):
        check_tp_groups(["a", "a", "a", "b"], tp=2)


def test_tp_that_does_not_divide_a_node_is_refused_at_load():
    with pytest.raises(ConfigError, match="TP group would span two nodes"):
        load_config(
            None,
            [
                "cluster.trainer_num_nodes=2",
                "cluster.trainer_gpus_per_node=3",
                "trainer.tp=2",
                "trainer.dp=3",
            ],
        )
