"""The Sample record, its Arrow form, the wire codec and the config loader."""

import msgspec
import numpy as np
import pytest

from buffer import wire
from buffer.record import Sample, Status, batch_to_samples, list_values, samples_to_batch
from pipeline.config import ConfigError, load_config, write_resolved


def make(uid="u0", n=5, group="g0", idx=0, size=1, v0=3):
    return Sample.build(
        uid=uid,
        group_id=group,
        group_index=idx,
        group_size=size,
        prompt_ids=[1, 2, 3],
        response_ids=list(range(10, 10 + n)),
        rollout_logprobs=np.linspace(-1, 0, n),
        versions=[v0] * (n - 1) + [v0 + 1],
        reward=0.5,
        reward_parts={"fmt": 1.0},
        prompt="p",
        label="l",
        metadata={"k": [1]},
    )


def test_arrow_roundtrip_preserves_every_field():
    samples = [make(f"u{i}", n=i + 1, idx=i, size=4) for i in range(4)]
    batch = samples_to_batch(samples)
    assert batch.num_rows == 4
    back = batch_to_samples(batch)
    for a, b in zip(samples, back):
        assert msgspec.structs.asdict(a) == msgspec.structs.asdict(b)
    vals, offs = list_values(batch, "response_ids")
    assert list(offs) == [0, 1, 3, 6, 10]
    assert batch.column("min_version").to_pylist() == [4, 3, 3, 3]  # one token: only v0+1


def test_validate_names_the_misaligned_field():
    s = make()
    bad = msgspec.structs.replace(s, versions=s.versions[:-4])
    with pytest.raises(ValueError, match="versions has 4 entries but response_ids has 5"):
        bad.validate()


def test_wire_roundtrip_and_rejections():
    msg = wire.Ingest(producer="g", seq=7, samples=[make()])
    back = wire.decode(wire.encode(msg))
    assert back == msg and back.samples[0].status is Status.COMPLETED
    with pytest.raises(wire.ProtocolError, match="undecodable"):
        wire.decode(b"\xc1garbage")
    with pytest.raises(wire.ProtocolError, match="schema version 99"):
        wire.decode(msgspec.msgpack.encode({"kind": "stats", "schema": 99}))
    with pytest.raises(wire.ProtocolError, match="unknown message kind 'nope'"):
        wire.decode(msgspec.msgpack.encode({"kind": "nope", "schema": wire.SCHEMA_VERSION}))
    with pytest.raises(wire.ProtocolError, match="invalid fetch"):
        wire.decode(msgspec.msgpack.encode({"kind": "fetch", "schema": wire.SCHEMA_VERSION, "consumer": 3}))
    with pytest.raises(wire.ProtocolError, match="exceeds the limit"):
        wire.decode(b"x" * 100, max_bytes=10)
    bad = msgspec.structs.replace(make(), loss_mask=b"\x01")
    with pytest.raises(wire.ProtocolError, match="invalid sample"):
        wire.decode(wire.encode(wire.Ingest(producer="g", seq=1, samples=[bad])))


def test_config_overrides_and_unknown_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  lr: 0.01\n")
    cfg = load_config(p, ["trainer.loss.tis_cap=3", "run.steps=5", "rollout.sampling.temperature=0.7"])
    assert cfg.trainer.lr == 0.01 and cfg.trainer.loss.tis_cap == 3 and cfg.run.steps == 5
    with pytest.raises(
        ConfigError, match=r"unknown key trainer\.loss\.tis_capp; did you mean trainer\.loss\.tis_cap"
    ):
        load_config(p, ["trainer.loss.tis_capp=3"])
    with pytest.raises(ConfigError, match=r"trainer\.lr: Expected `float`"):
        load_config(p, ["trainer.lr=fast"])
    assert load_config(p, ["trainer.lr=1e-2"]).trainer.lr == 0.01  # YAML 1.1 reads 1e-2 as a string
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(p, ["trainer.lr"])
    out = write_resolved(cfg, tmp_path / "run")
    again = load_config(out)
    assert again == cfg


def test_cli_rejects_a_config_typo_before_starting_anything():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "trainer.lrr=1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "unknown key trainer.lrr; did you mean trainer.lr?" in out.stderr


def test_cross_section_checks_name_both_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"weights.push_every=2 with run.max_staleness=0 \(sync mode\)"):
        load_config(p, ["run.mode=sync", "weights.push_every=2"])
    with pytest.raises(ConfigError, match=r"temperature=0.0: must be > 0"):
        load_config(p, ["rollout.sampling.temperature=0"])
    with pytest.raises(ConfigError, match="num_generators=9 > trainer.batch_groups=8"):
        load_config(p, ["rollout.num_generators=9", "trainer.batch_groups=8"])


def test_rough_edges_fail_at_load_or_just_work():
    """weights.transport=disk (no sender) fails at load, naming the key, not at run time; SGLang
    extra_args may hold numbers, passed on as strings."""
    with pytest.raises(ConfigError, match=r"weights\.transport"):
        load_config(None, ["weights.transport=disk"])
    cfg = load_config(None, ["rollout.sglang.extra_args=[--context-length, 8192]"])
    assert [str(a) for a in cfg.rollout.sglang.extra_args] == ["--context-length", "8192"]


def test_progress_writes_a_line_every_few_seconds_when_not_a_terminal():
    import io

    from pipeline.orchestration.progress import Progress

    out = io.StringIO()
    p = Progress(1000, stream=out, log_every_s=3600)
    for step in range(1, 1001):
        p.update(step, {"samples": 8, "reward/mean": 0.5})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 1/1000") and lines[1].startswith("step 1000/1000")
