"""The inspection CLI on a buffer directory and on a live server."""

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.server import BufferServer
from buffer.storage import Buffer
from pipeline.inspect import main

REPO = Path(__file__).resolve().parent.parent


def _fill(d: Path) -> None:
    buf = Buffer(BufferConfig(), d)
    buf.insert(synthetic_samples(3, version=0, prefix="a"))
    buf.insert(synthetic_samples(3, version=2, prefix="b"))
    buf.fetch(1, version=2, max_staleness=5)
    buf.fetch(1, version=5, max_staleness=3)  # evicts the version-0 groups
    buf.close()


def test_summary_samples_export_plot_on_a_directory(tmp_path, capsys):
    _fill(tmp_path / "buf")
    main(["summary", str(tmp_path / "buf")])
    out = capsys.readouterr().out
    assert "rows (all / live)" in out and "24 / 8" in out
    assert "evicted as stale" in out and "reward by oldest token version" in out
    main(["samples", str(tmp_path / "buf"), "--limit", "2", "--state", "live"])
    out = capsys.readouterr().out
    assert "b-1-0" in out and "response" in out
    main(["export", str(tmp_path / "buf"), str(tmp_path / "x.parquet")])
    t = pq.read_table(tmp_path / "x.parquet")
    assert t.num_rows == 24 and sorted(set(t.column("state").to_pylist())) == ["evicted", "live", "served"]
    main(["plot", str(tmp_path / "buf"), str(tmp_path / "x.png")])
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_on_a_live_server(tmp_path, capsys):
    srv = BufferServer(BufferConfig(durable=False)).start()
    try:
        srv_buf = srv.buffer
        srv_buf.insert(synthetic_samples(2, prefix="live"))  # before any client: no race with the loop
        main(["summary", srv.address])
        out = capsys.readouterr().out
        assert "8 / 8" in out and "rejected messages" in out
    finally:
        srv.stop()


def test_help_is_fast_and_works_via_bin():
    r = subprocess.run(
        [str(REPO / "bin" / "buffer-inspect"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and "summary" in r.stdout
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline.inspect", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert "pyarrow" not in r.stderr  # argparse runs before the heavy imports


def test_samples_decodes_text_with_a_tokenizer_folder_via_bin(tmp_path, capsys):
    from buffer.record import Sample
    from stages.models import build_byte_tokenizer

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    build_byte_tokenizer(tok_dir)  # token id = byte value: any text round-trips
    prompt, response = "What is 2+2?", "The answer is 4."
    buf = Buffer(BufferConfig(), tmp_path / "buf")
    buf.insert(
        [
            Sample.build(
                uid="u0",
                group_id="g0",
                prompt_ids=list(prompt.encode()),
                response_ids=list(response.encode()),
                rollout_logprobs=[-0.5] * len(response),
                versions=[0] * len(response),
            )
        ]
    )
    buf.close()
    r = subprocess.run(
        [str(REPO / "bin" / "buffer-inspect"), "samples", str(tmp_path / "buf"), "--tokenizer", str(tok_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert prompt in r.stdout and response in r.stdout and "u0" in r.stdout
    main(["samples", str(tmp_path / "buf")])  # without a tokenizer: the ids themselves
    out = capsys.readouterr().out
    assert response not in out and str(list(response.encode())[:3])[1:-1] in out


def test_samples_decode_with_a_built_in_model_name_and_a_bad_one_is_named(tmp_path, capsys):
    """--tokenizer tiny-qwen2 (the README's form) decodes; a folder that does not exist is one line."""
    _fill(tmp_path / "buf")
    main(["samples", str(tmp_path / "buf"), "--limit", "1", "--tokenizer", "tiny-qwen2"])
    assert "prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--tokenizer /nonexistent/model"):
        main(["samples", str(tmp_path / "buf"), "--limit", "1", "--tokenizer", "/nonexistent/model"])


def test_summary_bins_the_reward_table_for_long_runs(tmp_path, capsys):
    """A run of many versions gets at most 10 rows of reward by version, not one per version."""
    from buffer.storage import Buffer

    buf = Buffer(BufferConfig(), tmp_path / "buf")
    for v in range(40):
        buf.insert(synthetic_samples(1, version=v, prefix=f"v{v}"))
    buf.close()
    main(["summary", str(tmp_path / "buf")])
    out = capsys.readouterr().out
    table = out[out.index("reward by oldest token version") :]
    rows = [line for line in table.splitlines() if line.strip().startswith("│") and "-" in line.split("│")[1]]
    assert 1 <= len(rows) <= 10 and "0-3" in table and "36-39" in table


def _trained_at_2_and_9(d: Path) -> None:
    """Group a (version 0) served at version 2, group b (version 1) at version 9: staleness 2 and 8."""
    buf = Buffer(BufferConfig(), d)
    buf.insert(synthetic_samples(1, version=0, prefix="a"))
    buf.insert(synthetic_samples(1, version=1, prefix="b"))
    buf.fetch(1, version=2, max_staleness=5)
    buf.fetch(1, version=9, max_staleness=10)
    buf.close()


def test_the_staleness_plotted_is_the_one_each_row_was_trained_at(tmp_path):
    from pipeline.inspect import load

    _trained_at_2_and_9(tmp_path / "buf")
    table, _ = load(str(tmp_path / "buf"))
    got = {
        u[0]: s - m
        for u, s, m in zip(*(table.column(c).to_pylist() for c in ("uid", "served_at", "min_version")))
    }
    assert got == {"a": 2, "b": 8}  # not "distance to the final version" (9 and 8)


def test_summary_json_says_how_stale_each_row_was_when_trained(tmp_path, capsys):
    """`summary --json` for scripts: the staleness each served row had when the trainer took it (from
    the consumption log). Its speed on 128k rows is bench/inspect_summary.py's."""
    import json

    _trained_at_2_and_9(tmp_path / "buf")
    main(["summary", "--json", str(tmp_path / "buf")])
    d = json.loads(capsys.readouterr().out)
    n = len(synthetic_samples(1))  # rows per group
    assert d["served"] == 2 * n and d["staleness_when_trained"] == {"2": n, "8": n}
    assert d["staleness_when_trained_mean"] == 5.0 and len(d["reward_by_version"]) == 2


def test_plot_adds_the_trainer_panels_when_the_run_metrics_are_beside_the_buffer(tmp_path):
    """<run dir>/buffer + <run dir>/metrics.jsonl: the plot gets TIS and logprob-gap panels below the
    buffer's two (a 2 x 2 figure, 700 px high, instead of 1 x 2, 400 px)."""
    import json
    import struct

    from buffer.storage import Buffer

    run = tmp_path / "run"
    buf = Buffer(BufferConfig(), run / "buffer")
    buf.insert(synthetic_samples(2, version=0))
    buf.fetch(1, version=1, max_staleness=2)
    buf.close()

    def height(png) -> int:
        return struct.unpack(">II", png.read_bytes()[16:24])[1]  # the PNG IHDR's width, height

    main(["plot", str(run / "buffer"), str(tmp_path / "alone.png")])
    rows = [
        {"step": s, "reward/mean": 0.5, "tis/weight_mean": 1.0, "logp/abs_diff_train_rollout": 0.1}
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    main(["plot", str(run / "buffer"), str(tmp_path / "with.png")])
    assert height(tmp_path / "alone.png") == 400 and height(tmp_path / "with.png") == 700


def test_an_unreachable_buffer_is_one_line_not_a_traceback():
    r = subprocess.run(
        [str(REPO / "bin" / "buffer-inspect"), "summary", "tcp://127.0.0.1:1", "--timeout-s", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "did not send a reply" in r.stderr
