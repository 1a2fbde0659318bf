"""Two promises pinned end to end (issue #36), each with a mutant in bench/mutations.py:

- through the real trainer -> buffer fetch path (Trainer.step -> BatchFeed -> the buffer's fetch), a sample
  exactly run.max_staleness versions old may be trained and an older one never is;
- after a resume from a checkpoint, the learning rate at every step equals the uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch

from buffer.config import BufferConfig
from buffer.inproc import InProcBuffer
from pipeline.config import RunConfig
from stages.trainer.testing import ListSource, make_batch, make_samples, make_tiny_hf

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


class Served:
    """The in-process buffer as the trainer's source, recording the uids each fetch served."""

    def __init__(self, inner: InProcBuffer):
        self.inner, self.uids, self.address = inner, [], "inproc"

    def fetch(self, *a, **kw):
        b = self.inner.fetch(*a, **kw)
        if b is not None:
            self.uids += b.column("uid").to_pylist()
        return b

    def set_version(self, v):
        self.inner.set_version(v)

    def stats(self):
        return self.inner.stats()


def test_a_sample_exactly_max_staleness_old_is_trained_and_an_older_one_never(model_path, tmp_path):
    from trainer_setup import make_trainer

    staleness, version = 1, 3
    buf = InProcBuffer(cfg=BufferConfig())  # staleness_fifo: oldest first, stale groups evicted
    # oldest first: one group too old (its tokens 2 versions behind the trainer), then two exactly at
    # the bound (1 behind), all three complete before the trainer asks
    too_old = make_samples(1, 4, seed=1, version=version - staleness - 1, prefix="old-")
    at_bound = make_samples(2, 4, seed=2, version=version - staleness, prefix="edge-")
    buf.put(too_old), buf.put(at_bound)
    cfg = RunConfig()
    cfg.run.max_staleness = staleness
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens, cfg.trainer.fetch_timeout_s = 2, 64, 3.0
    source = Served(buf)
    tr = make_trainer(cfg, source, model_path, str(tmp_path))
    tr.version = version  # as a trainer resumed at this version: the feed announces and asks with it
    tr.feed.set_version(version)
    m = tr.step()  # the real path: Trainer.step -> BatchFeed.fetch -> the buffer's fetch
    assert sorted(source.uids) == sorted(s.uid for s in at_bound), "the samples at the bound were not trained"
    assert not {s.uid for s in too_old} & set(source.uids), "a sample older than max_staleness was trained"
    assert m["version"] == version + 1
    assert buf.stats()["evicted_stale"] == len(too_old)


def _lrs(model_path, run_dir, batches, steps: int, **trainer) -> tuple[list[float], object]:
    from trainer_setup import make_trainer

    cfg = RunConfig()
    cfg.run.steps = 8
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens = 2, 64
    cfg.trainer.warmup_steps, cfg.trainer.lr_schedule, cfg.trainer.min_lr = 3, "cosine", 1e-7
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    tr = make_trainer(cfg, ListSource(batches), model_path, str(run_dir))
    return [tr.step()["lr"] for _ in range(steps)], tr


def test_the_learning_rate_after_a_resume_is_the_uninterrupted_runs(model_path, tmp_path):
    batches = [make_batch(2, 4, seed=i) for i in range(8)]
    straight, _ = _lrs(model_path, tmp_path / "straight", batches, 8)
    # warmup then cosine: a schedule that moves at every step (a restart shows at once)
    assert len(set(straight)) >= 7  # (warmup ends at trainer.lr, where the cosine starts)
    before, first = _lrs(model_path, tmp_path / "resumed", batches[:2], 2, checkpoint_every=2)
    del first  # killed: no close(); the newest checkpoint is step 2's
    after, second = _lrs(model_path, tmp_path / "resumed", batches[2:], 6)
    assert second.start_version == 2
    assert before + after == pytest.approx(straight, rel=1e-9, abs=0.0)
