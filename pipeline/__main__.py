"""bin/run-pipeline: run the whole pipeline from one config.

    bin/run-pipeline [--config configs/X.yaml] [a.b=c ...]

Parses and validates the config before importing torch, Ray or megatron, so a typo fails in a second.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
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
