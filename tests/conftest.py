"""Fixtures shared by the test files that run the whole pipeline."""

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray of 4 logical CPUs (room for trainer, generator and eval bundles on 2 cores), per module."""
    ray = pytest.importorskip("ray")
    from pipeline.config import load_config
    from pipeline.orchestration.launcher import start_ray

    start_ray(load_config(None, ["cluster.num_cpus=4"]))
    yield
    ray.shutdown()
