"""`python -m stages.trainer --config configs/X.yaml [a.b=c ...] (--buffer tcp://... | --replay DIR)`

Runs the megatron trainer alone: against a live buffer, or on a recorded buffer directory with no
generator at all. Single process by default; under `torchrun --nproc-per-node N` with trainer.tp /
trainer.pp set, every rank runs this same command and rank 0 talks to the buffer.
Arguments are parsed before torch and megatron are imported, so --help and config errors are instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m stages.trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="run config YAML (default: configs/default.yaml)")
    ap.add_argument("overrides", nargs="*", help="config overrides a.b=c (e.g. trainer.lr=1e-5)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--buffer", help="address of a running buffer, e.g. tcp://127.0.0.1:5555")
    src.add_argument("--replay", help="recorded buffer directory (Arrow IPC *.arrow segments)")
    ap.add_argument("--run-dir", default="", help="run directory (checkpoints, metrics); default from run.*")
    ap.add_argument("--model-path", default="", help="HF folder; default: resolve model.name")
    ap.add_argument(
        "--weights-bind", default="", help="push weights over the CPU transport from this address"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from stages.config_loader import ConfigError
    from stages.trainer.config_file import load, write_resolved

    try:  # the stage's own sections (stages/ imports nothing of pipeline/)
        cfg = load(args.config, args.overrides, run_dir=args.run_dir)
    except ConfigError as e:
        print(f"stages.trainer: config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run_dir = cfg.run.run_dir
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        write_resolved(cfg)

    from stages.trainer.cuda_memory import choose_allocator
    from stages.trainer.loop import run
    from stages.trainer.trainer import Trainer

    choose_allocator(cfg.trainer, cfg.weights)  # before anything allocates CUDA memory in this process

    model_path = args.model_path
    if not model_path:
        from stages.models import resolve_model

        model_path = str(resolve_model(cfg.model))
    source = None
    if rank == 0:
        if args.replay:
            from stages.trainer.replay import ReplaySource

            source = ReplaySource(args.replay)
        else:
            from buffer.client import BufferClient

            source = BufferClient(args.buffer, producer="trainer")
    trainer = Trainer(cfg.trainer, cfg.run, source, model_path, weights=cfg.weights)
    if args.weights_bind and rank == 0:
        from stages.weights.zmq_transport import ZmqWeightSender

        w = cfg.weights
        trainer.attach_sender(
            ZmqWeightSender(args.weights_bind, bucket_mb=w.bucket_mb_for("cpu"), timeout_s=w.timeout_s)
        )
    last = run(trainer, cfg.run.steps)
    if cfg.trainer.save_at_end:
        trainer.save_hf(os.path.join(run_dir, "hf", "final"))  # collective; rank 0 writes
    if rank == 0:
        print(
            f"trainer finished at version {trainer.version}; run dir {run_dir}; last loss {last.get('loss')}"
        )
    from stages.trainer.world import leave_world_at_exit

    leave_world_at_exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
