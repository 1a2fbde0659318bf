"""Exactly-once delivery across buffer kills (issue #36): `python -m buffer serve` is SIGKILLed --kills
times while a producer ingests and a trainer-like client fetches, and restarted each time on the same
address and directory.

Half the kills are the server's test hook (SLIPSTREAM_BUFFER_TEST_HOOK_KILL_AFTER_SERVED: it SIGKILLs
itself after the k-th fetch it serves, k random in 1..4, between the fsync of "served" and the send:
the window that lost 64 of 4,800 samples before), half are plain SIGKILLs from outside at a random time.
The producer keeps resending unacked messages, the trainer resends its unanswered fetch with the same
request id, as buffer.client does.

At the end the trainer drains the buffer. Every sample the producer got an ack for must have reached the
trainer exactly once, and every "served" record of the consumption log must be a reply the trainer got.
Prints one JSON line last: exactly_once, kills, acked, received, lost, duplicated, ...; with --results,
appends it (with "device" and "date") to bench/results/buffer_exactly_once.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _results import RESULTS, record  # noqa: E402

from buffer.client import BufferClient  # noqa: E402
from buffer.demo import synthetic_samples  # noqa: E402
from buffer.fetch_room import TEST_HOOK_KILL_AFTER_SERVED  # noqa: E402
from buffer.segments import iter_log  # noqa: E402


def start_server(directory: Path, bind: str, kill_after: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(TEST_HOOK_KILL_AFTER_SERVED, None)
    if kill_after:
        env[TEST_HOOK_KILL_AFTER_SERVED] = str(kill_after)
    cmd = [sys.executable, "-m", "buffer", "serve", "--dir", str(directory), "--bind", bind]
    proc = subprocess.Popen(
        [*cmd, "--policy", "fifo", "--capacity", "1000000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if not line.startswith("buffer listening on "):
        proc.kill()
        raise SystemExit(f"buffer server did not start: {line}{proc.stdout.read()}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    return proc, line.split()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4800, help="produce at least this many samples")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--fetch-groups", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--results", default="", help=f"append the JSON line here (e.g. {RESULTS}/buffer_exactly_once.jsonl)"
    )
    a = ap.parse_args()
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="slipstream-exactly-once-")) / "buf"
    hook = lambda k: rng.randint(1, 4) if k < a.kills and k % 2 == 0 else 0  # noqa: E731
    proc, addr = start_server(directory, "tcp://127.0.0.1:0", hook(0))
    producer = BufferClient(addr, producer="gen0", timeout_s=120, resend_s=0.3, window=4)
    trainer = BufferClient(addr, producer="trainer", timeout_s=120, resend_s=0.3)
    acked: set[str] = set()
    received: collections.Counter[str] = collections.Counter()
    replies: set[int] = set()  # request ids of the fetch replies with rows the trainer got
    stop_producing, stop_fetching = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            i = 0
            while not (stop_producing.is_set() and len(acked) >= a.samples):
                batch = synthetic_samples(4, a.group_size, response_len=64, prefix=f"b{i}", seed=i)
                producer.put(batch)  # returns once acked (durable); resent across restarts
                acked.update(s.uid for s in batch)
                i += 1
                time.sleep(0.01)
        except BaseException as e:  # reported below
            errors.append(e)

    def fetch() -> None:
        try:
            while not stop_fetching.is_set():
                b = trainer.fetch(a.fetch_groups, 0, 0, timeout_s=0.5, grace_s=60)
                if b is not None:
                    received.update(b.column("uid").to_pylist())
                    replies.add(trainer.last_fetch.req)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce), threading.Thread(target=fetch)]
    for t in threads:
        t.start()
    kills = hook_kills = 0
    try:
        for k in range(a.kills):
            if k % 2 == 0:  # the test hook: the server dies between the fsync of "served" and the send
                if proc.wait(60) != -signal.SIGKILL:
                    raise SystemExit(f"the test hook did not kill the server (rc {proc.returncode})")
                hook_kills += 1
            else:  # from outside, at a random moment
                time.sleep(rng.uniform(0.2, 1.0))
                proc.kill()
                proc.wait(20)
            kills += 1
            time.sleep(rng.uniform(0.0, 0.3))  # down for a moment: the clients' resends queue up
            proc, _ = start_server(directory, addr, hook(k + 1))
        stop_producing.set()
        threads[0].join(300)
        deadline = time.monotonic() + 120
        while (
            sum(1 for u in acked if received[u]) < len(acked) and time.monotonic() < deadline and not errors
        ):
            time.sleep(0.1)
        stop_fetching.set()
        threads[1].join(120)
    finally:
        stop_producing.set()
        stop_fetching.set()
        stats = trainer.stats() if proc.poll() is None else {}
        producer.close()
        trainer.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
    served = [r for r in iter_log(directory) if r.op == "served"]
    lost = sorted(set(acked) - set(received))
    duplicated = sum(n - 1 for n in received.values() if n > 1)
    undelivered = [r.req for r in served if r.req not in replies]
    out = {
        "bench": "buffer_exactly_once",
        "exactly_once": not errors and not lost and not duplicated and not undelivered and kills == a.kills,
        "kills": kills,
        "hook_kills": hook_kills,  # of which between the fsync of "served" and the send
        "acked": len(acked),
        "received": len(received),
        "lost": len(lost),
        "duplicated": duplicated,
        "received_not_acked": len(set(received) - acked),
        "served_fetches_logged": len(served),
        "served_fetches_not_delivered": len(undelivered),
        "fetches_replayed_last_server": stats.get("replayed_fetches"),
        "errors": [repr(e)[:200] for e in errors],
        "seconds": round(time.monotonic() - t0, 1),
    }
    record(out, a.results)


if __name__ == "__main__":
    main()
