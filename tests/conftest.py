"""Fixtures shared by the test files that run the whole pipeline."""

import sys

import pytest


@pytest.fixture(scope="session")
def _local_ray_stopped_at_the_end():
    """Stops the local Ray that ray_session keeps from module to module, once every test is done."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_local_ray_stopped_at_the_end):
    """A local Ray of 4 logical CPUs (room for trainer, generator and eval bundles on 2 cores).

    Started by the first module that asks and kept for the next: starting one takes ~3 s and stopping
    it ~1.3 s on the 2-core CI machine, once per module before (~20 s of the suite). Every run removes
    its actors and placement group when it ends, so a module finds the cluster as the last one left it;
    where one failed and left something holding CPUs, the cluster is started afresh. A module that
    needs a Ray of its own (tests/test_placement.py: GPUs) shuts this one down first; the next module
    that asks starts it again."""
    ray = pytest.importorskip("ray")
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import start_ray

    if ray.is_initialized() and _held(ray):
        ray.shutdown()
    if not ray.is_initialized():
        start_ray(load_config(None, ["cluster.num_cpus=4"]))
    yield


def _held(ray) -> bool:
    """Something (a leftover actor or placement group) still holds CPUs of the cluster 2 s after the
    last module ended (a run frees them as it ends): the next module must not wait for it."""
    import time

    for _ in range(20):
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def dist1():
    """torch.distributed and megatron's groups for one rank (TP = PP = 1), for tests that build models
    in this process."""
    from stages.trainer.model import init_distributed

    init_distributed(tp=1, pp=1)
    yield
