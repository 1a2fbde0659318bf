"""Run a few trainer steps on fixed synthetic data and write the losses + exported weights, so tests
can compare TP/PP/DP layouts against TP=1 (`torchrun --nproc-per-node 2 -m stages.trainer.parallel_check`)."""

from __future__ import annotations

import argparse
import json
import os


def with_recorded_experts(batch, hc: dict, seed: int):
    """`batch` whose samples carry routed_experts: for each forwarded position and MoE layer, top-k
    distinct experts drawn at random (what an engine whose routing disagrees everywhere would record)."""
    import numpy as np

    from buffer.record import batch_to_samples, samples_to_batch
    from stages.models import moe_layer_flags
    from stages.trainer.moe_config import num_experts

    rng = np.random.default_rng(seed)
    layers, k = sum(moe_layer_flags(hc)), hc["num_experts_per_tok"]
    experts = num_experts(hc)  # Qwen's num_experts / num_local_experts, GLM's n_routed_experts
    samples = batch_to_samples(batch)
    for s in samples:
        rows = s.prompt_len + s.response_len - 1
        ids = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :k]
        s.routed_experts = ids.astype("<i2").tobytes()
    return samples_to_batch(samples)


class RecordingSender:
    """Rank 0's sender for weights.snapshot=direct with no engines: takes each push's tensors as every
    rank gathers them (the lockstep a real push needs) and keeps the last push's."""

    def __init__(self):
        self.pushes, self.last = 0, {}

    def push_now(self, version: int, named, expect_bytes: int | None = None) -> dict:
        self.last = {n: t.detach().clone().contiguous() for n, t in named}
        self.pushes += 1
        return {"version": version, "seconds": 0.0, "engines": 0}

    def catch_up(self):
        return None

    def needs_push(self) -> list:
        return []


def resumed_version(run_dir: str) -> int:
    """The version a run in `run_dir` resumes at (0: none to resume)."""
    from stages.trainer.checkpoint import latest_path

    path = latest_path(run_dir)
    if path is None:
        return 0
    with open(os.path.join(path, "trainer_state.json")) as f:
        return int(json.load(f)["version"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"], help="trainer.backend")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (MoE models)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    ap.add_argument("--advantage", default="grpo")
    ap.add_argument("--correction", default="tis")
    ap.add_argument("--layout", default="sdpa", help="trainer.attention: sdpa (block mask) or varlen")
    ap.add_argument("--precision", default="fp32", help="fp32, or bf16 (on CUDA: the varlen layout)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=48)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument(
        "--distributed-optimizer", action="store_true", help="trainer.distributed_optimizer (Adam, DP > 1)"
    )
    ap.add_argument("--push", action="store_true", help="attach a CPU weight sender (no engines) on rank 0")
    ap.add_argument(
        "--direct-push",
        action="store_true",
        help="weights.snapshot=direct into a recording sender on rank 0 (no engines); writes pushed.safetensors",
    )
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--load", default="", help="trainer.load: start from this run dir's checkpoint")
    ap.add_argument("--ckpt-step", type=int, default=0, help="trainer.ckpt_step")
    ap.add_argument("--finetune", action="store_true", help="trainer.finetune")
    ap.add_argument(
        "--routing-replay", action="store_true", help="MoE: samples carry recorded experts, replayed"
    )
    ap.add_argument("--lora-rank", type=int, default=0, help="trainer.lora.rank (all target modules)")
    ap.add_argument("--lora-save", default="", help="trainer.lora.modules_to_save, comma-separated")
    ap.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="",
        choices=["full", "block", "selective"],
        help="trainer.recompute: full (uniform, 1 layer), block (the first layer of each stage), selective",
    )
    a = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from stages.trainer.config import TrainerConfig, TrainerRun
    from stages.trainer.export import export_hf_state
    from stages.trainer.model import init_distributed
    from stages.trainer.testing import ListSource, make_batch
    from stages.trainer.trainer import Trainer
    from stages.weights.config import WeightsConfig

    torch.set_num_threads(1)
    tc, wc = TrainerConfig(), WeightsConfig()
    tc.backend = a.backend
    tc.tp, tc.pp, tc.batch_groups = a.tp, a.pp, 2
    tc.cp, tc.sequence_parallel, tc.attention = a.cp, a.sp, a.layout
    tc.loss.advantage, tc.loss.correction = a.advantage, a.correction
    tc.precision = a.precision
    tc.micro_batch_tokens, tc.lr = a.micro_batch_tokens, a.lr
    # SGD: Adam's g / sqrt(v) turns float-rounding differences of near-zero gradients into visible
    # weight differences, which would hide real layout bugs behind a loose tolerance
    tc.optimizer, tc.distributed_optimizer = a.optimizer, a.distributed_optimizer
    tc.checkpoint_every, tc.recompute = a.checkpoint_every, bool(a.recompute)
    tc.recompute_granularity = "selective" if a.recompute == "selective" else "full"
    tc.recompute_method = "block" if a.recompute == "block" else "uniform"
    tc.loss.entropy_coef = 0.01  # exercises the vocab-parallel entropy gradient
    if a.lora_rank:
        from stages.trainer.config import LoraConfig

        save = [m for m in a.lora_save.split(",") if m]
        tc.lora = LoraConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank, modules_to_save=save)
    run = TrainerRun(run_dir=a.out + "/run")  # the run-wide defaults (seed 0, 60 steps, staleness 2)
    # resumed: the batches the uninterrupted run takes after the checkpoint's version (step i: seed i)
    tr_offset = resumed_version(a.out + "/run")
    tc.load, tc.ckpt_step, tc.finetune = a.load, a.ckpt_step, a.finetune
    if a.load and not a.finetune and not tr_offset:  # started from another run's checkpoint: its batches on
        from stages.trainer.checkpoint import resolve_checkpoint

        with open(os.path.join(resolve_checkpoint(a.load, a.ckpt_step), "trainer_state.json")) as f:
            tr_offset = int(json.load(f)["version"])
    with open(os.path.join(a.model_path, "config.json")) as f:
        hc = json.load(f)
    vocab = hc["vocab_size"]
    batches = [make_batch(2, 4, seed=i + tr_offset, vocab=vocab) for i in range(a.steps)]
    if a.routing_replay:
        tc.routing_replay = True
        batches = [with_recorded_experts(b, hc, seed=i + tr_offset) for i, b in enumerate(batches)]
    src = ListSource(batches)
    if hasattr(tc, "ep"):  # the trainer takes EP/ETP from its config once it has the keys
        tc.ep, tc.etp = a.ep, a.etp or a.tp
    else:  # else the groups are made here first, and the trainer joins them as they are
        init_distributed(a.tp, a.pp, seed=run.seed, cp=a.cp, ep=a.ep, etp=a.etp or a.tp)
    source = src if int(os.environ.get("RANK", 0)) == 0 else None
    tr = Trainer(tc, run, source, a.model_path, weights=wc)
    if a.push and tr.rank == 0:
        from stages.weights.zmq_transport import ZmqWeightSender

        tr.attach_sender(ZmqWeightSender(timeout_s=30))
    recorder = RecordingSender() if a.direct_push and tr.rank == 0 else None
    if a.direct_push:
        wc.snapshot = "direct"
        tr.attach_sender(recorder)  # None on the other ranks, which gather in step
    losses = [tr.step() for _ in range(a.steps)]
    tr.close()
    # the fsdp backend's policy is an HF model: its export is the backend's own (HF names already)
    state = export_hf_state(tr.policy) if a.backend == "megatron" else tr.backend.weight_export().snapshot()
    if tr.policy.lora is not None:  # collective: the adapters alone, as a PEFT folder
        from stages.trainer.lora import save_peft

        save_peft(tr.policy.lora, a.out + "/adapter", a.model_path, state)
    if state is not None:
        os.makedirs(a.out, exist_ok=True)
        save_file(state, a.out + "/weights.safetensors")
        if recorder is not None:
            assert recorder.pushes == a.steps, f"{recorder.pushes} direct pushes in {a.steps} steps"
            save_file(recorder.last, a.out + "/pushed.safetensors")
        with open(a.out + "/metrics.json", "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    from stages.trainer.world import leave_world_at_exit

    main()
    leave_world_at_exit()
