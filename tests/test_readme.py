"""The README's commands as written: every `bin/run-pipeline` line's config and overrides load (the run
itself is the e2e tests' job), every `bin/buffer-inspect` line runs on a small buffer, the standalone
stages accept the flags the README gives them, and every bench it names exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]
    return [" ".join(shlex.quote(w) for w in shlex.split(ln, comments=True)) for ln in lines if ln.strip()]


def _args(line: str, prog: str) -> list[str]:
    """The arguments after `prog` on a README line (the part before `&&` for the quick start)."""
    words = shlex.split(line)
    words = words[len(words) - words[::-1].index("&&") :] if "&&" in words else words
    return words[words.index(prog) + 1 :] if prog in words else words[2:]


PIPELINE_LINES = [c for c in _commands() if "bin/run-pipeline" in c or c.startswith("python -m pipeline")]


def test_the_readme_has_the_commands_this_file_checks():
    assert len(PIPELINE_LINES) >= 8 and any("buffer-inspect" in c for c in _commands())


@pytest.mark.parametrize("line", PIPELINE_LINES)
def test_every_run_pipeline_line_loads_its_config(line, capsys):
    from pipeline.__main__ import main

    args = _args(line, "bin/run-pipeline") if "bin/run-pipeline" in line else shlex.split(line)[3:]
    assert main([*args, "--print-config"]) == 0, line
    assert "run:" in capsys.readouterr().out


def test_every_buffer_inspect_line_runs_on_a_buffer(tmp_path, monkeypatch, capsys):
    from buffer.config import BufferConfig
    from buffer.demo import synthetic_samples
    from buffer.storage import Buffer
    from pipeline.inspect import main

    buf = Buffer(BufferConfig(), tmp_path / "buf")
    buf.insert(synthetic_samples(3, version=0))
    buf.fetch(1, version=1, max_staleness=2)
    buf.close()
    monkeypatch.chdir(tmp_path)  # out.parquet / out.png land here
    lines = [c for c in _commands() if c.startswith("bin/buffer-inspect")]
    assert len(lines) >= 4
    for line in lines:
        args = [a.replace("/tmp/buf", str(tmp_path / "buf")) for a in _args(line, "bin/buffer-inspect")]
        assert main(args) == 0, line
    assert (tmp_path / "out.parquet").exists() and (tmp_path / "out.png").exists()


@pytest.mark.parametrize("module", ["stages.trainer", "stages.rollout", "buffer"])
def test_standalone_stages_take_the_flags_the_readme_gives_them(module):
    flags = {
        w
        for c in _commands()
        if f"-m {module} " in c
        for w in shlex.split(c)
        if w.startswith("--") and w != "--help"
    }
    assert flags, module
    cmd = [sys.executable, "-m", module] + (["serve"] if module == "buffer" else []) + ["--help"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert {f for f in flags if f not in res.stdout} == set(), res.stdout


def test_every_bench_the_readme_names_exists():
    named = {m for c in _commands() for m in re.findall(r"bench/[\w.]+\.(?:py|sh)", c)}
    assert named and {n for n in named if not (REPO / n).exists()} == set()
