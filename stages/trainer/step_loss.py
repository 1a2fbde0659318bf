"""One optimizer step's policy loss, one micro-batch at a time: what both backends (megatron_backend.py,
fsdp_backend.py) compute around their own forward/backward schedules, and the statistics a step returns.
"""

from __future__ import annotations

import torch

from stages.trainer import losses
from stages.trainer.config import TrainerConfig
from stages.trainer.packing import MicroBatch, TokenBatch
from stages.trainer.step_metrics import accumulate


class StepLoss:
    """`loss(mb, logp, ent) -> (num, den)` for each micro-batch of a step; `stats` sums their statistics
    and `old` holds logp_old ([T], this rank's tokens), taken from the training forward when the step
    was given none (`from_train`)."""

    def __init__(
        self,
        tb: TokenBatch,
        adv: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        tc: TrainerConfig,
        device: torch.device,
        *,
        count_unpacked: bool,
        first_rank: bool,
        cp_group=None,
    ):
        self.tb, self.ref, self.lc, self.device, self.cp_group = tb, ref, tc.loss, device, cp_group
        # token tensors go to the device once per step, not once per micro-batch
        self.rollout, self.mask, self.seq = (x.to(device) for x in (tb.rollout_logprobs, tb.mask, tb.seq))
        self.sft_mask = None if tb.sft_mask is None else tb.sft_mask.to(device)
        self.adv = adv.to(device)
        self.from_train = old is None
        self.old = torch.zeros_like(self.rollout) if old is None else old
        self.stats: dict[str, torch.Tensor] = {}
        # sample-mean over every sample of the step (sample_mean_denominator=all, slime): samples without
        # response tokens are in no micro-batch, so the first data-parallel rank's first micro-batch
        # counts them
        self.unpacked = 0
        lc = self.lc
        if (
            count_unpacked
            and first_rank
            and losses.aggregation_mode(lc) == "sample"
            and lc.sample_mean_denominator == "all"
        ):
            self.unpacked = int((torch.bincount(tb.seq, minlength=tb.n) == 0).sum())

    def __call__(self, mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):
        ix = mb.tok_index.to(self.device)
        if self.from_train:
            self.old[ix] = logp.detach()
        num, den, st = losses.policy_loss(
            logp,
            self.old[ix],
            self.rollout[ix],
            self.adv[ix],
            self.mask[ix],
            self.seq[ix],
            self.tb.n,
            self.lc,
            logp_ref=self.ref[ix] if self.ref is not None else None,
            entropy=ent,
            cp_group=self.cp_group,
            sft_mask=None if self.sft_mask is None else self.sft_mask[ix],
        )
        if self.unpacked:
            den = den + self.unpacked
            st["sum/loss_den"] = st["sum/loss_den"] + self.unpacked
            self.unpacked = 0
        accumulate(self.stats, st)
        return num, den


def refuse_nonfinite(tc: TrainerConfig, version: int) -> None:
    """A step whose loss or gradients are not finite: trainer.on_nonfinite=stop fails the trainer here
    (skip: the caller applies nothing; one NaN would otherwise turn every weight into NaN, for good)."""
    if tc.on_nonfinite == "stop":
        raise FloatingPointError(
            f"trainer at version {version}: the loss or a gradient is not finite (NaN/inf); "
            "nothing was applied. Check the batch's rewards and logprobs, or set "
            "trainer.on_nonfinite=skip to skip such steps"
        )


def step_stats(stats: dict, *, applied: bool, grad_norm: float | None, lr: float) -> dict:
    """The step's summed statistics on the CPU (one transfer, after the device work), with whether it
    was skipped, its gradient norm and its learning rate."""
    out = {k: v.cpu() for k, v in stats.items()}
    out["sum/skipped"] = torch.tensor(float(not applied))
    out["sum/grad_norm"] = torch.tensor(float(0.0 if grad_norm is None else grad_norm))
    out["sum/lr"] = torch.tensor(lr)
    return out
