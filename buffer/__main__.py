"""`python -m buffer serve|demo`: run the buffer alone, or drive a live one from the shell.

python -m buffer serve --dir /tmp/buf --bind tcp://127.0.0.1:5555     (Ctrl-C / SIGTERM stops it)
python -m buffer demo --address tcp://127.0.0.1:5555
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import msgspec


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m buffer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the buffer server in the foreground")
    s.add_argument("--dir", default="", help="durable segment directory (empty: memory only)")
    s.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address; port 0 picks a free port")
    s.add_argument("--capacity", type=int, default=None, help="capacity_samples (back-pressure above it)")
    s.add_argument("--policy", default=None, choices=["fifo", "staleness_fifo", "uniform"])
    s.add_argument("--max-times-sampled", type=int, default=None)
    s.add_argument("--memory", action="store_true", help="do not write segments even if --dir is given")
    s.add_argument(
        "--reserve-mb", type=int, default=None, help="heap to fault in at start (buffer/memory.py; 0: none)"
    )
    d = sub.add_parser("demo", help="produce synthetic samples into a live buffer and fetch them back")
    d.add_argument("--address", required=True)
    d.add_argument("--groups", type=int, default=8, help="groups produced per round")
    d.add_argument("--group-size", type=int, default=4)
    d.add_argument("--tokens", type=int, default=256, help="response tokens per sample")
    d.add_argument("--fetch-groups", type=int, default=4)
    d.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    from buffer.config import BufferConfig
    from buffer.memory import reserve
    from buffer.server import BufferServer

    kw = {"bind": args.bind, "dir": args.dir, "durable": bool(args.dir) and not args.memory}
    if args.capacity is not None:
        kw["capacity_samples"] = args.capacity
    if args.policy is not None:
        kw["policy"] = args.policy
    if args.max_times_sampled is not None:
        kw["max_times_sampled"] = args.max_times_sampled
    if args.reserve_mb is not None:
        kw["reserve_mb"] = args.reserve_mb
    cfg = msgspec.convert(kw, BufferConfig)
    mem = reserve(cfg.reserve_mb)  # before the server's socket (and ZeroMQ's I/O thread) exists
    srv = BufferServer(cfg, args.dir or None)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: srv.request_stop())
    srv.start()
    s = srv.stats()
    print(f"buffer listening on {srv.address}", flush=True)
    print(
        f"dir={args.dir or '(memory only)'} policy={s['policy']} capacity={s['capacity_samples']} "
        f"rows={s['rows']} version={s['version']} recovery={s['recovery'] or '-'} "
        f"reserved={mem.get('reserved_mb', 0)}MB",
        flush=True,
    )
    # The main thread only waits, so that signals are handled promptly.
    while not srv.join(0.2):
        pass
    print("buffer stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.cmd == "serve":
        from buffer.memory import MARKER, buffer_env, is_glibc

        if argv is None and not os.environ.get(MARKER) and sys.platform == "linux" and is_glibc():
            # glibc reads its malloc settings at process start only: start again with them (same pid,
            # same interpreter flags and arguments)
            try:
                os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], buffer_env())
            except OSError as e:  # serve anyway: reserve() still applies what it can at run time
                print(
                    f"buffer: could not re-execute with the malloc settings ({e}); serving without",
                    flush=True,
                )
        try:
            return serve(args)
        except (ValueError, OSError, RuntimeError, TimeoutError, msgspec.ValidationError) as e:
            # a bad argument or an unusable --dir/--bind: one line, no traceback
            print(f"python -m buffer serve: error: {e}", file=sys.stderr, flush=True)
            return 2
    from buffer.demo import run_demo

    run_demo(
        args.address,
        groups=args.groups,
        group_size=args.group_size,
        tokens=args.tokens,
        fetch_groups=args.fetch_groups,
        rounds=args.rounds,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
