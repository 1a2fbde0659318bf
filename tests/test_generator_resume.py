"""A healed generator resumes where it was (issue #36): its data position is made durable group by group
(a prompt whose group the buffer acked is never drawn again, one in flight at the kill is drawn again),
and its admission state is rebuilt from what its predecessor left live in the buffer (no fresh window,
so no over-generation for the buffer to evict). In-process: a real buffer, the tiny torch engine, a
generator "killed" by cancelling its run (no stop, no last save) and a new incarnation from its state.

And it samples what an uninterrupted one samples (issue #39): requests carry seeds made from their
prompt's position, and a seeded draw depends on (seed, position) only, not on the batch or the engine's
history; a resumed generator on a new engine stores the very tokens of the uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from test_rollout_generator import make_cfg, rollout_args, started_when_settled

from buffer.config import BufferConfig
from buffer.inproc import InProcBuffer
from stages.models import resolve_model
from stages.rollout.build import build_engine
from stages.rollout.generator import DATA_POS_KEY, Generator
from stages.rollout.position import sample_seed
from stages.rollout.sampling import sample, sampling_logprobs
from stages.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)


class PeekableBuffer(InProcBuffer):
    """The in-process buffer with the peek a BufferClient has (the generator asks it at a resume), and a
    trap: the put of group number `hang_at` (0-based) is stored and acked by the buffer, then never
    returns to the generator, which is killed meanwhile: acked, but its state was never written."""

    def __init__(self, hang_at: int | None = None):
        super().__init__(cfg=BufferConfig(capacity_samples=10_000))
        self.hang_at, self.puts = hang_at, 0
        self.hung, self.release = threading.Event(), threading.Event()

    def put(self, samples, timeout_s: float = 60.0):
        ack = super().put(samples, timeout_s)
        self.puts += 1
        if self.hang_at is not None and self.puts == self.hang_at + 1:
            self.hung_pos = tuple(samples[0].metadata[DATA_POS_KEY])
            self.hung.set()
            self.release.wait(30)
        return ack

    def peek(self, limit: int = 100):
        with self._cond:
            return self.buffer.peek(limit)

    def positions(self) -> list[tuple[int, int]]:
        """The data position of every stored group (the prompt it was made from), one per group."""
        batch = self.peek(1_000_000)
        seen: dict[str, tuple[int, int]] = {}
        for gid, meta in zip(batch.column("group_id").to_pylist(), batch.column("metadata").to_pylist()):
            seen.setdefault(gid, tuple(json.loads(meta)[DATA_POS_KEY]))
        return list(seen.values())


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return make_cfg(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(cfg):
    eng = build_engine(*rollout_args(cfg))
    yield eng
    eng.close()


async def _kill_after(gen: Generator, sink: PeekableBuffer) -> None:
    """Run `gen` until the buffer holds the group it hangs on, then kill it (cancel: no stop, no save)."""
    task = asyncio.create_task(gen.run())
    while not sink.hung.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    sink.release.set()


def test_a_healed_generator_draws_no_acked_prompt_again_and_every_unacked_one(cfg, engine, tmp_path):
    engine.update_weights([], version=0)
    sink = PeekableBuffer(hang_at=5)
    state = tmp_path / "gen-0.json"
    a = Generator(*rollout_args(cfg), sink, engine, "gen-0.a", batch_groups=0, state_path=state)
    asyncio.run(_kill_after(a, sink))
    acked_by_a = set(sink.positions())
    drawn_by_a = set(a.position.drawn()) | acked_by_a
    assert len(acked_by_a) == 6  # 5 groups acked and settled, the 6th acked by the buffer as a was killed
    settled = acked_by_a - {sink.hung_pos}
    saved = json.loads(state.read_text())
    # the durable position: the oldest prompt not settled, and the settled ones after it; the one acked
    # at the kill is not there (a wrote nothing after it): the buffer tells the next incarnation
    low = (saved["data"]["epoch"], saved["data"]["index"])
    assert low == min(drawn_by_a - settled)
    assert {tuple(p) for p in saved["done"]} == {p for p in settled if p > low}
    assert saved["incarnations"] == ["gen-0.a"]

    b = Generator(*rollout_args(cfg), sink, engine, "gen-0.b", batch_groups=0, state_path=state)
    b.load_state_dict(json.loads(state.read_text()))
    drawn_by_b: list[tuple[int, int]] = []
    draw = b.position.draw

    def spy(gid):
        prompt = draw(gid)
        drawn_by_b.append(b.position.of(gid))
        return prompt

    b.position.draw = spy
    stats = asyncio.run(b.run(max_groups=8))
    assert stats["resumed"]["live_groups"] == 6 and stats["resumed"]["settled_from_buffer"] >= 1
    assert not set(drawn_by_b) & acked_by_a, "a prompt the buffer acked was generated again"
    stored = sink.positions()
    assert len(stored) == len(set(stored)) == 14, "a prompt was stored twice"
    # nothing skipped either: the stored prompts are exactly the first 14 of the source's order
    order = sorted(stored)
    assert order == [(0, i) for i in range(14)]
    # every prompt a drew and never got acked was drawn again by b
    assert drawn_by_a - acked_by_a <= set(drawn_by_b)
    final = json.loads(state.read_text())
    assert final["incarnations"] == ["gen-0.a", "gen-0.b"]
    assert (final["data"]["epoch"], final["data"]["index"]) == (0, 14) and final["done"] == []


def test_the_position_is_written_with_each_acked_group_not_on_a_timer(cfg, engine, tmp_path):
    engine.update_weights([], version=0)
    sink = PeekableBuffer()
    state = tmp_path / "gen.json"
    gen = Generator(*rollout_args(cfg), sink, engine, "gen-1.a", batch_groups=0, state_path=state)
    writes: list[tuple[int, int]] = []  # (groups the buffer acked by then, groups the state settles)
    write = gen._write_state

    def write_and_look():
        write()
        s = json.loads(state.read_text())
        writes.append((sink.puts, s["data"]["index"] + len(s["done"])))

    gen._write_state = write_and_look
    asyncio.run(gen.run(max_groups=6))
    s = json.loads(state.read_text())
    assert (s["data"]["epoch"], s["data"]["index"], s["done"]) == (0, 6, [])
    # one write per acked group, each settling one more; never a prompt the buffer has not acked
    assert [n for _, n in writes] == list(range(1, 7))
    assert all(n <= acked for acked, n in writes)


def test_a_heal_keeps_the_live_groups_admission_places(cfg, engine, tmp_path):
    # trainer (and engine) at version 5, batch 2, max_staleness 1: a generator may have (1 + 1) * 2 = 4
    # groups unconsumed. Its predecessor left 3 live in the buffer: the heal may start 1 more, where
    # fresh counters would start (5 + 1 + 1) * 2 = 14, most of them evicted as too stale later.
    window = (cfg.run.max_staleness + 1) * 2
    engine.update_weights([], version=5)
    sink = PeekableBuffer()
    sink.set_version(5)
    state = tmp_path / "gen.json"
    a = Generator(*rollout_args(cfg), sink, engine, "gen-2.a", batch_groups=2, state_path=state)
    asyncio.run(a.run(max_groups=3))

    async def heal() -> int:
        b = Generator(*rollout_args(cfg), sink, engine, "gen-2.b", batch_groups=2, state_path=state)
        b.load_state_dict(json.loads(state.read_text()))
        task = asyncio.create_task(b.run())
        started = await started_when_settled(b, window - 3)
        b.stop()
        await asyncio.wait_for(task, 30)
        return started

    assert asyncio.run(heal()) == window - 3
    assert len(sink.positions()) == window


# -- exact resume of the random draws (issue #39) ------------------------------------------------------
def _engine(cfg, kind, seed: int):
    """A fresh engine with its own engine-wide seed (a restarted generator process gets a new one)."""
    if kind is TorchEngine:
        return build_engine(*rollout_args(cfg), seed=seed)
    r = cfg.rollout
    return kind(
        resolve_model(cfg.model),
        dtype=cfg.model.dtype,
        max_batch_size=r.max_batch_size,
        chunk_tokens=r.chunk_tokens,
        seed=seed,
    )


def _tokens(sink: PeekableBuffer) -> dict[tuple, tuple[int, ...]]:
    """Every stored sample's response tokens by (its prompt's data position, its index in the group)."""
    batch = sink.peek(1_000_000)
    cols = [batch.column(c).to_pylist() for c in ("metadata", "group_index", "response_ids")]
    return {(tuple(json.loads(m)[DATA_POS_KEY]), i): tuple(r) for m, i, r in zip(*cols, strict=True)}


def _uninterrupted_and_resumed(cfg, kind, tmp_path) -> tuple[dict, dict]:
    """The tokens of 10 groups made by one generator, and of 10 made by one killed at its 4th put and
    resumed from its state on a new engine (its in-flight prompts drawn again), each on fresh engines."""
    whole, cut = PeekableBuffer(), PeekableBuffer(hang_at=3)
    engines = [_engine(cfg, kind, seed) for seed in (11, 22, 33)]
    try:
        asyncio.run(
            Generator(*rollout_args(cfg), whole, engines[0], "gen-0.u", batch_groups=0).run(max_groups=10)
        )
        state = tmp_path / "gen.json"
        a = Generator(*rollout_args(cfg), cut, engines[1], "gen-0.a", batch_groups=0, state_path=state)
        asyncio.run(_kill_after(a, cut))
        b = Generator(*rollout_args(cfg), cut, engines[2], "gen-0.b", batch_groups=0, state_path=state)
        b.load_state_dict(json.loads(state.read_text()))
        asyncio.run(b.run(max_groups=10 - len(cut.positions())))
    finally:
        for e in engines:
            e.close()
    return _tokens(whole), _tokens(cut)


def test_a_resumed_generator_samples_the_tokens_an_uninterrupted_one_samples(cfg, tmp_path):
    whole, resumed = _uninterrupted_and_resumed(cfg, TorchEngine, tmp_path)
    assert set(whole) == set(resumed) and len({p for p, _ in whole}) == 10
    differ = [k for k in whole if whole[k] != resumed[k]]
    assert not differ, f"{len(differ)} of {len(whole)} samples differ, e.g. {differ[:3]}"
    assert len(set(whole.values())) > len(whole) // 2, "the samples of a group are not told apart"


def test_the_torch_engine_itself_samples_the_same_tokens_after_a_resume(cfg, tmp_path):
    """The torch engine's own sampling honours the requests' seeds (SamplingParams.seed with the token's
    position), so a resumed generator's engine draws what the uninterrupted one drew."""
    whole, resumed = _uninterrupted_and_resumed(cfg, TorchEngine, tmp_path)
    assert whole == resumed


def test_a_seeded_row_draws_the_same_token_whatever_the_batch_and_engine_history():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    ones, nucleus = torch.ones(3), torch.tensor([1.0, 0.9, 1.0])
    alone = sample(logits[:1], ones[:1], nucleus[:1], seeds=[7], positions=[12])
    g = torch.Generator().manual_seed(123)
    g.seed()  # whatever state the engine-wide generator is in
    batched = sample(logits, ones, nucleus, g, seeds=[7, None, 8], positions=[12, 3, 12])
    assert batched[0][0] == alone[0][0] and torch.equal(batched[1][:1], alone[1])
    moved = [sample(logits[:1], ones[:1], nucleus[:1], seeds=[7], positions=[p])[0].item() for p in range(40)]
    assert len(set(moved)) > 5, "the position does not change the draw"


def test_seeded_draws_follow_the_sampling_distribution():
    """Over many seeds, a seeded row's token frequencies are its sampling distribution's (top-p 0.8)."""
    torch.manual_seed(1)
    logits = torch.randn(1, 8) * 2
    temperature, top_p = torch.tensor([0.9]), torch.tensor([0.8])
    n = 6000
    rows = logits.expand(n, 8)
    tokens, _ = sample(rows, temperature.expand(n), top_p.expand(n), seeds=list(range(n)), positions=[5] * n)
    want = sampling_logprobs(logits, temperature, top_p).exp()[0]
    got = torch.bincount(tokens, minlength=8).float() / n
    assert torch.all(got[want == 0] == 0), "a token outside the nucleus was drawn"
    assert torch.allclose(got, want, atol=4 * (0.25 / n) ** 0.5), (got, want)


def test_request_seeds_depend_on_the_prompt_and_place_not_on_the_incarnation():
    one = sample_seed(0, "gen-0", (0, 3), "-1")
    assert one == sample_seed(0, "gen-0", (0, 3), "-1")
    others = [
        sample_seed(1, "gen-0", (0, 3), "-1"),  # another run seed
        sample_seed(0, "gen-1", (0, 3), "-1"),  # another generator of the run (same data order)
        sample_seed(0, "gen-0", (1, 3), "-1"),  # the same prompt in the next epoch
        sample_seed(0, "gen-0", (0, 3), "-2"),  # another sample of the group
    ]
    assert len({one, *others}) == 5 and all(0 <= s < 2**31 for s in (one, *others))
