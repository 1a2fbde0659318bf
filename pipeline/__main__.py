"""bin/run-pipeline: run the whole pipeline from one config.

    bin/run-pipeline [--config configs/X.yaml] [a.b=c ...]
    bin/run-pipeline scale RUN_DIR --generators N [--wait S]   (a run going in RUN_DIR: docs/elastic.md)

Parses and validates the config before importing torch, Ray or megatron, so a typo fails in a second.
"""

from __future__ import annotations

import argparse
import sys


def scale(argv: list[str]) -> int:
    """Ask the run going in RUN_DIR for N generators: a request file its driver reads between steps."""
    ap = argparse.ArgumentParser(
        prog="run-pipeline scale",
        description="Add or remove generators of a run while it goes: writes RUN_DIR/scale.request.json, "
        "which the run's driver reads between trainer steps and answers in RUN_DIR/scale.status.json.",
    )
    ap.add_argument("run_dir", help="the run's directory (run-pipeline prints it at start)")
    ap.add_argument("--generators", type=int, required=True, help="how many generators the run is to have")
    ap.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds to wait for the answer (0: do not wait)",
    )
    args = ap.parse_args(argv)
    from pathlib import Path

    from pipeline.orchestration.elastic import wait_status, write_request

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        print(
            f"run-pipeline scale: {run_dir} is not a run directory (no config.yaml); pass the one "
            "run-pipeline printed at start",
            file=sys.stderr,
        )
        return 2
    if args.generators < 1:
        print(f"run-pipeline scale: --generators {args.generators}: a run needs at least 1", file=sys.stderr)
        return 2
    req = write_request(run_dir, args.generators)
    if args.wait <= 0:
        print(
            f"run-pipeline scale: request {req.id} written; the answer will be in {run_dir / 'scale.status.json'}"
        )
        return 0
    status = wait_status(run_dir, req.id, args.wait)
    if status is None:
        print(
            f"run-pipeline scale: no answer to request {req.id} within {args.wait:.0f}s: is a run going in "
            f"{run_dir}? Its driver reads the request between trainer steps; it stays pending there",
            file=sys.stderr,
        )
        return 3
    print(f"run-pipeline scale: {status.outcome}: {status.message}")
    return 0 if status.outcome in ("applied", "unchanged") else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:  # no override is a bare word: a.b=c has its "="
        return scale(argv[1:])
    ap = argparse.ArgumentParser(
        prog="run-pipeline",
        description="Run buffer + generators + trainer. With no arguments: configs/default.yaml, the embedded "
        "CPU default (tiny Qwen2 learning digit-repeat).",
    )
    ap.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("overrides", nargs="*", metavar="a.b=c", help="config overrides (YAML values)")
    args = ap.parse_args(argv)

    from pipeline.config import load_config_or_exit, to_dict

    cfg = load_config_or_exit(args.config, args.overrides, "run-pipeline")
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0

    from pipeline.orchestration.launcher import make_run_dir, print_summary, run_pipeline

    run_dir = make_run_dir(cfg)
    print(
        f"run-pipeline: {args.config or 'configs/default.yaml'} mode={cfg.run.mode} steps={cfg.run.steps} "
        f"model={cfg.model.name} -> {run_dir}",
        flush=True,
    )
    res = run_pipeline(cfg, run_dir)
    print_summary(res)
    return {"completed": 0, "interrupted": 130}.get(res.status, 1)


if __name__ == "__main__":
    sys.exit(main())
