"""Trainer steps on CPU: versions, announcements, metrics, logp_old = the trainer's own logprobs,
clear errors, kill + resume against a real buffer (no sample reused), and the replay CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import msgspec
import pytest
import torch

from buffer.record import Status, samples_to_batch
from pipeline.config import RunConfig
from stages.trainer.testing import ListSource, make_batch, make_samples, make_tiny_hf


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _cfg(**trainer):
    cfg = RunConfig()
    cfg.trainer.batch_groups = 2
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def test_steps_versions_and_metrics(model_path, tmp_path):
    from trainer_setup import make_trainer

    src = ListSource([make_batch(2, 4, seed=i, version=0) for i in range(3)])
    tr = make_trainer(_cfg(micro_batch_tokens=64), src, model_path, str(tmp_path))
    for want in (1, 2, 3):
        m = tr.step()
        assert m["version"] == tr.version == want
        assert m["staleness/max"] == want - 1  # all tokens were produced at version 0
    assert src.versions == [0, 1, 2, 3]
    assert [f[1] for f in src.fetches] == [0, 1, 2]  # fetched with the current version
    assert all(f[2] == 2 for f in src.fetches)  # and run.max_staleness
    for k in (
        "loss",
        "grad_norm",
        "tis/weight_mean",
        "tis/weight_min",
        "tis/weight_max",
        "tis/clip_frac",
        "ppo/clip_frac",
        "logp/abs_diff_train_rollout",
        "reward/mean",
        "reward/std",
        "tokens/trained",
        "time/step_s",
        "time/data_wait_s",
    ):
        assert math.isfinite(m[k]), k
    assert m["tis/weight_max"] <= 2.0  # C = 2 default


def test_perf_metrics_follow_the_six_n_convention(model_path, tmp_path):
    """perf/tflops = 6 x parameters x tokens / train seconds (8 x with the separate logp_old pass), as
    slime's perf/actor_train_tflops; perf/mfu against trainer.peak_tflops, absent without it."""
    from trainer_setup import make_trainer
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    for mode, k in (("from_train_forward", 6), ("separate_pass", 8)):
        src = ListSource([make_batch(2, 4, seed=1, version=0)])
        tr = make_trainer(_cfg(peak_tflops=0.5, old_logprobs=mode), src, model_path, str(tmp_path / mode))
        m = tr.step()
        want = k * params * m["tokens/total"] / m["time/train_s"] / 1e12
        assert m["perf/tflops"] == pytest.approx(want, rel=0.05), mode  # tied head counted once
        assert m["perf/mfu"] == pytest.approx(m["perf/tflops"] / 0.5)
    m = make_trainer(
        _cfg(), ListSource([make_batch(2, 4, version=0)]), model_path, str(tmp_path / "p")
    ).step()
    assert "perf/tflops" in m and "perf/mfu" not in m


def test_logp_old_is_the_trainers_own(model_path, tmp_path):
    """With rollout logprobs taken from an HF forward of the same weights, TIS weights are 1."""
    from trainer_setup import make_trainer
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    samples = make_samples(2, 3, seed=5)
    for s in samples:
        p, y = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + y])).logits[0], -1)
        s.rollout_logprobs = (
            lp[len(p) - 1 : -1].gather(-1, torch.tensor(y)[:, None]).squeeze(-1).numpy().tobytes()
        )
    tr = make_trainer(
        _cfg(micro_batch_tokens=32), ListSource([samples_to_batch(samples)]), model_path, str(tmp_path)
    )
    m = tr.step()
    assert m["logp/abs_diff_train_rollout"] <= 1e-4
    # every token was "generated" at version 0, the trainer's weights: all count as same-version
    assert m["logp/same_version_tokens"] == m["tokens/trained"] > 0
    assert m["logp/abs_diff_same_version"] <= 1e-4
    assert abs(m["tis/weight_mean"] - 1.0) <= 1e-4 and m["tis/clip_frac"] == 0.0


def test_errors_are_clear(model_path, tmp_path):
    from trainer_setup import make_trainer

    tr = make_trainer(_cfg(fetch_timeout_s=0.1), ListSource([]), model_path, str(tmp_path))
    with pytest.raises(TimeoutError, match=r"list-source \(tests\) within trainer.fetch_timeout_s=0.1s"):
        tr.step()
    with pytest.raises(ValueError, match="empty batch"):
        tr.train_on_batch(make_batch(1, 2).slice(0, 0))
    aborted = [
        msgspec.structs.replace(
            s, response_ids=b"", rollout_logprobs=b"", versions=b"", loss_mask=b"", status=Status.ABORTED
        )
        for s in make_samples(1, 2)
    ]
    with pytest.raises(ValueError, match=r"no response tokens at all \(statuses: \['aborted'\]"):
        tr.train_on_batch(samples_to_batch(aborted))
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        make_trainer(
            _cfg(micro_batch_tokens=8), ListSource([]), model_path, str(tmp_path / "b")
        ).train_on_batch(make_batch(1, 2))


def test_killed_trainer_resumes_at_next_version_without_reusing_samples(model_path, tmp_path):
    from trainer_setup import make_trainer

    from buffer.config import BufferConfig
    from buffer.inproc import InProcBuffer
    from stages.trainer.checkpoint import latest_path

    class Recording:
        def __init__(self, inner):
            self.inner, self.uids, self.address = inner, [], "inproc"

        def fetch(self, *a):
            b = self.inner.fetch(*a)
            if b is not None:
                self.uids += b.column("uid").to_pylist()
            return b

        def set_version(self, v):
            self.inner.set_version(v)

        def stats(self):
            return self.inner.stats()

    bcfg = BufferConfig(policy="fifo")
    buf = InProcBuffer(cfg=bcfg, directory=tmp_path / "buf")
    buf.put(make_samples(8, 2, seed=3))
    cfg = _cfg(checkpoint_every=1)
    cfg.run.max_staleness = 100
    first = Recording(buf)
    tr = make_trainer(cfg, first, model_path, str(tmp_path / "run"))
    tr.step(), tr.step()
    saved = {n: p.detach().clone() for n, p in tr.policy.model.named_parameters()}
    del tr  # "killed": no close(), the last checkpoint is the one written after step 2
    assert latest_path(str(tmp_path / "run")).endswith("step_000002")
    buf2 = InProcBuffer(cfg=bcfg, directory=tmp_path / "buf")  # the buffer restarts too, from its files
    second = Recording(buf2)
    tr2 = make_trainer(cfg, second, model_path, str(tmp_path / "run"))
    assert tr2.version == 2
    for n, p in tr2.policy.model.named_parameters():
        assert torch.equal(p, saved[n]), n
    m = tr2.step()
    assert m["version"] == 3
    assert second.uids and not set(second.uids) & set(first.uids)


def test_replay_cli(model_path, tmp_path):
    import pyarrow as pa

    d = tmp_path / "rec"
    d.mkdir()
    for i in range(2):  # stream format, as buffer/segments.py writes
        b = make_batch(2, 2, seed=i)
        with pa.OSFile(str(d / f"seg-{i:06d}.arrow"), "wb") as f, pa.ipc.new_stream(f, b.schema) as w:
            w.write(b)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.trainer",
            "--replay",
            str(d),
            "--run-dir",
            str(run_dir),
            "--model-path",
            model_path,
            "run.steps=5",
            "trainer.batch_groups=2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in open(run_dir / "trainer_metrics.jsonl")]
    assert [m["version"] for m in lines] == [1, 2]  # 4 groups / 2 per step, then the replay ends
    assert (run_dir / "hf" / "final" / "model.safetensors").exists()


def test_cli_against_live_buffer_then_replay_its_segments(model_path, tmp_path):
    """`--buffer tcp://...` trains from a running BufferServer; `--replay` then trains on the
    segment files that same buffer wrote (the recorded-directory format written by buffer/segments.py)."""
    from buffer.client import BufferClient
    from buffer.config import BufferConfig
    from buffer.server import BufferServer

    srv = BufferServer(BufferConfig(policy="fifo"), str(tmp_path / "buf")).start()
    try:
        client = BufferClient(srv.address, producer="test")
        client.put(make_samples(4, 2, seed=11))
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        common = ["--model-path", model_path, "run.steps=2", "trainer.batch_groups=2", "run.max_staleness=10"]
        live = subprocess.run(
            [
                sys.executable,
                "-m",
                "stages.trainer",
                "--buffer",
                srv.address,
                "--run-dir",
                str(tmp_path / "a"),
                *common,
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert live.returncode == 0, live.stderr[-3000:]
        assert [json.loads(x)["version"] for x in open(tmp_path / "a" / "trainer_metrics.jsonl")] == [1, 2]
        client.close()
    finally:
        srv.stop()
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.trainer",
            "--replay",
            str(tmp_path / "buf"),
            "--run-dir",
            str(tmp_path / "b"),
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert [json.loads(x)["version"] for x in open(tmp_path / "b" / "trainer_metrics.jsonl")] == [1, 2]


def test_several_updates_per_batch_move_the_ratio_and_clip(model_path, tmp_path):
    """trainer.ppo_epochs x mini_batches: the first update sees ratio 1 (logp_old = the weights before
    it), later ones see the policy move away from logp_old, so PPO clipping acts; one version per batch.
    With one update per batch clipping never acts (the issue's finding)."""
    from trainer_setup import make_trainer

    def run(**kw):
        src = ListSource([make_batch(4, 4, seed=3, version=0)])
        tr = make_trainer(_cfg(batch_groups=4, lr=0.05, **kw), src, model_path, str(tmp_path / str(kw)))
        return tr, tr.step()

    tr, one = run()
    assert one["ppo/clip_frac"] == 0.0 and tr.version == 1
    tr, many = run(ppo_epochs=3, mini_batches=2)
    assert tr.version == 1  # one batch, one version
    assert many["ppo/clip_frac"] > 0.0  # 6 updates at a large lr: later ones clip
    assert many["tokens/trained"] == pytest.approx(3 * one["tokens/trained"])  # every epoch's tokens
    with pytest.raises(ValueError, match="trainer.mini_batches=64 but this rank has 16 samples"):
        run(mini_batches=64)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_resumed_trainer_takes_the_step_the_uninterrupted_one_takes(model_path, tmp_path, optimizer):
    """The checkpoint holds the optimizer's state as well as the weights: Adam's moments, SGD's momentum
    (megatron 0.16 could not load SGD's at all). From step 2's checkpoint, a new trainer's step 3 on the
    same batch lands on the weights of the trainer that was never stopped."""
    from trainer_setup import make_trainer

    batches = [make_batch(2, 4, seed=i) for i in range(3)]
    first = make_trainer(
        _cfg(optimizer=optimizer, checkpoint_every=1), ListSource(batches), model_path, str(tmp_path)
    )
    first.step(), first.step()
    second = make_trainer(_cfg(optimizer=optimizer), ListSource(batches[2:]), model_path, str(tmp_path))
    assert second.version == 2
    first.step(), second.step()
    for (name, a), (_, b) in zip(
        first.policy.model.named_parameters(), second.policy.model.named_parameters()
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_checkpoint_saved_before_any_step_resumes(model_path, tmp_path):
    """A run that ends before its first step (a time limit, Ctrl-C) still saves, at version 0, with no
    optimizer state made yet: a re-run in its directory resumes from it and trains (it failed on the
    optimizer's keys, which such a checkpoint does not have)."""
    from trainer_setup import make_trainer

    from stages.trainer.checkpoint import latest_path

    make_trainer(_cfg(), ListSource([]), model_path, str(tmp_path)).close()
    assert latest_path(str(tmp_path)).endswith("step_000000")
    again = make_trainer(_cfg(), ListSource([make_batch(2, 4, seed=0)]), model_path, str(tmp_path))
    assert again.version == 0 and again.step()["version"] == 1
