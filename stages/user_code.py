"""User code named in a config as "package.module:function" (importable on the stage's sys.path) or
"path/to/file.py:function" (loaded from the file; a relative path is taken from the directory the run
was launched in): the rollout hooks (stages/rollout/hooks.py) and the trainer's (stages/trainer/hooks.py)
load it the same way, and every error names the config key."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class HookError(ValueError):
    """A hook could not be loaded, or returned something the pipeline cannot use."""


def is_hook_spec(spec: str) -> bool:
    """ "package.module:function" or "path/to/file.py:function" (the form only; load_hook loads it)."""
    where, _, attr = spec.rpartition(":")
    return bool(where) and attr.isidentifier()


def load_hook(spec: str, key: str) -> Callable[..., Any]:
    """The callable named by spec; `key` (e.g. "rollout.generate_fn") is named in every error."""
    if not is_hook_spec(spec):
        raise HookError(f"{key}={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise HookError(f"{key}={spec!r}: no file {path}")
        name = f"slipstream_hook_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module  # before exec: dataclasses and pickling look the module up
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise HookError(f"{key}={spec!r}: loading {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise HookError(
                f"{key}={spec!r}: cannot import {where!r} ({e}); put its folder on PYTHONPATH "
                "or give the file's path (path/to/file.py:function)"
            ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise HookError(f"{key}={spec!r}: {where} has no callable {attr!r}")
    return fn


def hook_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
