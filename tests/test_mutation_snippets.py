"""bench/mutations.py's mutants still apply: each one's snippet occurs exactly once in its file. A snippet
that moved with a refactor would otherwise stop the mutation check at that mutant, after minutes."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutants_snippet_occurs_once_in_its_file():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import mutations
    finally:
        sys.path.remove(str(ROOT / "bench"))
    counts = {m.name: (ROOT / m.path).read_text().count(m.old) for m in mutations.MUTATIONS}
    assert {name: n for name, n in counts.items() if n != 1} == {}
    assert len(counts) == len(mutations.MUTATIONS)  # names are unique
