"""Prompt sources: JSONL / Parquet files in slime's schema and procedural tasks, served in seeded,
shuffled epochs from a position that survives a restart.

File rows follow slime's schema (and its `path@[start:stop]` row slices): `prompt` (text, or a list of chat messages {role, content}), `label`
(ground truth for the verifier) and `metadata` (a JSON object); the key names are configurable.
A malformed line fails loading with the file and line number (or, with on_bad_line="skip", is skipped
and counted). Prompts longer than max_prompt_tokens are skipped or truncated (keeping the end, which
holds the question and the generation prompt) and counted.

The position is (epoch, index into that epoch's permutation). The permutation is a pure function of
(seed, epoch), so `state_dict()` -> JSON -> `load_state_dict()` resumes exactly where it stopped.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.data_files import ROW_FORMATS, file_rows
from stages.rollout.config import DataConfig
from stages.rollout.tasks import Example, Task, is_task, make_task


class DataError(ValueError):
    """Unusable input data; the message names the file and line (or row)."""


@dataclass(kw_only=True)
class Prompt:
    text: str  # the prompt as the model sees it (after the chat template)
    ids: list[int]
    label: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # row / example index in the dataset
    epoch: int = 0
    # the chat messages `text` renders (data.system_prompt included; [] without the chat template): what
    # an agent (rollout.agent_fn) sends to reproduce exactly this prompt
    messages: list[dict[str, str]] = field(default_factory=list)


def _row_to_example(row: Any, cfg: DataConfig, where: str) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if cfg.prompt_key not in row:
        raise DataError(f"{where}: no {cfg.prompt_key!r} key (data.prompt_key); keys: {sorted(row)[:10]}")
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise DataError(f"{where}: {cfg.prompt_key!r} is a list but not of {{role, content}} messages")
        if any("step_loss_mask" in m for m in prompt):  # was dropped without a word
            raise DataError(
                f"{where}: a message has step_loss_mask, which marks trained turns of multi-turn (SFT) data; "
                "an RL prompt is never trained on, only the generated response is: remove the key"
            )
        prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    elif not isinstance(prompt, str):
        raise DataError(
            f"{where}: {cfg.prompt_key!r} must be text or chat messages, got {type(prompt).__name__}"
        )
    label = row.get(cfg.label_key, "")
    meta = row.get(cfg.metadata_key) or {}
    if isinstance(meta, str):  # Parquet files often carry metadata as a JSON string
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError:
            raise DataError(f"{where}: {cfg.metadata_key!r} is a string that is not JSON") from None
    if not isinstance(meta, dict):
        raise DataError(f"{where}: {cfg.metadata_key!r} must be an object, got {type(meta).__name__}")
    return Example(prompt=prompt, label=label if isinstance(label, str) else json.dumps(label), metadata=meta)


def read_examples(path: Path, cfg: DataConfig, counters: dict[str, int]) -> list[Example]:
    """All rows of a .jsonl / .parquet file as Examples (bad rows raise or are counted per config)."""
    if not path.exists():
        raise DataError(f"data file {path} does not exist (data.source)")
    out: list[Example] = []

    def bad(err: DataError) -> None:
        if cfg.on_bad_line == "error":
            raise err
        counters["bad_lines"] += 1

    if path.suffix not in ROW_FORMATS:
        raise DataError(f"data file {path}: unsupported format {path.suffix!r}; use .jsonl or .parquet")
    for where, row, err in file_rows(path):
        if err is not None:
            bad(DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})"))
            continue
        try:
            out.append(_row_to_example(row, cfg, where))
        except DataError as e:
            bad(e)
    if not out:
        raise DataError(f"data file {path} has no usable rows")
    return out


_ROWS = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def read_source(source: str, cfg: DataConfig, counters: dict[str, int]) -> list[Example]:
    """The rows of a data file, or of a slice of it: "data.jsonl@[0:1000]" (slime's form; Python slice
    bounds over the file's usable rows, either may be left out or negative)."""
    m = _ROWS.match(source)
    if m is None:
        if "@[" in source:
            raise DataError(
                f"data.source {source!r}: a row slice is written path@[start:stop], e.g. data.jsonl@[0:1000]"
            )
        return read_examples(Path(source).expanduser(), cfg, counters)
    rows = read_examples(Path(m["path"]).expanduser(), cfg, counters)
    start, stop = (int(x) if x else None for x in (m["start"], m["stop"]))
    out = rows[start:stop]
    if not out:
        raise DataError(f"data.source {source!r}: the slice holds none of the file's {len(rows)} usable rows")
    return out


class PromptSource:
    """Serves tokenized `Prompt`s forever (epoch after epoch). Not thread-safe: one consumer."""

    def __init__(self, cfg: DataConfig, tokenizer: Any):
        """cfg: stages.rollout.config.DataConfig; tokenizer: an HF tokenizer."""
        self.cfg = cfg
        self.tok = tokenizer
        self.counters = {"bad_lines": 0, "overlong_skipped": 0, "overlong_truncated": 0, "served": 0}
        self.task: Task | None = None
        self.examples: list[Example] = []
        if is_task(cfg.source):
            self.task = make_task(cfg.source, seed=cfg.seed, size=cfg.num_examples, kwargs=cfg.task_kwargs)
            self.size = cfg.num_examples
        else:
            self.examples = read_source(cfg.source, cfg, self.counters)
            self.size = len(self.examples)
        self.default_reward = self.task.default_reward if self.task else "exact_match"
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    # -- position ---------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.cfg.shuffle:
            random.Random(f"{self.cfg.seed}:{epoch}").shuffle(order)
        return order

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.cfg.source, "seed": self.cfg.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") != self.cfg.source or state.get("seed") != self.cfg.seed:
            raise DataError(
                f"saved data position is for source={state.get('source')!r} seed={state.get('seed')}, "
                f"not {self.cfg.source!r} seed={self.cfg.seed}; delete the state file to start over"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)

    def save(self, path: str | Path) -> None:
        """Write the position as JSON (atomically: temp file + rename)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        tmp.replace(path)

    def load(self, path: str | Path) -> None:
        self.load_state_dict(json.loads(Path(path).read_text()))

    # -- serving ----------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        for _ in range(self.size + 1):  # at most one full epoch of skipped prompts
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            i = self._order[self.index]
            self.index += 1
            prompt = self._render(i)
            if prompt is not None:
                self.counters["served"] += 1
                return prompt
        raise DataError(
            f"every prompt of {self.cfg.source} is longer than data.max_prompt_tokens="
            f"{self.cfg.max_prompt_tokens}; raise it or set data.overlong=truncate"
        )

    def example(self, i: int) -> Example:
        return self.task.example(i) if self.task else self.examples[i]

    def _render(self, i: int) -> Prompt | None:
        ex = self.example(i)
        messages = self.chat_messages(ex.prompt) if self.cfg.apply_chat_template else []
        text = self.render_text(ex.prompt)
        ids = list(self.tok(text, add_special_tokens=not self.cfg.apply_chat_template).input_ids)
        limit = self.cfg.max_prompt_tokens
        if len(ids) > limit:
            if self.cfg.overlong == "skip":
                self.counters["overlong_skipped"] += 1
                return None
            self.counters["overlong_truncated"] += 1
            ids = ids[-limit:]
            text = self.tok.decode(ids)
        return Prompt(
            text=text,
            ids=ids,
            label=ex.label,
            metadata=dict(ex.metadata),
            index=i,
            epoch=self.epoch,
            messages=messages,
        )

    def chat_messages(self, prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """A prompt as the chat messages the template renders (data.system_prompt inserted)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.cfg.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return messages

    def render_text(self, prompt: str | list[dict[str, str]]) -> str:
        """Prompt text as the model sees it: chat-templated (with generation prompt) or plain."""
        if not self.cfg.apply_chat_template:
            return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        messages = self.chat_messages(prompt)
        if not getattr(self.tok, "chat_template", None):
            raise DataError(
                "data.apply_chat_template is on but the model's tokenizer has no chat template; "
                "set rollout.data.apply_chat_template=false or use a model folder with one"
            )
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
