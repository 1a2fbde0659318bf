"""Run rollout generators alone: `python -m stages.rollout --config configs/X.yaml [a.b=c ...]
(--buffer tcp://HOST:PORT [--weights tcp://HOST:PORT] | --dry-run OUT.arrow) [--max-groups N]`.

Against a live buffer the generators stream groups to it, with admission control from their engines'
versions; `--weights` connects each engine to a trainer's weight transport (`python -m stages.trainer
... --weights-bind ADDR`), without it the engines keep their initial weights. With --dry-run they write
the samples to a local Arrow IPC file instead (no buffer, no admission control).
Arguments are parsed before torch is imported, so --help and config errors are instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.rollout.config_file import RolloutStageConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stages.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="YAML run config (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.group_size=4")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--buffer", help="address of a running buffer, e.g. tcp://127.0.0.1:5555")
    where.add_argument("--dry-run", metavar="OUT", help="write samples to this Arrow IPC file instead")
    p.add_argument("--weights", default=None, help="a trainer's weight transport to take new weights from")
    p.add_argument("--max-groups", type=int, default=None, help="stop after this many groups per generator")
    p.add_argument("--id-prefix", default="gen", help="generator ids are <prefix>-<i>")
    p.add_argument("--state", default=None, help="JSON file to resume the data position from / save it to")
    return p.parse_args(argv)


class ArrowFileSink:
    """A SampleSink that appends each put to an Arrow IPC file (for --dry-run and offline debugging)."""

    def __init__(self, path: str):
        import pyarrow as pa

        from buffer.record import ARROW_SCHEMA

        self._pa = pa
        self._writer = pa.ipc.new_file(path, ARROW_SCHEMA)
        self.rows = 0

    def put(self, samples, timeout_s: float = 60.0):
        from buffer.record import samples_to_batch
        from buffer.wire import IngestAck

        self._writer.write_batch(samples_to_batch(samples))
        self.rows += len(samples)
        return IngestAck(seq=0, accepted=len(samples), duplicates=0, rejected=0, trainer_version=0)

    def close(self) -> None:
        self._writer.close()


async def run_generators(cfg: RolloutStageConfig, args: argparse.Namespace) -> list[dict]:
    """Build one engine + generator per rollout.num_generators and run them until done or Ctrl-C."""
    import asyncio
    import signal
    from pathlib import Path

    from stages.rollout.build import build_engine
    from stages.rollout.generator import Generator

    n = cfg.rollout.num_generators
    bg = cfg.batch_groups  # generator i's share of a batch; the shares add up to batch_groups
    shares = [0 if args.dry_run else bg // n + (i < bg % n) for i in range(n)]
    gens, sinks, receivers = [], [], []
    for i in range(n):
        if args.dry_run:
            path = args.dry_run if n == 1 else f"{args.dry_run}.{i}"
            sink = ArrowFileSink(path)
        else:
            from buffer.client import BufferClient

            sink = BufferClient(args.buffer, producer=f"{args.id_prefix}-{i}")
        engine = build_engine(cfg.rollout, cfg.model, cfg.run, seed=cfg.run.seed * 1000 + i)
        if args.weights:
            from stages.weights.zmq_transport import WeightReceiver

            receivers.append(WeightReceiver(args.weights, engine, name=f"{args.id_prefix}-{i}"))
        gen = Generator(cfg.rollout, cfg.model, cfg.run, sink, engine, f"{args.id_prefix}-{i}", shares[i])
        state = Path(f"{args.state}.{i}" if args.state and n > 1 else args.state or "")
        if args.state and state.exists():
            gen.load_state_dict(json.loads(state.read_text()))
        gens.append((gen, state))
        sinks.append(sink)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [g.stop() for g, _ in gens])
    try:
        return await asyncio.gather(*(g.run(max_groups=args.max_groups) for g, _ in gens))
    finally:
        for r in receivers:
            r.close()
        for (gen, state), sink in zip(gens, sinks):
            if args.state:
                state.write_text(json.dumps(gen.state_dict()))
            gen.engine.close()
            sink.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from stages.rollout import config_file

    try:
        cfg = config_file.load(args.config, args.overrides)
    except config_file.ConfigError as e:  # a bad config prints the reason and exits with status 2
        print(f"stages.rollout: config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import asyncio

    stats = asyncio.run(run_generators(cfg, args))
    for s in stats:
        print(json.dumps(s, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
