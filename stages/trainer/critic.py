"""The critic of `trainer.loss.advantage=ppo`: a value model trained beside the policy.

It is the policy's architecture, built from the same HF folder by the same machinery
(`model.build_policy` with `output_hidden=True`, so the GPTModel returns its final hidden states), with
a scalar head `Linear(hidden, 1)` instead of the LM head. The head hangs off the GPTModel as a
submodule, so megatron's DDP reduces its gradient over DP with the trunk's, the optimizer updates it,
and the model's sharded state dict (the checkpoint) carries it, replicated like a norm weight.

V_t is read at the position whose hidden state predicts response token t (the state before the token
is emitted), the same positions the policy's logprobs use. Values are computed by the trainer at
training time, from its own weights, never by the generators: an asynchronous sample is valued by the
current critic, whatever policy version produced it.

Supported layouts: TP and DP (the hidden state is whole on every TP rank, so each holds the same head
and the same value gradient); PP, CP and sequence parallelism are refused at config time
(config.check_critic_layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from stages.trainer import cpu_shim, losses
from stages.trainer.backend import ScheduleRunner
from stages.trainer.checkpoint import MegatronPart
from stages.trainer.config import TrainerConfig
from stages.trainer.model import build_policy, unwrap
from stages.trainer.optimizer import build_optimizer


class Critic:
    """The value model and its optimizer. It runs on a ScheduleRunner (the backend that built it), so
    it shares the policy's schedule and finiteness check without knowing the trainer; the trainer hands
    it the policy's learning rate and version (its schedule is the policy's, scaled by `lr_scale`)."""

    def __init__(
        self, model: Any, optimizer: Any, lr_scale: float, runner: ScheduleRunner, tc: TrainerConfig
    ):
        self.model = model  # megatron DDP(Float16Module?(GPTModel with .value_head))
        self.optimizer = optimizer
        self.lr_scale = lr_scale  # trainer.critic_lr / trainer.lr
        self.runner, self.tc = runner, tc

    def checkpoint_part(self) -> MegatronPart:
        return MegatronPart(self.model, self.optimizer)

    @torch.no_grad()
    def values(self, tb, mbs) -> torch.Tensor:
        """The critic's values [T] at this rank's tokens (zeros elsewhere), on the runner's device."""
        dev = self.runner.device
        out = torch.zeros(len(tb.rollout_logprobs), dtype=torch.float32, device=dev)
        self.model.eval()

        def loss_fn(mb, hidden):
            out[mb.tok_index.to(dev)] = _mb_values(self, mb, hidden)
            return hidden.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        self.runner.run_schedule(self.model, mbs, loss_fn, forward_only=True)
        self.model.train()
        return out

    def update(
        self,
        tb,
        mbs,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        *,
        policy_lr: float,
        version: int,
        count_unpacked: bool,
    ) -> dict:
        """One optimizer step of the critic on `mbs` (the micro-batches the policy just trained on) toward
        `returns` with the clipped value loss (losses.value_loss), at `policy_lr` x lr_scale. `old_values`,
        `returns`: [T], the whole batch. Returns summed statistics (sum/value_*, sum/critic_grad_norm,
        sum/critic_skipped) on the CPU."""
        from megatron.core import parallel_state as ps

        lc, dev = self.tc.loss, self.runner.device
        mask, seq = tb.mask.to(dev), tb.seq.to(dev)
        old_v, ret = old_values.to(dev), returns.to(dev)
        acc: dict[str, torch.Tensor] = {}
        # the sample-mean's count includes samples without response tokens (as the policy loss counts them)
        unpacked = [0]
        if count_unpacked and losses.aggregation_mode(lc) == "sample" and lc.sample_mean_denominator == "all":
            if ps.get_data_parallel_rank() == 0:
                unpacked[0] = int((torch.bincount(tb.seq, minlength=tb.n) == 0).sum())

        def loss_fn(mb, hidden):
            ix = mb.tok_index.to(dev)
            num, den, st = losses.value_loss(
                _mb_values(self, mb, hidden), old_v[ix], ret[ix], mask[ix], seq[ix], tb.n, lc
            )
            den, unpacked[0] = den + unpacked[0], 0
            for k, v in st.items():
                acc[k] = acc.get(k, 0.0) + v.detach().double()
            return num, den.round().int(), {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = policy_lr * self.lr_scale
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.runner.run_schedule(self.model, mbs, loss_fn, forward_only=False)
        finite = {"sum/loss_num": acc["sum/value_loss_num"]} if acc else {}
        if self.runner.grads_finite(finite, self.model):
            with cpu_shim.device_mode():
                ok, grad_norm, _ = self.optimizer.step()
        else:
            if self.tc.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"trainer at version {version}: the critic's value loss or a gradient is not finite; "
                    "nothing was applied. Check the batch's rewards, or set trainer.on_nonfinite=skip"
                )
            ok, grad_norm = False, float("nan")
        out = {k: v.cpu() for k, v in acc.items()}
        out["sum/critic_skipped"] = torch.tensor(float(not ok))
        out["sum/critic_grad_norm"] = torch.tensor(float(0.0 if grad_norm is None else grad_norm))
        return out


def build_critic(
    model_path: str, arch: dict, opt_cfg: Any, tc: TrainerConfig, device: torch.device, runner: ScheduleRunner
) -> Critic:
    """The value model, initialised from the policy's HF folder, with its own optimizer (lr
    trainer.critic_lr, the policy's otherwise). `arch`: the policy's build settings; `opt_cfg`: the
    policy's megatron OptimizerConfig."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    built = build_policy(model_path, **arch, recompute=tc.megatron_recompute(), ddp=False)
    gpt = unwrap(built.model)
    # Zero init: V = 0 at the start, so the first advantages are the plain (discounted) returns. Stored in
    # the model's dtype (megatron's bf16 optimizer cannot checkpoint an fp32 parameter among bf16 ones:
    # it pairs a group's master copies with its parameters by position), computed in fp32 (_mb_values)
    head = torch.nn.Linear(built.hf_config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    gpt.value_head = head.to(device, torch.bfloat16 if arch.get("bf16") else torch.float32)
    if getattr(gpt, "output_layer", None) is not None and not gpt.share_embeddings_and_output_weights:
        # the LM head has no part in a value: frozen, it gets no gradient buffer and no Adam state
        gpt.output_layer.weight.requires_grad_(False)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = DistributedDataParallel(built.config, ddp_cfg, built.model)
    built.config.no_sync_func = model.no_sync
    built.config.finalize_model_grads_func = finalize_model_grads
    lr = tc.lr if tc.critic_lr is None else tc.critic_lr
    # plain (not DP-sharded) Adam whatever trainer.distributed_optimizer: the DDP above keeps no
    # sharded buffers, and megatron 0.16 cannot resume a sharded optimizer anyway (checkpoint.py)
    opt_cfg = dataclasses.replace(opt_cfg, lr=lr, use_distributed_optimizer=False)
    optimizer = build_optimizer(opt_cfg, model)
    scale = lr / tc.lr if tc.lr > 0 else 1.0
    return Critic(model, optimizer, scale, runner, tc)


def _mb_values(critic: Critic, mb, hidden) -> torch.Tensor:
    """hidden [b, s, h] of a micro-batch -> V at its response tokens [t] (fp32)."""
    pick = mb.resp_pos.to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])[pick].float()
    head = unwrap(critic.model).value_head
    # an fp32 product whatever the precision: a bf16 output would round every value to 3 significant
    # digits (the gradient reaches bf16 weights through the casts, as model.use_fp32_lm_head's)
    return torch.nn.functional.linear(h, head.weight.float(), head.bias.float()).squeeze(-1)
