"""Every config in configs/ loads, and each GPU config's stages fit the number of GPUs it declares.

A user starts from these files: a key renamed in the schema, or a parallel size changed without the
GPUs to hold it, must fail here rather than at the start of somebody's GPU run.
"""

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.orchestration.placement import check_fits, make_plan

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_configs_folder_is_found():
    assert len(CONFIGS) >= 5, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_shipped_config_loads_and_its_stages_fit_its_gpu_count(path):
    cfg = load_config(path)
    gpus = cfg.cluster.num_gpus
    plan = make_plan(cfg, gpus)
    # one node with the GPUs the config declares (0 for the CPU configs), and CPUs enough for any
    check_fits(plan, cfg, {"CPU": 64, "GPU": gpus}, [{"Resources": {"GPU": gpus}}])
    if gpus:
        assert plan.trainer_device == "cuda"
        # nothing left idle: the configs say how many GPUs they use, and use them all
        assert plan.gpus == gpus, f"{path.name}: the stages take {plan.gpus} of its {gpus} GPUs"


def test_the_7b_config_splits_the_model_over_two_trainer_gpus_beside_two_engines():
    cfg = load_config(CONFIG_DIR / "gpu-4x-7b.yaml")
    plan = make_plan(cfg, cfg.cluster.num_gpus)
    assert (cfg.trainer.tp, cfg.trainer.dp) == (2, 1)
    assert len(plan.trainer_bundles) == 2 and len(plan.generator_bundles) == 2
    assert plan.generator_gpus == 1.0
