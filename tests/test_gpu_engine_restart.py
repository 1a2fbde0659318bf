"""A whole pipeline run whose SGLang server is killed mid-run: the generator's engine watch relaunches
it, the trainer's catch-up push gives it the current weights, the groups it had in flight are
regenerated, and the run finishes (issue #17, "Engine health in the pipeline"). Two configs: one GPU
(colocated, CUDA IPC pushes) and two GPUs (disaggregated, NCCL pushes: the weight group is formed
again with the relaunched server).

Needs sglang==0.5.17 and megatron-core (docs/gpu.md) and the config's GPUs; marked `gpu`, so default
runs skip it. Takes 5-8 minutes each (two SGLang starts). Prints a `METRIC {...}` line.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from gpu_runs import fresh as fresh_steps
from gpu_runs import (  # tests/ is on sys.path
    pipeline_command,
    running_pipeline,
    sglang_servers,
    steps,
    wait_for_steps,
)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "config,gpus", [("configs/gpu-1x-colocated.yaml", 1), ("configs/gpu-2x-disaggregated.yaml", 2)]
)
def test_a_killed_sglang_server_is_relaunched_caught_up_and_the_run_finishes(tmp_path, config, gpus):
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{config} needs {gpus} CUDA GPU(s)")
    pytest.importorskip("sglang")
    pytest.importorskip("psutil")
    run_dir = tmp_path / "run"
    cmd = pipeline_command(config, run_dir, tmp_path, "rollout.sglang.health_check_s=5")
    with running_pipeline(cmd, REPO, tmp_path, run_dir) as (proc, log_path):
        wait_for_steps(proc, run_dir, log_path, 3)
        servers = sglang_servers(proc.pid)
        assert len(servers) == 1, f"expected {config}'s one SGLang server, found {servers}"
        killed_at, steps_at_kill = time.time(), len(steps(run_dir))
        os.killpg(servers[0].pid, signal.SIGKILL)  # the server's own group (it starts a new session)
        # wait for two steps trained on the relaunched server's tokens, then stop the run as Ctrl-C
        # would (exit 130); a run that fails or ends first is reported with its log
        deadline = time.monotonic() + 480
        while len(fresh_steps(steps(run_dir), killed_at)) < 2 and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(2)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=180)
    tail = log_path.read_text()[-4000:]
    assert rc in (0, 130), f"the run failed after its SGLang server was killed (rc {rc}):\n{tail}"
    rows = steps(run_dir)
    after = [r for r in rows if r["time"] > killed_at]
    restarts = max(r.get("generator/engine_restarts", 0) for r in rows)
    fresh = fresh_steps(rows, killed_at)
    print(
        "METRIC "
        + json.dumps(
            {
                "steps_at_kill": steps_at_kill,
                "steps": len(rows),
                "steps_after_kill": len(after),
                "steps_with_new_tokens": len(fresh),
                "config": config,
                "engine_restarts": restarts,
                "back_after_s": round(fresh[0]["time"] - killed_at, 1) if fresh else None,
                # each step after the kill: seconds since it, and the tokens generated so far
                "after_kill": [(round(r["time"] - killed_at, 1), r["generator/tokens"]) for r in after],
            }
        ),
        flush=True,
    )
    assert restarts >= 1, "the engine watch did not relaunch the killed server"
    assert len(fresh) >= 2, (
        f"{len(fresh)} steps trained on the relaunched server's tokens within 480 s of the kill: the "
        f"run did not go on. Log tail:\n{tail}"
    )
