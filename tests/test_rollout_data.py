"""Prompt sources: slime-schema JSONL/Parquet, bad lines, overlong prompts, epochs, restart position,
procedural tasks (digit-repeat, reasoning-gym)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.models import load_tokenizer, resolve_model
from stages.rollout.config import DataConfig
from stages.rollout.data import DataError, PromptSource


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "models")
    return load_tokenizer(resolve_model(SimpleNamespace(name="tiny-qwen2", cache_dir=cache)))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": "12", "label": "12", "metadata": {"k": 1}},
    {"prompt": [{"role": "user", "content": "345"}], "label": "345"},
    {"prompt": "6", "label": "6"},
]


def test_jsonl_text_and_messages_with_chat_template(tmp_path, tok):
    src = PromptSource(DataConfig(source=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), shuffle=False), tok)
    got = [next(src) for _ in range(3)]
    assert [p.text for p in got] == [f"<|im_start|>{d}<|im_end|><|im_start|>" for d in ("12", "345", "6")]
    assert got[0].ids == [257, 49, 50, 258, 257] and got[0].metadata == {"k": 1} and got[1].label == "345"
    plain = PromptSource(
        DataConfig(source=str(tmp_path / "d.jsonl"), shuffle=False, apply_chat_template=False), tok
    )
    assert next(plain).text == "12"


def test_parquet_with_custom_keys(tmp_path, tok):
    table = pa.table({"q": ["7", "89"], "a": ["7", "89"], "meta": ['{"x": 2}', ""]})
    pq.write_table(table, tmp_path / "d.parquet")
    cfg = DataConfig(source=str(tmp_path / "d.parquet"), prompt_key="q", label_key="a", metadata_key="meta")
    src = PromptSource(msgspec_replace(cfg, shuffle=False), tok)
    a, b = next(src), next(src)
    assert (a.label, a.metadata, b.label, b.metadata) == ("7", {"x": 2}, "89", {})


def test_malformed_line_names_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "{not json", {"label": "x"}, ROWS[2]])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        PromptSource(DataConfig(source=str(path)), tok)
    skip = PromptSource(DataConfig(source=str(path), on_bad_line="skip"), tok)
    assert skip.counters["bad_lines"] == 2 and skip.size == 2
    path2 = write_jsonl(tmp_path / "bad2.jsonl", [ROWS[0], {"label": "x"}])
    with pytest.raises(DataError, match=rf"{path2}:2: no 'prompt' key"):
        PromptSource(DataConfig(source=str(path2)), tok)


def test_overlong_prompts_skip_or_truncate(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1" * 50, "label": ""}, ROWS[2]])
    skip = PromptSource(DataConfig(source=str(path), shuffle=False, max_prompt_tokens=10), tok)
    assert [next(skip).label for _ in range(3)] == ["6", "6", "6"]
    assert skip.counters["overlong_skipped"] == 3
    trunc = PromptSource(
        DataConfig(source=str(path), shuffle=False, max_prompt_tokens=10, overlong="truncate"), tok
    )
    p = next(trunc)
    assert len(p.ids) == 10 and p.ids[-1] == 257 and trunc.counters["overlong_truncated"] == 1


def test_epochs_shuffle_and_restart_position(tmp_path, tok):
    cfg = DataConfig(source="digit_repeat", num_examples=5, seed=3)
    a = PromptSource(cfg, tok)
    first = [next(a) for _ in range(7)]
    assert sorted(p.index for p in first[:5]) == list(range(5)) and first[5].epoch == 1
    assert [p.index for p in first[:5]] != list(range(5)) or [p.index for p in first[5:]] != [0, 1]
    a.save(tmp_path / "pos.json")
    rest = [next(a).index for _ in range(6)]
    b = PromptSource(cfg, tok)
    b.load(tmp_path / "pos.json")
    assert json.loads((tmp_path / "pos.json").read_text())["epoch"] == 1
    assert [next(b).index for _ in range(6)] == rest
    with pytest.raises(DataError, match="seed"):
        PromptSource(msgspec_replace(cfg, seed=4), tok).load(tmp_path / "pos.json")


def test_digit_repeat_prompts(tok):
    src = PromptSource(DataConfig(source="digit_repeat", task_kwargs={"min_digits": 2, "max_digits": 4}), tok)
    for _ in range(20):
        p = next(src)
        assert p.label.isdigit() and 2 <= len(p.label) <= 4
        assert p.text == f"<|im_start|>{p.label}<|im_end|><|im_start|>"
    assert src.default_reward == "digit_repeat"


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_reasoning_gym_tasks(tok, name):
    src = PromptSource(
        DataConfig(source=f"reasoning_gym:{name}", num_examples=4, max_prompt_tokens=4096), tok
    )
    p = next(src)
    assert p.label and p.metadata["rg_dataset"] == name and "<answer>" in p.text
    json.dumps(p.metadata)  # must travel inside a Sample


def msgspec_replace(cfg, **kw):
    import msgspec

    return msgspec.structs.replace(cfg, **kw)


def test_a_row_slice_of_a_file_as_slime_writes_it(tmp_path, tok):
    rows = [{"prompt": str(i), "label": str(i)} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    src = PromptSource(DataConfig(source=f"{path}@[2:5]", shuffle=False), tok)
    assert src.size == 3 and [next(src).label for _ in range(4)] == ["2", "3", "4", "2"]
    assert PromptSource(DataConfig(source=f"{path}@[-2:]", shuffle=False), tok).size == 2
    with pytest.raises(DataError, match=r"path@\[start:stop\]"):
        PromptSource(DataConfig(source=f"{path}@[2-5]"), tok)
    with pytest.raises(DataError, match="holds none of the file's 10 usable rows"):
        PromptSource(DataConfig(source=f"{path}@[20:30]"), tok)


def test_step_loss_mask_in_prompt_messages_is_refused_by_name(tmp_path, tok):
    row = {"prompt": [{"role": "user", "content": "1", "step_loss_mask": 1}], "label": "1"}
    with pytest.raises(DataError, match=r"d.jsonl:1: .*step_loss_mask"):
        PromptSource(DataConfig(source=str(write_jsonl(tmp_path / "d.jsonl", [row]))), tok)
