"""SGLangEngine.check_health, which the engine watch restarts servers by. SGLang answers /health by
generating one token, which a server paused for a weight push cannot do until the push ends. In a 7B
run (2026-11-27) a push held up by one server kept the other paused for 34 s, and the watch relaunched
that healthy server at its first missed check. Now a live server must miss two checks in a row; one
whose process exited fails at once. The server is a real process on a real port, standing in for
`python -m sglang.launch_server` (tests/sglang_standin.py): while a flag file exists it holds /health
unanswered, as a paused SGLang does."""

from __future__ import annotations

import os
import signal

from sglang_standin import command as standin_command  # tests/ is on sys.path

from stages.rollout.config import SGLangConfig
from stages.rollout.sglang_engine import SGLangEngine


def test_a_paused_server_survives_one_missed_check_a_hung_one_fails_the_second_a_dead_one_the_first(
    tmp_path,
):
    paused = tmp_path / "paused"
    conf = SGLangConfig(log_dir=str(tmp_path / "logs"), startup_timeout_s=30, health_timeout_s=0.5)
    eng = SGLangEngine(str(tmp_path), conf, start=False)
    eng._command = lambda path, version: standin_command(eng.port, tmp_path / "calls.txt", paused_flag=paused)
    try:
        eng.start()
        assert eng.check_health()

        paused.touch()  # a push pauses it past the check
        assert eng.check_health(), "one missed check (a push in progress) restarted the server"
        paused.unlink()  # the push ended: it answers again, and the count starts over
        assert eng.check_health()
        paused.touch()
        assert eng.check_health()

        # still no answer at the next check: hung, not pushing
        assert not eng.check_health()
        paused.unlink()

        os.killpg(eng.pid, signal.SIGKILL)  # a dead process needs no second look
        eng._proc.wait(timeout=10)
        assert not eng.check_health()
    finally:
        if paused.exists():
            paused.unlink()
        eng.close()
