"""SGLangEngine.start freezes the server's garbage collector once /health answers (SGLang's /freeze_gc):
on an H100 the HTTP process otherwise stopped for a 0.5-0.67 s full collection every ~6 s, and a weight
push whose pause met one stalled generation that long. The server here is a real process answering
real HTTP on a real port, standing in for `python -m sglang.launch_server` (tests/sglang_standin.py)."""

from __future__ import annotations

import logging

from sglang_standin import command as standin_command  # tests/ is on sys.path

from stages.rollout.config import SGLangConfig
from stages.rollout.sglang_engine import SGLangEngine


def engine_on_fake_server(tmp_path, *, has_freeze: bool, **cfg) -> tuple[SGLangEngine, object]:
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    conf = SGLangConfig(log_dir=str(tmp_path / "logs"), startup_timeout_s=30, **cfg)
    eng = SGLangEngine(str(tmp_path), conf, start=False)
    eng._command = lambda path, version: standin_command(eng.port, calls, has_freeze=has_freeze)
    return eng, calls


def posts(calls) -> list[str]:
    return calls.read_text().split()


def test_start_freezes_the_servers_gc_and_so_does_each_relaunch(tmp_path):
    eng, calls = engine_on_fake_server(tmp_path, has_freeze=True)
    try:
        eng.start()
        assert posts(calls) == ["/freeze_gc"]
        eng.restart()  # a relaunched server is a fresh process with nothing frozen
        assert posts(calls) == ["/freeze_gc", "/freeze_gc"]
    finally:
        eng.close()


def test_freeze_gc_off_leaves_the_server_alone(tmp_path):
    eng, calls = engine_on_fake_server(tmp_path, has_freeze=True, freeze_gc=False)
    try:
        eng.start()
        assert posts(calls) == []
    finally:
        eng.close()


def test_a_server_without_freeze_gc_still_serves_and_the_log_says_why(tmp_path, caplog):
    """An older SGLang has no /freeze_gc: the engine starts anyway and names the knob that skips it."""
    eng, calls = engine_on_fake_server(tmp_path, has_freeze=False)
    try:
        with caplog.at_level(logging.WARNING):
            eng.start()
        assert posts(calls) == ["/freeze_gc"]
        assert eng.check_health()
        warned = [r.getMessage() for r in caplog.records if "garbage collector" in r.getMessage()]
        assert len(warned) == 1 and "rollout.sglang.freeze_gc=false" in warned[0] and "404" in warned[0]
    finally:
        eng.close()
