"""The figures of one optimizer step: the statistics the loss functions sum per micro-batch, and the
flat metrics dict made of them once they are reduced over ranks (TrainBackend.reduce_stats).

Pure torch on the CPU: no process groups, no model; the same for every backend.
"""

from __future__ import annotations

import torch

from stages.trainer.packing import TokenBatch

# every statistic a step may report, by reduction: sum/ are added, min/ and max/ taken over ranks
STAT_KEYS = (
    "sum/skipped",
    "sum/tokens",
    "sum/tis_weight",
    "min/tis_weight",
    "max/tis_weight",
    "sum/tis_clipped",
    "sum/ppo_clipped",
    "sum/abs_logp_diff",
    "sum/abs_logp_diff_fresh",
    "sum/fresh_tokens",
    "sum/entropy",
    "sum/kl",
    "sum/loss_num",
    "sum/loss_den",
    "sum/grad_norm",
    "sum/lr",
    "sum/value_loss_num",
    "sum/value_loss_den",
    "sum/value_clipped",
    "sum/value_tokens",
    "sum/critic_grad_norm",
    "sum/critic_skipped",
    "sum/sft_nll",
    "sum/sft_tokens",
)


def accumulate(acc: dict, st: dict) -> None:
    """Add a micro-batch's (or an update's) statistics `st` into `acc`, by the reduction of each key."""
    for k, v in st.items():
        v = v.detach().double()  # stays on the device: no sync per micro-batch
        if k not in acc:
            acc[k] = v
        elif k.startswith("min/"):
            acc[k] = torch.minimum(acc[k], v)
        elif k.startswith("max/"):
            acc[k] = torch.maximum(acc[k], v)
        else:
            acc[k] = acc[k] + v


def engine_mismatch(tb: TokenBatch, old: torch.Tensor, shard: list[int], version: int) -> dict:
    """Sum of |logp_old - logp_rollout| over this rank's trained tokens generated at `version` (the
    weights logp_old was computed with), and their count."""
    rows = torch.zeros(tb.n, dtype=torch.bool)
    rows[torch.as_tensor(shard, dtype=torch.long)] = True
    fresh = rows[tb.seq] & (tb.versions == version) & (tb.mask > 0)
    diff = (old.float() - tb.rollout_logprobs).abs()
    return {"sum/abs_logp_diff_fresh": diff[fresh].double().sum(), "sum/fresh_tokens": fresh.double().sum()}


def min_versions(tb: TokenBatch) -> torch.Tensor:
    """Oldest trained token version per sample, as the buffer's staleness bound counts it
    (buffer.record.min_versions); -1 for a sample without trained tokens."""
    big = torch.iinfo(torch.int64).max
    trained = torch.where(tb.mask > 0, tb.versions, torch.full_like(tb.versions, big))
    mins = torch.full((tb.n,), big, dtype=torch.int64).scatter_reduce(0, tb.seq, trained, "amin")
    return torch.where(mins == big, torch.full_like(mins, -1), mins)


def step_metrics(
    red: dict, tb: TokenBatch, adv: torch.Tensor, *, version: int, skipped_total: int, kl: bool, critic: bool
) -> dict:
    """The flat metrics of the step that made `version`, from the reduced statistics `red` (grad norms
    and lr already averaged over the replicas that summed them). `kl`: a reference model is kept."""
    ntok = max(red.get("sum/tokens", 0.0), 1.0)
    rl = tb.rl_rows()
    mins = min_versions(tb)[rl]
    stale = (version - 1) - mins[mins >= 0] if bool((mins >= 0).any()) else torch.zeros(1, dtype=torch.int64)
    return {
        "version": version,
        "loss": red["sum/loss_num"] / max(red["sum/loss_den"], 1.0),
        "grad_norm": red["sum/grad_norm"],
        # 1 when this step's update was not applied (non-finite loss or gradients), and the count so far
        "optimizer/skipped": float(red["sum/skipped"] > 0),
        "optimizer/skipped_total": skipped_total,
        "lr": red["sum/lr"],
        "tis/weight_mean": red["sum/tis_weight"] / ntok,
        "tis/weight_min": red["min/tis_weight"],
        "tis/weight_max": red["max/tis_weight"],
        "tis/clip_frac": red["sum/tis_clipped"] / ntok,
        "ppo/clip_frac": red["sum/ppo_clipped"] / ntok,
        "logp/abs_diff_train_rollout": red["sum/abs_logp_diff"] / ntok,
        # the same on tokens the engine made with exactly these weights: the engine-vs-trainer numerics
        # gap alone (the line above also contains the policy change of stale tokens)
        "logp/abs_diff_same_version": red["sum/abs_logp_diff_fresh"] / max(red["sum/fresh_tokens"], 1.0),
        "logp/same_version_tokens": red["sum/fresh_tokens"],
        "entropy": red.get("sum/entropy", 0.0) / ntok,
        # KL(policy || reference) estimate (trainer.loss.kl_type), token mean over trained tokens
        **({"kl/value": red["sum/kl"] / ntok} if kl else {}),
        **(_critic_metrics(red) if critic else {}),
        "staleness/mean": float(stale.float().mean()),
        "staleness/max": float(stale.max()),
        **{f"staleness/hist_{k}": int(c) for k, c in enumerate(torch.bincount(stale.clamp(min=0)).tolist())},
        **reward_metrics(tb.rewards[rl]),
        # mean |advantage| over trained tokens (advantages are per token)
        "adv/abs_mean": float((adv.abs() * tb.mask).sum() / tb.mask.sum().clamp(min=1.0)),
        "tokens/trained": red["sum/tokens"],
        "tokens/total": float(len(tb.prompt_ids) + len(tb.response_ids)),
        "samples": int(rl.sum()),
        **(_sft_metrics(red, tb) if tb.sft is not None else {}),
    }


def _sft_metrics(red: dict, tb: TokenBatch) -> dict:
    return {
        "sft/nll": red["sum/sft_nll"] / max(red["sum/sft_tokens"], 1.0),  # token mean over SFT tokens
        "sft/tokens": red["sum/sft_tokens"],
        "sft/samples": int(tb.sft.sum()),
    }


def _critic_metrics(red: dict) -> dict:
    return {
        "critic/value_loss": red["sum/value_loss_num"] / max(red["sum/value_loss_den"], 1.0),
        # tokens whose value moved more than trainer.loss.value_clip from the value before the update
        "critic/clip_frac": red["sum/value_clipped"] / max(red["sum/value_tokens"], 1.0),
        "critic/grad_norm": red["sum/critic_grad_norm"],
        "critic/skipped": float(red["sum/critic_skipped"] > 0),
    }


def perf(
    params: int, tokens: float, seconds: float, separate_pass: bool, world: int, peak_tflops: float
) -> dict:
    """Model TFLOP/s per GPU (or process) in the 6 x params x tokens convention (fwd + bwd; 8 x with
    the separate logp_old pass), as slime's perf/actor_train_tflops; MFU against trainer.peak_tflops
    when it is given (the card's measured bf16 peak: bench/trainer_gpu.py prints it). For MoE models
    the parameters are the active ones: all but the experts, plus top_k / num_experts of those."""
    flops = (8 if separate_pass else 6) * params * tokens
    tflops = flops / max(seconds, 1e-9) / world / 1e12
    out = {"perf/tflops": tflops}
    if peak_tflops:
        out["perf/mfu"] = tflops / peak_tflops
    return out


def reward_metrics(rewards: torch.Tensor) -> dict:
    """reward/* of a batch's rewards (the task's, before any shaping: trainer.py passes those)."""
    return {
        # share of samples the verifier scored as fully right (reward >= 1): the accuracy of training data
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(correction=0)),
    }
