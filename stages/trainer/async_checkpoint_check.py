"""A few trainer steps with an asynchronous checkpoint after each, for tests of async_checkpoint.py in
processes of their own: a rank killed while a save is written, a process that exits without waiting
for it, several ranks saving over the checkpoint's own process group.

    python -m stages.trainer.async_checkpoint_check --model-path M --out D --steps 3 [--hold-write-of 3]

Step i trains on synthetic batch i (seeded by the version it starts from, so a resumed run takes the
batches the uninterrupted one took); after each step rank 0 writes the policy's weights to
D/weights_v<version>.pt. With --hold-write-of V the write of version V's checkpoint (in the writer
process) stops before its first shard for --hold-s seconds (default: until killed), after it creates
D/holding_v<V>.
"""

from __future__ import annotations

import argparse
import os
import time

HOOK = "stages.trainer.async_checkpoint_check:hold_writes"  # what a writer process calls (hold_writes)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="synchronous saves (the reference)")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--hold-write-of", type=int, default=0, help="the version whose write stops")
    ap.add_argument("--hold-s", type=float, default=0.0, help="how long it stops; 0: until killed")
    ap.add_argument("--no-close", action="store_true", help="exit without trainer.close() (no wait)")
    return ap.parse_args()


def hold_writes(
    version: str, seconds: str = "0", marker: str = "", release: str = "", fail: str = ""
) -> None:
    """A writer hook (CheckpointManager's writer_hook, called in the writer process with strings): the
    write of `version`'s checkpoint creates `marker` before its first shard, then raises OSError with
    `fail`, or waits for the file `release` (at most 120 s), or for `seconds` (0: until killed, or 10
    minutes)."""
    from stages.trainer import async_checkpoint

    write = async_checkpoint.write_bucket
    name = f"{async_checkpoint.TMP_PREFIX}step_{int(version):06d}"

    def held(transforms, index, bucket):
        if name in bucket[0]:  # the bucket's file path: <checkpoints>/.tmp-step_N/...
            if marker:
                open(marker, "a").close()
            if fail:
                raise OSError(28, "No space left on device (the test's hook)")
            # "until killed" ends after 10 minutes all the same: a writer a test failed to end goes
            deadline = time.monotonic() + (120.0 if release else float(seconds) or 600.0)
            while time.monotonic() < deadline and not (release and os.path.exists(release)):
                time.sleep(0.02)
        return write(transforms, index, bucket)

    async_checkpoint.write_bucket = held


def make_trainer(
    model_path: str, out: str, steps: int, *, async_save: bool, distributed_optimizer=False, hook=()
):
    """The trainer of these checks in `out`/run (resumed from its latest checkpoint), with the `steps`
    batches it takes from there; a test in its own process makes the same to compare with. `hook`:
    the writer process's (hold_writes and its arguments)."""
    import json

    from stages.trainer.checkpoint import CheckpointManager, latest_path
    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.testing import ListSource, make_batch
    from stages.trainer.trainer import Trainer
    from stages.weights.config import WeightsConfig

    tc = TrainerConfig()
    tc.batch_groups, tc.micro_batch_tokens, tc.checkpoint_every, tc.checkpoint_every_s = 2, 64, 1, 0.0
    tc.optimizer, tc.lr, tc.distributed_optimizer = "adam", 0.01, distributed_optimizer
    tc.keep_checkpoints = 0  # trainer.async_save: the manager below, with the test's writer hook
    run = TrainerRun(run_dir=os.path.join(out, "run"))
    start = 0
    if latest_path(run.run_dir):
        with open(os.path.join(latest_path(run.run_dir), "trainer_state.json")) as f:
            start = int(json.load(f)["version"])
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    batches = [make_batch(2, 4, seed=start + i, vocab=vocab) for i in range(steps)]
    rank = int(os.environ.get("RANK", 0))
    tr = Trainer(tc, run, ListSource(batches) if rank == 0 else None, model_path, weights=WeightsConfig())
    tr.checkpoints = CheckpointManager(tr.run_dir, keep=0, async_save=async_save, writer_hook=hook)
    return tr


def main() -> None:
    a = parse()
    import torch

    torch.set_num_threads(1)
    hook = ()
    if a.hold_write_of:
        marker = os.path.join(a.out, f"holding_v{a.hold_write_of}")
        hook = (HOOK, str(a.hold_write_of), str(a.hold_s), marker)
    tr = make_trainer(
        a.model_path,
        a.out,
        a.steps,
        async_save=not a.sync,
        distributed_optimizer=a.distributed_optimizer,
        hook=hook,
    )
    os.makedirs(a.out, exist_ok=True)
    if tr.rank == 0 and tr.checkpoints.writer_pid is not None:  # the test checks it dies with us
        with open(os.path.join(a.out, "writer_pid"), "w") as f:
            f.write(str(tr.checkpoints.writer_pid))
    for _ in range(a.steps):
        tr.step()
        if tr.rank == 0:
            state = {n: p.detach().clone() for n, p in tr.policy.model.named_parameters()}
            torch.save(state, os.path.join(a.out, f"weights_v{tr.version}.pt"))
    if not a.no_close:
        tr.close()
        tr.checkpoints.close()  # Trainer.close() does it too once trainer.py calls it


if __name__ == "__main__":
    from stages.trainer.world import leave_world_at_exit

    main()
    leave_world_at_exit()
