"""A healed generator resumes where it was (issue #36): its data position is made durable group by group
(a prompt whose group the buffer acked is never drawn again, one in flight at the kill is drawn again),
and its admission state is rebuilt from what its predecessor left live in the buffer (no fresh window,
so no over-generation for the buffer to evict). In-process: a real buffer, the tiny torch engine, a
generator "killed" by cancelling its run (no stop, no last save) and a new incarnation from its state."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from test_rollout_generator import make_cfg, rollout_args, started_when_settled

from buffer.config import BufferConfig
from buffer.inproc import InProcBuffer
from stages.rollout.build import build_engine
from stages.rollout.generator import DATA_POS_KEY, Generator

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
