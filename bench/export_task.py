"""Write a procedural task (digit_repeat, reasoning_gym:<dataset>) as a JSONL prompt file in slime's
schema ({"prompt": [chat messages], "label": ..., "metadata": {...}}), for machines that lack the task's
package (e.g. a GPU box without reasoning-gym): train there with rollout.data.source=<file> and a reward
that needs no package (math, exact_match).

    .venv/bin/python bench/export_task.py reasoning_gym:basic_arithmetic 4000 bench/data/basic_arithmetic.jsonl \
        --kwargs '{"min_terms": 2, "max_terms": 3, "max_digits": 2}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.rollout.tasks import make_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("n", type=int)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kwargs", default="{}", help="task options as JSON, e.g. '{\"max_terms\": 3}'")
    args = ap.parse_args()
    task = make_task(args.task, seed=args.seed, size=args.n, kwargs=json.loads(args.kwargs))
    with open(args.out, "w") as f:
        for i in range(args.n):
            ex = task.example(i)
            f.write(json.dumps({"prompt": ex.prompt, "label": ex.label, "metadata": ex.metadata}) + "\n")
    print(json.dumps({"task": args.task, "rows": args.n, "out": args.out}))


if __name__ == "__main__":
    main()
