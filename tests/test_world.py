"""Leaving the torch.distributed world at a rank's normal end (stages/trainer/world.py)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import torch, torch.distributed as dist
    from stages.trainer.world import join_world, leave_world_at_exit

    def late_collective():  # as an asynchronous checkpoint's writer thread still committing
        time.sleep(1.0)
        t = torch.ones(1)
        dist.all_reduce(t)
        with open(sys.argv[1], "w") as f:
            f.write(f"rank {dist.get_rank()} sum {t.item()}")

    join_world()
    threading.Thread(target=late_collective).start()
    leave_world_at_exit()
    """
)


def test_a_thread_still_running_at_the_normal_end_keeps_the_world_until_it_ends(tmp_path):
    out = tmp_path / "done"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == "rank 0 sum 1.0"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
