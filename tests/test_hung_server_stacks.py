"""A hung SGLang server's stacks go into its log before the engine watch relaunches it. In a GPU run
(2026-11-28, the agent bench with the radix cache on) a server's scheduler stopped answering; the
watch relaunched it 71 s later, and nothing said where it had stopped: SGLang's own crash diagnostics
found no scheduler left to look at once the group was ended. The server here is a real process on a
real port (tests/sglang_standin.py) that holds /health unanswered while a flag file exists; py-spy is
a stand-in script on PATH that names the process it was asked about."""

from __future__ import annotations

import os
import re

import pytest
from sglang_standin import command as standin_command  # tests/ is on sys.path

from stages.rollout.config import SGLangConfig
from stages.rollout.sglang_engine import SGLangEngine


def _engine(tmp_path, paused):
    conf = SGLangConfig(log_dir=str(tmp_path / "logs"), startup_timeout_s=30, health_timeout_s=0.5)
    eng = SGLangEngine(str(tmp_path), conf, start=False)
    eng._command = lambda path, version: standin_command(eng.port, tmp_path / "calls.txt", paused_flag=paused)
    return eng


@pytest.fixture
def fake_py_spy(tmp_path, monkeypatch):
    """A py-spy on PATH that answers `py-spy dump --pid PID` with a line naming the pid."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    spy = bin_dir / "py-spy"
    spy.write_text(
        '#!/bin/sh\nfor a; do pid=$a; done\necho "Thread MainThread (idle) of pid $pid"\n'
    )  # last arg
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def server(tmp_path):
    """A started stand-in server's engine, and the flag file that makes the server hang."""
    paused = tmp_path / "paused"
    eng = _engine(tmp_path, paused)
    try:
        eng.start()
        yield eng, paused
    finally:
        if paused.exists():
            paused.unlink()
        eng.close()


def _hang(eng, paused):
    paused.touch()
    assert eng.check_health() and not eng.check_health()  # two missed checks: hung
    paused.unlink()  # the relaunched one answers


def test_a_hung_server_is_relaunched_with_its_stacks_in_its_log(server, fake_py_spy):
    eng, paused = server
    hung = eng.pid
    _hang(eng, paused)
    eng.restart()
    assert eng.pid != hung and eng.check_health()
    log = eng.log_path.read_text()
    assert f"py-spy dump of pid {hung}" in log
    assert f"of pid {hung}\n" in log, "the dump's own output is not in the log"
    # the dump comes before the relaunch's launch line
    assert log.index(f"py-spy dump of pid {hung}") < [m.start() for m in re.finditer("launching:", log)][-1]


def test_without_py_spy_the_log_says_so_and_the_relaunch_goes_on(server, monkeypatch):
    eng, paused = server
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)
    hung = eng.pid
    _hang(eng, paused)
    eng.restart()
    assert eng.pid != hung and eng.check_health()
    assert "no py-spy on PATH" in eng.log_path.read_text()


def test_a_live_server_relaunched_for_another_reason_is_not_dumped(server, fake_py_spy):
    """restart() also serves a failed push's recovery, on a server that answers: not hung, no dump."""
    eng, _ = server
    eng.restart()
    assert eng.check_health() and "py-spy dump" not in eng.log_path.read_text()


def test_a_dead_server_is_relaunched_without_a_dump(server, fake_py_spy):
    eng, _ = server
    eng._proc.kill()
    eng._proc.wait(timeout=10)
    eng.restart()
    assert "py-spy dump" not in eng.log_path.read_text()
