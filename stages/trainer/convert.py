"""Offline conversion between an HF model folder and the trainer's megatron checkpoint (slime's
tools/convert_hf_to_torch_dist.py and convert_torch_dist_to_hf.py):

    python -m stages.trainer.convert hf-to-megatron --hf MODEL --out DIR [--tp 2] [--pp 1] [--ep 1]
    python -m stages.trainer.convert megatron-to-hf --load CKPT --hf BASE --out HF_DIR [--ckpt-step N]

The checkpoint is the trainer's own (DIR/checkpoints/step_000000, weights only, version 0), so a run
starts from it with `trainer.load=DIR`. megatron's sharded tensors make a checkpoint load under any other
TP/PP/EP layout than it was written with; --tp/--pp/--ep are the layout the conversion itself runs
under (it starts that many ranks on this machine: gloo on CPU, one GPU each where there are GPUs).
`--load` takes what trainer.load takes (a run dir, its checkpoints/ folder, a step_N folder) and `--hf`
the HF folder the checkpoint's model came from (its config and tokenizer; its weights are replaced).
A LoRA run's adapters are not converted here: its own HF export (trainer.save_hf_every, the end of the
run) writes the merged model and a PEFT folder.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m stages.trainer.convert", description=__doc__.splitlines()[0])
    ap.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    ap.add_argument("--hf", required=True, help="the HF model folder (megatron-to-hf: the base it came from)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--load", default="", help="megatron-to-hf: the checkpoint (as trainer.load takes it)")
    ap.add_argument("--ckpt-step", type=int, default=0, help="megatron-to-hf: step_N of --load; 0 = latest")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    a = ap.parse_args(argv)
    if a.direction == "megatron-to-hf" and not a.load:
        ap.error("megatron-to-hf needs --load (the checkpoint to convert)")
    if not os.path.exists(os.path.join(a.hf, "config.json")):
        ap.error(f"--hf {a.hf!r} is not an HF model folder (no config.json)")
    return a


def convert(a: argparse.Namespace) -> str | None:
    """This rank's part of the conversion (every rank calls it); the output folder on rank 0."""
    import torch.distributed as dist

    from stages.trainer.checkpoint import ROOT, CheckpointManager, MegatronPart, resolve_checkpoint
    from stages.trainer.export import export_hf_state, save_hf
    from stages.trainer.model import build_policy, init_distributed

    init_distributed(a.tp, a.pp, seed=0, ep=a.ep, etp=a.tp)
    policy = build_policy(a.hf, tp=a.tp, pp=a.pp)
    part = {ROOT: MegatronPart(policy.model, None)}  # weights only: no optimizer state to carry
    if a.direction == "hf-to-megatron":
        path = CheckpointManager(a.out).save(0, part, {"model_path": os.path.abspath(a.hf)})
        return path if dist.get_rank() == 0 else None
    CheckpointManager(a.out).load(part, resolve_checkpoint(a.load, a.ckpt_step), optimizer=False)
    state = export_hf_state(policy)
    return save_hf(state, a.hf, a.out) if dist.get_rank() == 0 else None


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    nproc = a.tp * a.pp
    if "RANK" not in os.environ:  # the launcher: start the ranks (one is this process's own world)
        from stages.trainer.ranks import RanksFailed, run_ranks

        try:
            run_ranks("stages.trainer.convert", sys.argv[1:] if argv is None else argv, nproc, a.timeout_s)
        except RanksFailed as e:
            raise SystemExit(f"convert: {e}") from None
        print(f"converted {a.direction}: {a.out}")
        return
    from stages.trainer.world import leave_world_at_exit

    convert(a)
    leave_world_at_exit()


if __name__ == "__main__":
    main()
