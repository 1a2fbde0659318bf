"""Custom rollout hooks: a generate_fn's returns are checked, filters and rollout_fns load from a file
outside the repository by "path.py:function", a rollout_fn runs under admission control, and bad specs
fail naming the key."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import msgspec
import pytest
from test_multiturn import EOS, ScriptedEngine, _cfg, _run
from test_rollout_generator import FakeSink, rollout_args

from buffer import wire
from buffer.record import Status
from pipeline.config import ConfigError, from_dict
from stages.rollout.generator import Generator
from stages.rollout.hooks import HookError, check_hooks, fill_response, load_hook

ANSWER = [ord("7"), EOS]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from stages.models import build_byte_tokenizer

    return build_byte_tokenizer(tmp_path_factory.mktemp("tok"))


async def short_versions(ctx):
    """A buggy generate_fn: one version too few for its response."""
    (res,) = await ctx.engine.generate(ctx.prompt.ids, ctx.params)
    s = ctx.sample
    from stages.rollout.hooks import fill_response

    return fill_response(
        s, response_ids=res.response_ids, rollout_logprobs=res.logprobs, versions=res.versions[:-1]
    )


async def new_samples(ctx):
    """A buggy generate_fn: returns Samples of its own making."""
    from buffer.record import Sample

    return [
        Sample.build(uid="x", group_id="y", prompt_ids=[1], response_ids=[], rollout_logprobs=[], versions=[])
    ]


def test_a_generate_fn_with_mismatched_arrays_stops_the_run_naming_function_and_field(tok):
    cfg = _cfg(group_size=2, generate_fn="test_rollout_hooks:short_versions", generate_per_sample=True)
    with pytest.raises(
        HookError,
        match=r"test_rollout_hooks:short_versions.*versions has 1 entries but "
        r"response_ids has 2",
    ):
        _run(cfg, ScriptedEngine([(ANSWER, "stop", None)]), tok)
    cfg = _cfg(group_size=1, generate_fn="test_rollout_hooks:new_samples")
    with pytest.raises(HookError, match=r"new_samples: sample mt-0-0 came back with another uid"):
        _run(cfg, ScriptedEngine([(ANSWER, "stop", None)]), tok)


def test_the_default_generator_is_a_generate_fn_and_per_sample_calls_count(tok):
    engine = ScriptedEngine([(ANSWER, "stop", None)])
    sink, stats = _run(_cfg(group_size=3), engine, tok, groups=2)
    assert stats["groups_finished"] == 2 and len(engine.prompts) == 6
    for s in (s for g in sink.groups.values() for s in g):
        assert s.array("response_ids").tolist() == ANSWER and s.array("loss_mask").tolist() == [1, 1]
        assert s.status == Status.COMPLETED and s.generator_id == "mt" and s.prompt.startswith("<|im_start|>")


HOOKS_FILE = '''
from stages.rollout.hooks import fill_response

def keep_first_group(samples):
    return samples[0].group_id.endswith("-0")

async def one(ctx, group):
    results = await ctx.engine.generate(group.prompt.ids, ctx.params, n=len(group.samples))
    for s, r in zip(group.samples, results):
        fill_response(s, response_ids=r.response_ids, rollout_logprobs=r.logprobs, versions=r.versions)
        s.metadata["by"] = ctx.kwargs["tag"]
    return group.samples

async def my_rollout(ctx):
    """At most two groups at a time, each member answered by one engine call; yields them as they
    finish, waiting for the next start and the running groups together."""
    running, starting = set(), None
    while True:
        if starting is None and len(running) < 2:
            starting = asyncio.ensure_future(ctx.start_group())
        done, _ = await asyncio.wait(running | ({starting} - {None}), return_when=asyncio.FIRST_COMPLETED)
        for d in done & running:
            running.discard(d)
            yield d.result()
        if starting is not None and starting in done:
            group, starting = starting.result(), None
            if group is None:
                break
            running.add(asyncio.ensure_future(one(ctx, group)))
    for d in asyncio.as_completed(running):
        yield await d

async def holds_finished_groups(ctx):
    """The loop docs/rollouts.md used to show: it waits in start_group() while a finished group is
    still un-yielded, which admission counts as live."""
    pending = set()
    while (group := await ctx.start_group()) is not None:
        pending.add(asyncio.ensure_future(one(ctx, group)))
        if len(pending) >= 2:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for d in done:
                yield d.result()
    for d in asyncio.as_completed(pending):
        yield await d

async def bad_rollout(ctx):
    group = await ctx.start_group()
    for s in group.samples:  # an empty response is fine when it is filled in, but ...
        fill_response(s, response_ids=[], rollout_logprobs=[], versions=[])
    yield group.samples
    yield ["not a sample"]

async def unfilled_rollout(ctx):
    group = await ctx.start_group()
    yield group.samples
'''


@pytest.fixture
def hooks_file(tmp_path):
    path = tmp_path / "outside" / "my_hooks.py"  # a file outside the repository, not on sys.path
    path.parent.mkdir()
    path.write_text("import asyncio\n" + textwrap.dedent(HOOKS_FILE))
    return path


def test_a_rollout_fn_from_a_file_outside_the_repo_streams_groups(tok, hooks_file):
    cfg = _cfg(group_size=2, rollout_fn=f"{hooks_file}:my_rollout", generate_kwargs={"tag": "mine"})
    engine = ScriptedEngine([(ANSWER, "stop", None)])
    sink, stats = _run(cfg, engine, tok, groups=5)
    assert stats["groups_started"] == stats["groups_finished"] == 5 and len(sink.groups) == 5
    assert all(s.metadata["by"] == "mine" and s.reward >= 0 for g in sink.groups.values() for s in g)


def test_a_rollout_fn_is_held_by_admission_control(tok, hooks_file):
    """No trainer consumes: at engine version 0 and batch 1 the generator admits (0 + max_staleness + 1)
    groups and no more, whoever runs the loop."""
    cfg = _cfg(group_size=2, rollout_fn=f"{hooks_file}:my_rollout", generate_kwargs={"tag": "x"})
    gen = Generator(
        *rollout_args(cfg),
        FakeSink(),
        ScriptedEngine([(ANSWER, "stop", None)]),
        "adm",
        batch_groups=1,
        source=_source(cfg, tok),
        tokenizer=tok,
    )

    async def run():
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(1.0)
        gen.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    assert gen.counters["groups_started"] == gen.counters["groups_finished"] == cfg.run.max_staleness + 1


def test_filter_by_path_and_a_bad_rollout_fn_named(tok, hooks_file):
    cfg = _cfg(group_size=2, filter=f"{hooks_file}:keep_first_group")
    sink, stats = _run(cfg, ScriptedEngine([(ANSWER, "stop", None)]), tok, groups=3)
    assert list(sink.groups) == ["mt-0"] and stats["groups_filtered"] == 2
    cfg = _cfg(group_size=1, rollout_fn=f"{hooks_file}:bad_rollout")
    with pytest.raises(HookError, match="bad_rollout yielded list that is not the samples of a group"):
        _run(cfg, ScriptedEngine([(ANSWER, "stop", None)]), tok, groups=3)


def test_bad_hook_specs_name_the_key(tmp_path, hooks_file):
    with pytest.raises(
        ConfigError, match=r"rollout.filter='nonzero': expected .* or one of none, nonzero_std"
    ):
        from_dict({"rollout": {"filter": "nonzero"}})
    with pytest.raises(ConfigError, match="rollout_fn replaces the generation loop"):
        from_dict({"rollout": {"generate_fn": "a:b", "rollout_fn": "c:d"}})
    with pytest.raises(HookError, match=r"rollout.generate_fn='no_such_module_xyz:f': cannot import"):
        load_hook("no_such_module_xyz:f", "rollout.generate_fn")
    with pytest.raises(HookError, match=r"no file .*missing.py"):
        load_hook(f"{tmp_path}/missing.py:f", "rollout.rollout_fn")
    with pytest.raises(HookError, match="has no callable 'nope'"):
        load_hook(f"{hooks_file}:nope", "rollout.filter")
    cfg = from_dict({"rollout": {"generate_fn": f"{hooks_file}:keep_first_group"}})
    with pytest.raises(HookError, match="must be an `async def` function"):
        Generator(
            *rollout_args(cfg), FakeSink(), ScriptedEngine([]), "g", 0, source=iter(()), tokenizer=object()
        )


def _source(cfg, tokenizer):
    from stages.rollout.data import PromptSource

    return PromptSource(cfg.rollout.data, tokenizer)


def _doc_examples(tmp_path) -> dict[str, str]:
    """The ```python blocks of docs/rollouts.md that start with '# <file>.py', written into tmp_path."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "rollouts.md").read_text()
    files = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        name = block.splitlines()[0].removeprefix("# ").strip()
        if name.endswith(".py"):
            (tmp_path / name).write_text(block)
            files[name] = str(tmp_path / name)
    return files


def test_the_examples_of_docs_rollouts_run(tok, tmp_path):
    files = _doc_examples(tmp_path)
    # my_agent.py (rollout.agent_fn) is run by tests/test_agent_episodes.py
    assert set(files) == {"my_env.py", "my_loop.py", "my_filter.py", "my_agent.py"}
    engine = ScriptedEngine([(ANSWER, "stop", None)])
    cfg = _cfg(group_size=2, generate_fn=f"{files['my_env.py']}:generate", generate_kwargs={"hint": "Check."})
    sink, _ = _run(cfg, engine, tok)
    for s in next(iter(sink.groups.values())):
        mask = s.array("loss_mask").tolist()
        assert mask[:2] == [1, 1] and mask[-2:] == [1, 1] and 0 in mask and s.metadata["model_turns"] == 2
    for fn in ("rollout", "rollout_by_hand"):
        sink, stats = _run(
            _cfg(group_size=2, rollout_fn=f"{files['my_loop.py']}:{fn}"), engine, tok, groups=3
        )
        assert stats["groups_finished"] == 3
    sink, stats = _run(
        _cfg(group_size=2, filter=f"{files['my_filter.py']}:some_correct"), engine, tok, groups=2
    )
    assert stats["groups_filtered"] + stats["groups_finished"] == 2


# -- a trainer that consumes every group: rollout_fns under admission at max_staleness 0 ------------------
class ConsumingSink(FakeSink):
    """A trainer with batch_groups=1 that trains on each group as it arrives: every put is one step,
    whose weights (version + 1) reach the engine before the ack. Records each sample's staleness."""

    def __init__(self, engine):
        super().__init__()
        self.engine, self.staleness = engine, []

    def put(self, samples, timeout_s: float = 60.0) -> wire.IngestAck:
        super().put(samples)
        with self.lock:
            self.staleness += [self.trainer_version - s.min_version() for s in samples]
            self.trainer_version += 1
            v = self.trainer_version
        self.engine.update_weights([], version=v)
        return wire.IngestAck(seq=0, accepted=len(samples), duplicates=0, rejected=0, trainer_version=v)


def _run_consumed(cfg, tok, engine=None, groups=4, timeout_s=10.0):
    """Run to `groups` groups with batch_groups=1 against a ConsumingSink (a wedged loop fails the
    wait instead of hanging the suite)."""
    engine = engine or ScriptedEngine([(ANSWER, "stop", None)])
    sink = ConsumingSink(engine)
    gen = Generator(
        *rollout_args(cfg), sink, engine, "c", batch_groups=1, source=_source(cfg, tok), tokenizer=tok
    )
    stats = asyncio.run(asyncio.wait_for(gen.run(max_groups=groups), timeout_s))
    return sink, stats


def _strict(**rollout):
    cfg = _cfg(group_size=2, generate_kwargs={"tag": "x"}, **rollout)
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, max_staleness=0))


def test_rollout_fns_keep_a_consuming_trainer_fed_at_max_staleness_0(tok, hooks_file, tmp_path):
    """At max_staleness 0 and one group per step, the next group may start only after the trainer
    consumed the last one. The loop the docs used to show waited in start_group() holding that group
    (started 1, finished 0, forever); the docs' loops, run_groups and the by-hand one, and the test's
    own loop yield finished groups while they wait for admission."""
    files = _doc_examples(tmp_path)
    for spec in (
        f"{files['my_loop.py']}:rollout",
        f"{files['my_loop.py']}:rollout_by_hand",
        f"{hooks_file}:my_rollout",
    ):
        sink, stats = _run_consumed(_strict(rollout_fn=spec), tok)
        assert stats["groups_started"] == stats["groups_finished"] == 4, spec
        assert sink.trainer_version == 4 and set(sink.staleness) == {0}, spec


def test_a_rollout_fn_holding_finished_groups_is_named_when_held_back(tok, hooks_file, monkeypatch, caplog):
    import stages.rollout.generator as generator_module

    monkeypatch.setattr(generator_module, "HELD_BACK_WARN_S", 0.2)
    cfg = _strict(rollout_fn=f"{hooks_file}:holds_finished_groups")
    engine = ScriptedEngine([(ANSWER, "stop", None)])
    gen = Generator(
        *rollout_args(cfg),
        ConsumingSink(engine),
        engine,
        "h",
        batch_groups=1,
        source=_source(cfg, tok),
        tokenizer=tok,
    )

    async def run():
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.6)
        gen.stop()  # start_group() returns None: the function yields what it held and returns
        return await asyncio.wait_for(task, 10)

    with caplog.at_level(logging.WARNING, logger=generator_module.log.name):
        stats = asyncio.run(run())
    assert stats["groups_started"] == 1 and stats["groups_finished"] == 1
    assert any(
        "1 started groups are not yet yielded by rollout.rollout_fn" in r.message
        and "holds_finished_groups (1 of them filled)" in r.message
        for r in caplog.records
    ), [r.message for r in caplog.records]


def test_run_groups_retries_engine_errors_then_abandons_the_group(tok, tmp_path):
    class FailsFirst(ScriptedEngine):
        """The first `n` calls fail (the first group's two attempts under engine_retries=1)."""

        def __init__(self, n):
            super().__init__([(ANSWER, "stop", None)])
            self.failures = n

        async def generate(self, requests):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("engine down")
            return await super().generate(requests)

    files = _doc_examples(tmp_path)
    sink, stats = _run_consumed(_strict(rollout_fn=f"{files['my_loop.py']}:rollout"), tok, FailsFirst(1))
    assert stats["engine_errors"] == 1 and stats["groups_failed"] == 0 and stats["groups_finished"] == 4
    sink, stats = _run_consumed(_strict(rollout_fn=f"{files['my_loop.py']}:rollout"), tok, FailsFirst(2))
    assert stats["engine_errors"] == 2 and stats["groups_failed"] == 1 and stats["groups_finished"] == 3
    assert "c-0" not in sink.groups
    sink, stats = _run_consumed(
        _strict(rollout_fn=f"{files['my_loop.py']}:rollout_by_hand"), tok, FailsFirst(1)
    )
    assert stats["groups_failed"] == 1 and stats["groups_finished"] == 3  # abandoned by the docs' loop


# -- unfilled samples ----------------------------------------------------------------------------------
async def forgets_to_fill(ctx):
    """A buggy generate_fn: generates, but fills only the first sample."""
    results = await ctx.engine.generate(ctx.prompt.ids, ctx.params, n=len(ctx.samples))
    r = results[0]
    fill_response(
        ctx.samples[0], response_ids=r.response_ids, rollout_logprobs=r.logprobs, versions=r.versions
    )
    return ctx.samples


async def fails_one(ctx):
    """Fills sample 0, marks sample 1 failed (a sample that went wrong, returned as such)."""
    (r,) = await ctx.engine.generate(ctx.prompt.ids, ctx.params)
    fill_response(
        ctx.samples[0], response_ids=r.response_ids, rollout_logprobs=r.logprobs, versions=r.versions
    )
    fill_response(
        ctx.samples[1],
        response_ids=[],
        rollout_logprobs=[],
        versions=[],
        status=Status.FAILED,
        error="env down",
    )
    return ctx.samples


def test_a_sample_returned_unfilled_stops_the_run_naming_function_and_sample(tok, hooks_file):
    """Blanks used to be `completed` with an empty response, so a forgotten fill trained on nothing."""
    with pytest.raises(HookError, match=r"forgets_to_fill: sample mt-0-1 was returned unfilled"):
        _run(
            _cfg(group_size=2, generate_fn="test_rollout_hooks:forgets_to_fill"),
            ScriptedEngine([(ANSWER, "stop", None)]),
            tok,
        )
    with pytest.raises(HookError, match=r"unfilled_rollout: sample mt-0-0 was returned unfilled"):
        _run(_cfg(group_size=1, rollout_fn=f"{hooks_file}:unfilled_rollout"), ScriptedEngine([]), tok)
    sink, stats = _run(
        _cfg(group_size=2, generate_fn="test_rollout_hooks:fails_one"),
        ScriptedEngine([(ANSWER, "stop", None)]),
        tok,
    )
    assert stats["samples_failed"] == 1 and stats["groups_finished"] == 1
    ok, failed = sorted(sink.groups["mt-0"], key=lambda s: s.group_index)
    assert ok.status == Status.COMPLETED and ok.error == "" and failed.error == "env down"


# -- filters -----------------------------------------------------------------------------------------------
FILTERS_FILE = """
async def async_filter(samples):
    return False

def raising_filter(samples):
    raise KeyError("reward_parts")

def forgets_to_return(samples):
    any(s.reward > 0 for s in samples)
"""


def test_a_filter_must_decide_and_its_errors_name_it(tok, tmp_path):
    path = tmp_path / "my_filters.py"
    path.write_text(FILTERS_FILE)
    with pytest.raises(HookError, match=r"async_filter'?: must be a plain `def`.*always true"):
        check_hooks(_cfg(filter=f"{path}:async_filter").rollout)
    with pytest.raises(
        HookError, match=r"rollout.filter .*raising_filter raised KeyError: 'reward_parts' \(group mt-0\)"
    ):
        _run(
            _cfg(group_size=2, filter=f"{path}:raising_filter"), ScriptedEngine([(ANSWER, "stop", None)]), tok
        )
    with pytest.raises(HookError, match=r"forgets_to_return returned NoneType for group mt-0"):
        _run(
            _cfg(group_size=2, filter=f"{path}:forgets_to_return"),
            ScriptedEngine([(ANSWER, "stop", None)]),
            tok,
        )
