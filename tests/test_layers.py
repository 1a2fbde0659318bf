"""The layers: buffer/ at the bottom, stages/ in the middle, pipeline/ on top (docs/DESIGN.md, "Layout").

A module may import its own layer and the layers below it, never one above (buffer -> stages or
pipeline, stages -> pipeline), and no two modules of the repo may import each other round a circle.
Every import counts: module-level ones, those inside functions (and under `if TYPE_CHECKING`),
`importlib.import_module("...")` with a literal name, and "module:function" string literals that name
a repo module (hook specs such as `rollout.generate_fn` defaults). Implicit imports of parent packages
(`import a.b.c` runs `a/__init__.py`) are not counted as edges: that is how every package works.

The checker is `check_layers(root)`; the tests below also run it on small planted trees, so that a
checker that stopped seeing things would fail here too.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("buffer", "stages", "pipeline")  # bottom to top
_HOOK = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported repo module, dotted
    file: str  # path relative to the root
    line: int
    text: str  # the import as written
    kind: str = ""  # "" (module level), "in a function", "importlib", "hook string"

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.text}" + (f"  [{self.kind}]" if self.kind else "")


def repo_modules(root: Path, packages=LAYERS) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__)."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The repo module an imported dotted name lands in (its longest prefix that is one), or None."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def imports_of(module: str, path: Path, root: Path, mods: dict[str, Path]) -> list[Edge]:
    """Every edge from `module` (the file at `path`) to another repo module."""
    src = path.read_text()
    tree = ast.parse(src, filename=str(path))
    rel = str(path.relative_to(root))
    is_package = path.name == "__init__.py"
    edges, seen = [], set()
    in_function = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for inner in ast.walk(fn)
    }
    types_only = {  # under `if TYPE_CHECKING:`: counted, but said so
        id(inner)
        for cond in ast.walk(tree)
        if isinstance(cond, ast.If)
        and (getattr(cond.test, "id", None) or getattr(cond.test, "attr", None)) == "TYPE_CHECKING"
        for stmt in cond.body
        for inner in ast.walk(stmt)
    }

    def add(target: str, node: ast.AST, kind: str = "") -> None:
        dst = _resolve(target, mods)
        if dst is not None and dst != module and (dst, node.lineno) not in seen:
            seen.add((dst, node.lineno))
            text = ast.get_source_segment(src, node) or target
            if not kind:
                kind = (
                    "in a function"
                    if id(node) in in_function
                    else "TYPE_CHECKING"
                    if id(node) in types_only
                    else ""
                )
            edges.append(Edge(module, dst, rel, node.lineno, " ".join(text.split()), kind))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module) if node.level else node.module
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod when there is one, else names of pkg
                full = f"{base}.{alias.name}"
                add(full if full in mods else base, node)
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if (
                fname == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and not node.args[0].value.startswith(".")
            ):
                add(node.args[0].value, node, "importlib")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _HOOK.match(node.value)
            if m and m.group(1).split(".")[0] in LAYERS:
                add(m.group(1), node, "hook string")
    return edges


def import_graph(root: Path, packages=LAYERS) -> list[Edge]:
    mods = repo_modules(root, packages)
    return [e for mod, path in mods.items() for e in imports_of(mod, path, root, mods)]


def upward_imports(edges: list[Edge], layers=LAYERS) -> list[str]:
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    for e in edges:
        a, b = rank.get(e.src.split(".")[0]), rank.get(e.dst.split(".")[0])
        if a is not None and b is not None and b > a:
            out.append(f"{e.where()}  ({e.src.split('.')[0]} -> {e.dst.split('.')[0]}: up a layer)")
    return out


def import_cycles(edges: list[Edge]) -> list[str]:
    """One cycle per strongly connected component of more than one module, as a path of imports."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)  # the first import of dst in src names the edge
        graph.setdefault(e.dst, {})
    # Tarjan's algorithm, iterative (no recursion limit on a deep chain)
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    out = []
    for comp in comps:
        members = set(comp)
        first = comp[0]
        # the shortest way from `first` back to itself inside the component (breadth first)
        prev, frontier, found = {first: None}, [first], None
        while frontier and found is None:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node]):
                    if nxt == first:
                        found = node
                        break
                    if nxt in members and nxt not in prev:
                        prev[nxt] = node
                        nxt_frontier.append(nxt)
                if found is not None:
                    break
            frontier = nxt_frontier
        path = [found]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path.reverse()  # first ... found, and found imports first
        hops = [graph[a][b] for a, b in zip(path, [*path[1:], first])]
        more = f" (its component: {', '.join(comp)})" if len(comp) > len(path) else ""
        out.append(" -> ".join([*path, first]) + more + "\n      " + "\n      ".join(h.where() for h in hops))
    return out


def check_layers(root: Path, packages=LAYERS) -> list[str]:
    """Every upward import and every import circle under `root`, one message each (empty: clean)."""
    edges = import_graph(Path(root), packages)
    return [f"upward import: {m}" for m in upward_imports(edges, packages)] + [
        f"import circle: {m}" for m in import_cycles(edges)
    ]


# --- the real tree -----------------------------------------------------------------------------


@functools.cache
def _real_edges() -> tuple[Edge, ...]:
    return tuple(import_graph(ROOT))


def test_no_upward_imports():
    found = upward_imports(list(_real_edges()))
    assert not found, "imports that run up a layer (buffer < stages < pipeline):\n" + "\n".join(found)


def test_no_import_circles():
    found = import_cycles(list(_real_edges()))
    assert not found, "import circles between repo modules:\n" + "\n".join(found)


def test_the_checker_sees_the_tree():
    # a checker that found no files or no edges would pass everything
    mods = repo_modules(ROOT)
    assert {"buffer.record", "buffer.wire", "stages.models", "pipeline.inspect"} <= set(mods)
    edges = _real_edges()
    assert any(e.src.startswith("stages") and e.dst.startswith("buffer") for e in edges)
    assert any(e.src.startswith("pipeline") and e.dst.startswith("stages") for e in edges)


# --- the checker on planted trees ---------------------------------------------------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {
        "buffer/__init__.py": "",
        "stages/__init__.py": "",
        "pipeline/__init__.py": "",
        **files,
    }.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_checker_passes_a_clean_tree(tmp_path):
    root = _plant(
        tmp_path,
        {
            "buffer/record.py": "import json\n",
            "buffer/wire.py": "from buffer.record import X\nfrom . import record\n",
            "stages/rollout/__init__.py": "from .gen import run\n",
            "stages/rollout/gen.py": "from buffer import wire\nimport numpy\n",
            "pipeline/cli.py": "import stages.rollout.gen\ndef f():\n    import buffer.record\n",
        },
    )
    assert check_layers(root) == []


def test_checker_finds_an_upward_import(tmp_path):
    root = _plant(
        tmp_path,
        {
            "buffer/record.py": "x = 1\n",
            "buffer/wire.py": "import os\nfrom stages.models import M\n",
            "stages/models.py": "x = 1\n",
            "pipeline/config.py": "x = 1\n",
        },
    )
    found = check_layers(root)
    assert len(found) == 1 and "buffer/wire.py:2" in found[0] and "from stages.models import M" in found[0]


def test_checker_finds_hidden_upward_imports(tmp_path):
    # inside a function, relative, through importlib, and a "module:function" hook string
    root = _plant(
        tmp_path,
        {
            "stages/trainer/__init__.py": "",
            "stages/trainer/loop.py": "def run():\n    from pipeline import config\n",
            "stages/rollout/__init__.py": "",
            "stages/rollout/hooks.py": "import importlib\nm = importlib.import_module('pipeline.config')\n",
            "stages/rollout/defaults.py": "GEN = 'pipeline.config:make'\nTEXT = 'ratio: 1:2'\n",
            "buffer/server.py": "from ..pipeline import config\n",
            "pipeline/config.py": "def make(): pass\n",
        },
    )
    found = "\n".join(check_layers(root))
    assert "stages/trainer/loop.py:2: from pipeline import config  [in a function]" in found
    assert "stages/rollout/hooks.py:2: importlib.import_module('pipeline.config')  [importlib]" in found
    assert "stages/rollout/defaults.py:1: 'pipeline.config:make'  [hook string]" in found
    assert "buffer/server.py:1: from ..pipeline import config" in found
    assert found.count("upward import") == 4


def test_checker_finds_a_circle(tmp_path):
    root = _plant(
        tmp_path,
        {
            "buffer/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from buffer import b\n",
            "buffer/b.py": "import buffer.c\n",
            "buffer/c.py": "def f():\n    from .a import thing\n",  # closes the circle inside a function
            "stages/x.py": "import buffer.a\n",  # points into the circle, not part of it
        },
    )
    found = check_layers(root)
    assert len(found) == 1, found
    assert "buffer.a -> buffer.b -> buffer.c -> buffer.a" in found[0]
    assert "buffer/c.py:2: from .a import thing  [in a function]" in found[0]
    assert "buffer/a.py:3: from buffer import b  [TYPE_CHECKING]" in found[0]


def test_checker_finds_a_circle_across_layers(tmp_path):
    # stages.p imports buffer.q, which imports stages.p back: an upward import and a circle
    root = _plant(
        tmp_path,
        {"stages/p.py": "import buffer.q\n", "buffer/q.py": "import stages.p\n"},
    )
    found = check_layers(root)
    assert any(m.startswith("upward import: buffer/q.py:1") for m in found)
    assert any("import circle: buffer.q -> stages.p -> buffer.q" in m for m in found)
