"""Asynchronous checkpoints (trainer.async_save, issue #39): the trainer steps on while a checkpoint is
written, and the checkpoint holds the state of the step that saved it, not of the steps taken during
its write; at most one save is in flight (the next waits, and gives up with a message); a write that
fails or a trainer killed mid-write leaves the previous checkpoint the latest and the unfinished one
ignored; a run resumed from an asynchronous checkpoint takes the steps the uninterrupted one takes, also
over two ranks (the checkpoint's own gloo group); a process that exits without waiting commits its
last checkpoint first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.config import RunConfig
from stages.trainer.async_checkpoint import CheckpointWriteError
from stages.trainer.async_checkpoint_check import HOOK
from stages.trainer.async_checkpoint_check import make_trainer as check_trainer
from stages.trainer.checkpoint import CheckpointManager, latest_path, resolve_checkpoint
from stages.trainer.testing import ListSource, make_batch, make_tiny_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _trainer(model_path, run_dir, batches, *, every: int = 1, timeout_s: float = 60.0, hook=(), **trainer):
    """A trainer whose checkpoints are asynchronous (every `every` steps; its writer process calls
    `hook` first); with every=0 one that only resumes."""
    from trainer_setup import make_trainer

    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_every_s = 2, every, 0.0
    cfg.trainer.optimizer, cfg.trainer.keep_checkpoints = "adam", 0
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    tr = make_trainer(cfg, ListSource(batches), model_path, str(run_dir))
    if every:  # the manager trainer.async_save makes, with the test's timeout and writer hook
        tr.checkpoints = CheckpointManager(
            tr.run_dir, async_save=True, wait_timeout_s=timeout_s, writer_hook=hook
        )
    return tr


def _weights(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.policy.model.named_parameters()}


def _assert_weights(tr, want: dict[str, torch.Tensor]) -> None:
    for n, p in tr.policy.model.named_parameters():
        assert torch.equal(p, want[n]), n


class Gate:
    """Stops the write of the checkpoint of `version` (in the writer process) before its first shard
    until opened (a slow disk); with `fail`, that write raises instead (a full disk)."""

    def __init__(self, folder, version: int, fail: bool = False):
        self.marker, self.release = str(folder / f"reached_v{version}"), str(folder / f"open_v{version}")
        self.hook = (HOOK, str(version), "0", self.marker, self.release, "1" if fail else "")

    def reached(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        return os.path.exists(self.marker)

    def open(self) -> None:
        open(self.release, "w").close()


def test_steps_go_on_while_a_save_is_written_and_it_holds_its_steps_state(model_path, tmp_path):
    batches = [make_batch(2, 4, seed=i) for i in range(4)]
    gate = Gate(tmp_path, version=2)
    tr = _trainer(model_path, tmp_path / "run", batches, every=2, hook=gate.hook)
    tr.step(), tr.step()  # the save of version 2 starts, and stops at its first shard
    at_2 = _weights(tr)
    assert gate.reached()
    tr.step()  # a whole step while the save of version 2 is being written
    assert tr.version == 3 and latest_path(str(tmp_path / "run")) is None
    assert not (tmp_path / "run" / "checkpoints" / "step_000002").exists()
    gate.open()
    assert tr.checkpoints.wait().endswith("step_000002")
    assert latest_path(str(tmp_path / "run")).endswith("step_000002")
    tr.checkpoints.close()
    # the checkpoint is the weights of version 2, although the trainer changed them during the write
    again = _trainer(model_path, tmp_path / "run", batches[2:], every=0)
    assert again.version == 2
    _assert_weights(again, at_2)


def test_a_save_waits_for_the_one_in_flight_and_gives_up_with_a_message(model_path, tmp_path):
    gate = Gate(tmp_path, version=1)
    tr = _trainer(
        model_path,
        tmp_path / "run",
        [make_batch(2, 4, seed=i) for i in range(2)],
        timeout_s=0.5,
        hook=gate.hook,
    )
    tr.step()
    assert gate.reached()
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"step_000001 is still being written 0.5s after .*no save while one"
    ):
        tr.step()  # its save waits for version 1's: one in flight at most
    assert time.monotonic() - t0 >= 0.5
    gate.open()
    assert tr.checkpoints.wait().endswith("step_000001")
    tr.checkpoints.close()


def test_a_failed_write_leaves_the_previous_checkpoint_the_latest(model_path, tmp_path):
    batches = [make_batch(2, 4, seed=i) for i in range(3)]
    tr = _trainer(model_path, tmp_path / "run", batches, hook=Gate(tmp_path, version=2, fail=True).hook)
    tr.step()
    at_1 = _weights(tr)
    tr.step()
    with pytest.raises(
        CheckpointWriteError, match=r"step_000002 was not saved .*No space left.*previous one"
    ):
        tr.checkpoints.wait()
    root = tmp_path / "run" / "checkpoints"
    assert (root / ".tmp-step_000002" / "common.pt").exists()  # half-written: the plan, no shard
    assert latest_path(str(tmp_path / "run")).endswith("step_000001")
    with pytest.raises(FileNotFoundError, match="no complete"):
        resolve_checkpoint(str(tmp_path / "run"), 2)
    resumed = _trainer(model_path, tmp_path / "run", batches[1:], every=0)
    assert resumed.version == 1
    _assert_weights(resumed, at_1)
    tr.step()  # the next save commits, and removes the unfinished folder
    assert tr.checkpoints.wait().endswith("step_000003")
    assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000003"]
    tr.checkpoints.close()


def test_a_trainer_resumed_from_an_async_checkpoint_takes_the_uninterrupted_step(model_path, tmp_path):
    batches = [make_batch(2, 4, seed=i) for i in range(4)]
    first = _trainer(model_path, tmp_path, batches)
    first.step(), first.step(), first.step()  # the saves of versions 2 and 3 reuse the plan of 1's
    first.checkpoints.wait()
    second = _trainer(model_path, tmp_path, batches[3:], every=0)
    assert second.version == 3
    first.step(), second.step()
    first.checkpoints.close()
    for (name, a), (_, b) in zip(
        first.policy.model.named_parameters(), second.policy.model.named_parameters()
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_trainer_async_save_makes_the_trainers_checkpoints_asynchronous(model_path, tmp_path):
    """trainer.async_save reaches the trainer's checkpoint manager, and close() waits for the commit."""
    from trainer_setup import make_trainer

    cfg = RunConfig()
    cfg.trainer.async_save = True
    tr = make_trainer(cfg, ListSource([]), model_path, str(tmp_path))
    try:
        assert tr.checkpoints.async_save and tr.checkpoints.writer_pid is not None
    finally:
        tr.checkpoints.close()


def _check(out, model_path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stages.trainer.async_checkpoint_check", "--model-path", model_path]
    return subprocess.Popen(
        [*cmd, "--out", str(out), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(path, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited {proc.returncode} before {path}:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {path} after {timeout_s:.0f}s:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)


def _ends(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone (or a zombie) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_trainer_killed_mid_write_resumes_from_the_previous_checkpoint(model_path, tmp_path):
    """SIGKILL while the checkpoint of version 3 is written: the writer process goes too, version 2's
    checkpoint is the latest, and a trainer resumed from it takes the step 3 the killed one took (its
    weights after step 3)."""
    proc = _check(tmp_path, model_path, "--steps", "3", "--hold-write-of", "3")
    _wait_for(tmp_path / "holding_v3", proc)
    _wait_for(tmp_path / "weights_v3.pt", proc)
    writer = int((tmp_path / "writer_pid").read_text())
    os.kill(proc.pid, signal.SIGKILL)  # the process this test started, by its id
    proc.wait(timeout=60)
    gone = _ends(writer, timeout_s=10.0)
    if not gone:
        os.kill(writer, signal.SIGKILL)  # the trainer's writer, started by this test's trainer
    assert gone, "the writer process outlived its killed trainer (it would go on writing into .tmp-step_3)"
    proc.communicate(timeout=60)
    run = tmp_path / "run"
    assert latest_path(str(run)).endswith("step_000002")
    assert (run / "checkpoints" / ".tmp-step_000003").exists()
    resumed = check_trainer(model_path, str(tmp_path), 1, async_save=False)
    assert resumed.version == 2
    _assert_weights(resumed, torch.load(tmp_path / "weights_v2.pt"))
    resumed.step()
    want = torch.load(tmp_path / "weights_v3.pt")
    for n, p in resumed.policy.model.named_parameters():
        assert torch.allclose(p, want[n], atol=1e-6), n


def test_a_process_that_exits_without_waiting_commits_its_last_checkpoint(model_path, tmp_path):
    """The writer thread is no daemon: the interpreter's exit waits for the commit (here held 1 s)."""
    proc = _check(tmp_path, model_path, "--steps", "2", "--hold-write-of", "2", "--hold-s", "1", "--no-close")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "holding_v2").exists()
    assert latest_path(str(tmp_path / "run")).endswith("step_000002")


@pytest.mark.slow
def test_two_ranks_save_asynchronously_and_resume_exactly(model_path, tmp_path):
    """DP=2 with the distributed optimizer (each rank writes its shard of Adam's state): the async run
    killed after step 2's checkpoint and resumed for 2 steps ends on the weights of the uninterrupted
    synchronous run."""
    import shutil

    from stages.trainer.ranks import run_ranks

    args = ["--model-path", model_path, "--distributed-optimizer"]
    run_ranks(
        "stages.trainer.async_checkpoint_check",
        [*args, "--out", str(tmp_path / "sync"), "--sync", "--steps", "4"],
        2,
        300,
    )
    run_ranks(
        "stages.trainer.async_checkpoint_check", [*args, "--out", str(tmp_path / "a"), "--steps", "4"], 2, 300
    )
    root = tmp_path / "a" / "run" / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", *(f"step_00000{v}" for v in range(1, 5))]
    for v in (3, 4):
        shutil.rmtree(root / f"step_00000{v}")
    (root / "latest").write_text("step_000002")
    run_ranks(
        "stages.trainer.async_checkpoint_check", [*args, "--out", str(tmp_path / "a"), "--steps", "2"], 2, 300
    )
    want = torch.load(tmp_path / "sync" / "weights_v4.pt")
    got = torch.load(tmp_path / "a" / "weights_v4.pt")
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-5), n


def test_a_synchronous_save_hands_megatrons_writer_host_copies_of_device_tensors():
    """A synchronous save on GPUs plans the trainer's live GPU tensors, and megatron's writer writes host
    tensors only (it asserts `is_cpu`): every GPU checkpoint failed that way before the copy (found by
    the GPU restart tests, 2026-11-28). On CPU the copy is checked with a stand-in for a GPU tensor."""
    from stages.trainer.async_checkpoint import on_host

    class OnDevice:  # enough of a CUDA tensor for the copy: not on the host, `.to("cpu")` copies it
        is_cpu = False

        def __init__(self, t):
            self.t, self.moved_to = t, []

        def to(self, device):
            self.moved_to.append(device)
            return self.t.clone()

    host, device = torch.ones(3), OnDevice(torch.arange(4.0))
    path, name, (bytes_items, tensors) = on_host(
        ("f/0.distcp", "0", ([("obj", b"x")], [("a", host), ("b", device)]))
    )
    assert (path, name, bytes_items) == ("f/0.distcp", "0", [("obj", b"x")])
    assert tensors[0] == ("a", host) and tensors[0][1] is host  # host tensors are written as they are
    assert device.moved_to == ["cpu"] and tensors[1][0] == "b"
    assert tensors[1][1].is_cpu and torch.equal(tensors[1][1], torch.arange(4.0))
    untouched = ("f", "0", ([], [("a", host)]))
    assert on_host(untouched) is untouched
