"""Two Ray nodes on this one machine (`ray start --head` and `ray start --address`, each with a custom
resource), with Ray's token auth on: `bin/run-pipeline cluster.address=...` joins with the token file
alone, pins the trainer to one node and the generator to the other, binds the stages to the node's IP
instead of loopback, turns CURVE on for every ZeroMQ socket, and completes. A driver with a wrong
token is refused with a message that names the cluster address."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")


def _start_node(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """One Ray node in the foreground (--block) in a session of its own, so that the test can end
    exactly the processes it started; returns once the node says it runs (at most 90 s)."""
    out = log.open("w")
    p = subprocess.Popen(
        [str(RAY), "start", "--block", "--disable-usage-stats", *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while "Ray runtime started" not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            _stop(p)
            pytest.fail(f"ray start {' '.join(args)} did not come up:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return p


def _stop(p: subprocess.Popen) -> None:
    """SIGTERM the node (ray start --block then stops its own processes), then its whole session."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # what is left of the node's process group (ours alone)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from buffer.net import free_port

    if not RAY.exists():
        pytest.skip("the ray command line is not installed next to this python")
    tmp = tmp_path_factory.mktemp("cluster")
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    port = free_port()
    head = _start_node(
        [
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            '--resources={"node_a": 1}',
            "--include-dashboard=false",
        ],
        env,
        tmp / "head.log",
    )
    try:
        import ray._private.services as services

        address = f"{services.get_node_ip_address()}:{port}"
        worker = _start_node(
            [f"--address={address}", "--num-cpus=2", '--resources={"node_b": 2}'], env, tmp / "b.log"
        )
        try:
            yield address, token
        finally:
            _stop(worker)
    finally:
        _stop(head)
        # `ray start --head` recorded its address for local drivers; `ray stop` would remove the record,
        # a SIGTERM does not, and a later ray.init() (the other tests' local Ray) would try to join it
        from ray._common.utils import get_ray_address_file

        record = Path(get_ray_address_file(None))
        if record.exists() and record.read_text().strip() == address:
            record.unlink()


def _run_pipeline(tmp_path, address, token_path, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)  # the token file alone: no RAY_AUTH_MODE
    env["PYTHONPATH"] = str(REPO)
    cmd = [
        sys.executable,
        "-m",
        "pipeline",  # what bin/run-pipeline runs
        f"cluster.address={address}",
        f"run.dir={tmp_path / 'run'}",
        "run.steps=3",
        "run.timeout_s=120",
        "trainer.batch_groups=2",
        "rollout.group_size=4",
        "metrics.progress=false",
        "metrics.tensorboard=false",
        *extra,
    ]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~45 s with its two-node cluster's start on 2 cores
def test_pipeline_across_two_nodes_with_token_auth_and_curve(tmp_path, two_nodes):
    address, token = two_nodes
    res = _run_pipeline(
        tmp_path,
        address,
        token,
        "cluster.trainer_resources={node_a: 1}",
        "cluster.rollout_resources={node_b: 1}",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in steps if "version" in m] == [1, 2, 3]
    where = json.loads((run / "placement.json").read_text())
    # trainer (with the buffer) on node_a, the generator on node_b: two different Ray nodes
    assert where["trainer"][0]["node_id"] == where["buffer"]["node_id"] != where["generators"][0]["node_id"]
    host = address.rsplit(":", 1)[0]
    assert where["addresses"]["buffer"].startswith(f"tcp://{host}:")  # not loopback: reachable from node_b
    assert where["addresses"]["weights"].startswith(f"tcp://{host}:")
    assert where["curve"] is True


@pytest.mark.slow  # ~20 s: Ray retries the connection before it gives up
def test_a_driver_with_the_wrong_token_is_refused_by_name(tmp_path, two_nodes):
    address, _ = two_nodes
    wrong = tmp_path / "wrong-token"
    wrong.write_text(secrets.token_hex(32))
    res = _run_pipeline(tmp_path, address, wrong)
    assert res.returncode != 0
    assert f"cluster.address={address}: cannot join the Ray cluster" in res.stderr + res.stdout
