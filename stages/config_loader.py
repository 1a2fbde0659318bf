"""The generic part of reading a run's YAML config, for the stages' own command lines: the file (default
configs/default.yaml) as a tree with `a.b=c` overrides applied, and one section of it converted to its
typed config with errors that name the dotted key.

At the bottom of stages/ (it imports no stage), so a stage's `python -m` reads the sections it runs on
without importing pipeline/ (which composes every section into RunConfig and checks across them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


class ConfigError(ValueError):
    pass


def load_tree(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[dict, str]:
    """The YAML file at `path` with `overrides` applied, and where it came from (for error messages)."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; see configs/ for the runnable ones")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of sections at the top level")
    for text in overrides or []:
        set_dotted(tree, *parse_override(text))
    # a bad value may come from the file or from an override: name both places to look
    return tree, f"{path} with overrides {' '.join(overrides)}" if overrides else str(path)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], yaml-parsed c)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. trainer.lr=1e-5)")
    key, _, raw = text.partition("=")
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key.strip()):
        raise ConfigError(f"override key {key!r} is not a dotted name (e.g. rollout.sampling.temperature)")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def set_dotted(tree: dict, path: list[str], value: Any) -> None:
    """Set tree[a][b]... = value for path [a, b, ...], making the sections on the way."""
    for k in path[:-1]:
        nxt = tree.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {k} is a value, not a section")
        tree = nxt
    tree[path[-1]] = value


def section(tree: dict, key: str, where: str) -> dict:
    """The mapping at top-level `key` ({} when absent)."""
    value = tree.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {key} must be a section (a mapping), not {value!r}")
    return value


def error_at(msg: str) -> tuple[str, str] | None:
    """msgspec says '<reason> - at `$.trainer.lr`': ('trainer.lr', '<reason>'), or None without a place."""
    m = re.search(r" - at `\$\.?(.*)`$", msg)
    return (m.group(1), msg[: m.start()]) if m else None


def convert(tree: dict, key: str, cls: type, where: str) -> Any:
    """Section `key` of the tree as `cls` (a msgspec Struct that forbids unknown fields)."""
    try:
        return msgspec.convert(section(tree, key, where), cls, strict=False)  # "1e-2" (YAML str) as float
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        at = error_at(str(e))
        raise ConfigError(f"{where}: {key}.{at[0]}: {at[1]}" if at else f"{where}: {key}: {e}") from None
