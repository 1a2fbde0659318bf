"""Custom rollout hooks: a generate_fn's returns are checked, filters and rollout_fns load from a file
outside the repository by "path.py:function", a rollout_fn runs under admission control, and bad specs
fail naming the key."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
from test_multiturn import EOS, ScriptedEngine, _cfg, _run
from test_rollout_generator import FakeSink

from pipeline.config import ConfigError, from_dict
from pipeline.sample import Status
from stages.rollout.generator import Generator
from stages.rollout.hooks import HookError, load_hook

ANSWER = [ord("7"), EOS]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pipeline.models import build_byte_tokenizer

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
    from pipeline.sample import Sample

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

async def my_rollout(ctx):
    """Two groups at a time, each member answered by one engine call; yields them as they finish."""
    async def one(group):
        results = await ctx.engine.generate(group.prompt.ids, ctx.params, n=len(group.samples))
        for s, r in zip(group.samples, results):
            fill_response(s, response_ids=r.response_ids, rollout_logprobs=r.logprobs, versions=r.versions)
            s.metadata["by"] = ctx.kwargs["tag"]
        return group.samples

    pending = set()
    while True:
        group = await ctx.start_group()
        if group is None:
            break
        pending.add(asyncio.ensure_future(one(group)))
        if len(pending) >= 2:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for d in done:
                yield d.result()
    for d in asyncio.as_completed(pending):
        yield await d

async def bad_rollout(ctx):
    group = await ctx.start_group()
    yield group.samples  # not filled in: an empty response is fine, but ...
    yield ["not a sample"]
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
        cfg,
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
        Generator(cfg, FakeSink(), ScriptedEngine([]), "g", 0, source=iter(()), tokenizer=object())


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
    assert set(files) == {"my_env.py", "my_loop.py", "my_filter.py"}
    engine = ScriptedEngine([(ANSWER, "stop", None)])
    cfg = _cfg(group_size=2, generate_fn=f"{files['my_env.py']}:generate", generate_kwargs={"hint": "Check."})
    sink, _ = _run(cfg, engine, tok)
    for s in next(iter(sink.groups.values())):
        mask = s.array("loss_mask").tolist()
        assert mask[:2] == [1, 1] and mask[-2:] == [1, 1] and 0 in mask and s.metadata["model_turns"] == 2
    sink, stats = _run(_cfg(group_size=2, rollout_fn=f"{files['my_loop.py']}:rollout"), engine, tok, groups=3)
    assert stats["groups_finished"] == 3
    sink, stats = _run(
        _cfg(group_size=2, filter=f"{files['my_filter.py']}:some_correct"), engine, tok, groups=2
    )
    assert stats["groups_filtered"] + stats["groups_finished"] == 2
