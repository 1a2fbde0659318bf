"""trainer.backend=fsdp: the TrainBackend (backend.py) of an HF-native policy, any transformers causal
LM, sharded over the trainer's ranks with torch's FSDP2 (fsdp_model.py). Every rank is a data-parallel
replica (no TP/PP/CP/EP: config.py refuses them by key).

The step is the megatron backend's, computed the same way: the same packing, the same fused logprob /
entropy head on the final hidden states, the same per-micro-batch loss (losses.policy_loss) and
statistics, gradients summed over micro-batches and ranks and divided by the step's token count (as
megatron's calculate_per_token_loss does), gradient-norm clipping as megatron's (clip / (norm + 1e-6)),
torch's AdamW / SGD as megatron builds them. Checkpoints: fsdp_checkpoint.FsdpPart; weights out:
fsdp_export.FsdpExport.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from stages.trainer.config import TrainerConfig, TrainerRun, check_fsdp
from stages.trainer.export import save_hf
from stages.trainer.fsdp_checkpoint import FsdpPart
from stages.trainer.fsdp_export import FsdpExport, iter_full
from stages.trainer.fsdp_model import (
    HeadedLM,
    attention_impl,
    build_optimizer,
    load_lm,
    local,
    reshard_all,
    shard,
)
from stages.trainer.hf_varlen import VARLEN
from stages.trainer.moe import empty_microbatch
from stages.trainer.packing import ROW_ALIGN, MicroBatch, TokenBatch, pack
from stages.trainer.step_loss import StepLoss, refuse_nonfinite, step_stats
from stages.trainer.world import join_world

log = logging.getLogger(__name__)


class FsdpPolicy:
    """What the trainer's hooks and tests see of the policy (megatron's model.Policy counterpart)."""

    def __init__(self, model: HeadedLM, hf_config: Any, model_path: str):
        self.model, self.hf_config, self.model_path = model, hf_config, model_path
        self.lora = None  # refused by config for this backend


class FsdpBackend:
    """TrainBackend on FSDP2. Joins torch.distributed on construction."""

    def __init__(self, tc: TrainerConfig, run: TrainerRun, model_path: str):
        from torch.distributed.device_mesh import init_device_mesh

        self.tc, self.run, self.model_path = tc, run, model_path
        check_fsdp(tc)  # again: tests and tools set fields after the config was built
        join_world()
        self.rank = dist.get_rank()
        self.dp, self.dp_rank = dist.get_world_size(), self.rank
        if tc.dp not in (1, self.dp):
            raise ValueError(
                f"trainer.dp={tc.dp} but the world has {self.dp} ranks (fsdp: all data-parallel)"
            )
        cuda = torch.cuda.is_available() and tc.device != "cpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if not cuda:
            from stages.trainer import cpu_shim

            cpu_shim.activate()  # checkpoints go through megatron's dist_checkpointing (CUDA-minded)
        torch.manual_seed(run.seed)
        self.bf16 = tc.precision == "bf16"
        self.attn = attention_impl(tc.attention, cuda, self.bf16)
        self.mesh = init_device_mesh(self.device.type, (self.dp,))
        self.policy = FsdpPolicy(self._build(model_path, train=True), None, model_path)
        self.hf_config = self.policy.model.lm.config
        self.attn = self.hf_config._attn_implementation  # load_lm keeps sdpa for windowed families
        self.optimizer = build_optimizer(self.policy.model, tc)
        # a KL term's frozen reference model; a served teacher's logprobs come with the samples instead
        self.has_reference = (tc.loss.kl_coef > 0 or tc.loss.kl_in_reward_coef > 0) and not tc.distill.server
        self.ref = None
        if self.has_reference:  # the KL's frozen reference: trainer.ref_load, else the initial policy
            self.ref = self._build(tc.ref_load or model_path, train=False)
            if self.ref.lm.config.vocab_size != self.hf_config.vocab_size:
                raise ValueError(
                    f"trainer.ref_load={tc.ref_load!r} has a vocabulary of {self.ref.lm.config.vocab_size}, "
                    f"the policy {self.hf_config.vocab_size}: the KL needs the same tokenizer"
                )
        log.info(
            "fsdp backend: %s over %d ranks, attention %s",
            type(self.policy.model.lm).__name__,
            self.dp,
            self.attn,
        )

    def _build(self, path: str, train: bool) -> HeadedLM:
        lm = load_lm(path, self.attn, fallback=self.tc.attention == "auto")
        if train and self.tc.recompute:  # activation checkpointing of every decoder layer
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = HeadedLM(lm).to(self.device)
        if not train:
            model.eval().requires_grad_(False)
        return shard(
            model,
            self.mesh,
            bf16=self.bf16 and self.device.type == "cuda",
            offload=self.tc.fsdp_cpu_offload,
            reshard=not self.keep_unsharded,
            compile_layers=self.tc.fsdp_compile and train,
        )

    @property
    def keep_unsharded(self) -> bool:
        """One rank: its layers stay unsharded through a pass's micro-batches (reshard_all after it).
        Resharding frees nothing there (a shard is the whole weight), while each unshard re-casts the
        layer's fp32 weights to bf16: at 1.5B on an H200, 20k copy kernels a step left the backend
        host-bound (bench/RESULTS.md, GPU session of 2026-11-28, 11:05). With more ranks each unshard is
        an all-gather, and holding every layer gathered would cost the memory FSDP is there to save."""
        return self.dp == 1 and not self.tc.fsdp_cpu_offload

    # -- the schedule ------------------------------------------------------------------------------
    def _equal_count(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Every rank runs as many forwards (and backwards) as the others: FSDP all-gathers each layer's
        weights in each of them. Short ranks get empty micro-batches (padding only, no loss)."""
        if self.dp == 1:
            return mbs
        n = torch.tensor([len(mbs)], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return list(mbs) + [empty_microbatch(ROW_ALIGN) for _ in range(int(n.item()) - len(mbs))]

    def _head(self, model: HeadedLM, mb: MicroBatch, entropy=False, entropy_grad=False):
        dev = self.device
        return model(
            mb.tokens.to(dev),
            mb.segments.to(dev),
            mb.resp_pos.to(dev),
            mb.targets.reshape(-1).to(dev)[mb.resp_pos.to(dev)],
            temperature=self.run.temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            chunk=self.tc.logits_chunk_tokens,
            fp32_logits=self.run.fp32_lm_head,
            **self._bounds(mb),
        )

    def _bounds(self, mb: MicroBatch) -> dict:
        """The micro-batch's segment boundaries, for a packed row's varlen attention."""
        return {"cu_seqlens": mb.cu_seqlens.to(self.device), "max_segment_len": mb.max_segment_len}

    def run_schedule(self, model: Any, mbs: list[MicroBatch], loss_fn, forward_only: bool):
        """ScheduleRunner: `loss_fn(mb, hidden [b, s, h])` per micro-batch, its loss numerator backward
        (gradients synchronised on the last micro-batch only). Returns the summed token count."""
        count = 0
        for i, mb in enumerate(mbs):
            if not forward_only:
                self._accumulating(model, last=i == len(mbs) - 1)
            with torch.set_grad_enabled(not forward_only):
                hidden = model(mb.tokens.to(self.device), mb.segments.to(self.device), **self._bounds(mb))
                num, den, _ = loss_fn(mb, hidden)
            if not forward_only:
                num.backward()
            count += int(den)
        reshard_all(model)
        return count

    def _accumulating(self, model: Any, *, last: bool) -> None:
        """Before a micro-batch's forward: gradients reduce-scattered after the last one only, and (one
        rank) the layers kept unsharded until the last backward is done."""
        model.set_requires_gradient_sync(last)
        if self.keep_unsharded:
            model.set_reshard_after_backward(last)

    def grads_finite(self, acc: dict, model: Any) -> bool:
        bad = torch.zeros((), device=self.device)
        if "sum/loss_num" in acc:
            bad += (~torch.isfinite(acc["sum/loss_num"].to(self.device))).float()
        for p in model.parameters():
            if p.grad is not None:
                bad += (~torch.isfinite(local(p.grad).sum())).float()
        if self.dp > 1:
            dist.all_reduce(bad)
        return bool(bad.item() == 0)

    @torch.no_grad()
    def logprobs(self, tb: TokenBatch, mbs: list[MicroBatch], *, reference: bool = False) -> torch.Tensor:
        model = self.ref if reference else self.policy.model
        out = torch.zeros(len(tb.rollout_logprobs), dtype=torch.float32, device=self.device)
        was = model.training
        model.eval()
        for mb in mbs:
            lp, _ = self._head(model, mb)
            if mb.num_tokens:
                out[mb.tok_index.to(self.device)] = lp.float()
        reshard_all(model)
        model.train(was)
        return out

    def batch_whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """Each rank filled its own samples' tokens (zeros elsewhere): one all-reduce sums them."""
        x = per_token.detach().clone().to(self.device)
        if self.dp > 1:
            dist.all_reduce(x)
        return x.cpu()

    def check_batch(self, tb: TokenBatch) -> None:
        if tb.routed is not None:
            log.debug("fsdp backend: the batch's routed_experts are ignored (no routing replay)")

    def pack(self, tb: TokenBatch, samples: list[int]) -> list[MicroBatch]:
        """The megatron backend's rows: block-diagonal segments, which the position ids restart in;
        packed rows (one per micro-batch) where the attention is varlen."""
        mbs = pack(
            tb, samples, self.tc.micro_batch_tokens, packed_row=self.attn in ("flash_attention_2", VARLEN)
        )
        return self._equal_count(mbs)

    # -- the update --------------------------------------------------------------------------------
    def train(
        self,
        tb: TokenBatch,
        mbs: list[MicroBatch],
        adv: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        *,
        lr: float,
        version: int,
        count_unpacked: bool = True,
    ) -> tuple[dict, torch.Tensor]:
        lc, dev, model = self.tc.loss, self.device, self.policy.model
        loss = StepLoss(
            tb, adv, old, ref, self.tc, dev, count_unpacked=count_unpacked, first_rank=self.dp_rank == 0
        )
        self.optimizer.zero_grad(set_to_none=True)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        den_total = torch.zeros((), dtype=torch.int64, device=dev)
        model.train()
        for i, mb in enumerate(mbs):
            self._accumulating(model, last=i == len(mbs) - 1)  # one reduce-scatter, after the last
            logp, ent = self._head(model, mb, entropy=True, entropy_grad=lc.entropy_coef > 0)
            if mb.num_tokens == 0:  # an empty micro-batch (_equal_count): its backward joins FSDP's
                logp.sum().mul(0.0).backward()
                continue
            num, den = loss(mb, logp, ent)
            num.backward()
            den_total += den.round().long()  # megatron's per-token normalisation counts whole tokens
        reshard_all(model)  # the optimizer and the clipping below work on the shards
        if self.dp > 1:
            dist.all_reduce(den_total)
        # FSDP averaged the reduce-scattered gradients over the ranks; megatron sums them and divides by
        # the step's tokens: x dp / tokens gives the same
        if int(den_total) > 0:
            scale = self.dp / float(den_total)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        ok = self.grads_finite(loss.stats, model)
        grad_norm = 0.0
        if ok:
            if self.tc.grad_clip > 0:
                grad_norm = self._clip(self.tc.grad_clip)
            self.optimizer.step()
        else:
            refuse_nonfinite(self.tc, version)
            grad_norm = float("nan")
        self.optimizer.zero_grad(set_to_none=True)
        return step_stats(loss.stats, applied=ok, grad_norm=grad_norm, lr=lr), loss.old.cpu()

    def _clip(self, max_norm: float) -> float:
        """The whole gradient's L2 norm (the shards' squares summed over the ranks), and megatron's
        clipping: scaled by max_norm / (norm + 1e-6) when that is below 1."""
        grads = [local(p.grad) for p in self.policy.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.dp > 1:
            dist.all_reduce(sq)
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1.0e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # -- figures -----------------------------------------------------------------------------------
    def reduce_stats(self, stats: dict, keys: tuple[str, ...]) -> dict[str, float]:
        red = {}
        for op, neutral in (("sum", 0.0), ("min", math.inf), ("max", -math.inf)):
            names = [k for k in keys if k.startswith(op + "/")]
            v = torch.tensor(
                [float(stats.get(k, neutral)) for k in names], dtype=torch.float64, device=self.device
            )
            if self.dp > 1:
                dist.all_reduce(
                    v, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
                )
            red.update(zip(names, v.tolist()))
        for k in ("sum/grad_norm", "sum/lr", "sum/critic_grad_norm"):  # the same on every rank
            if k in red:
                red[k] /= self.dp
        return red

    def model_metrics(self) -> dict:
        return {}

    def active_params(self) -> int:
        """Parameters of the whole model (global shapes of the shards); MoE's routed share is not
        taken out: the figure is every parameter a token may use."""
        return sum(p.numel() for p in self.policy.model.lm.parameters())

    # -- weights out, state in and out ---------------------------------------------------------------
    def weight_export(self) -> FsdpExport:
        return FsdpExport(self.policy.model, torch.bfloat16 if self.bf16 else None)

    def save_hf(self, out_dir: str) -> str | None:
        dtype = torch.bfloat16 if self.bf16 else None
        state = {name: t.to("cpu", copy=True) for name, t in iter_full(self.policy.model, dtype)}
        if self.rank != 0:
            return None
        return save_hf(state, self.model_path, out_dir, dtype="bfloat16" if self.bf16 else None)

    def checkpoint_part(self) -> FsdpPart:
        return FsdpPart(self.policy.model, self.optimizer)

    def nonfinite_param(self) -> str | None:
        for name, p in self.policy.model.lm.named_parameters():
            if not torch.isfinite(local(p).detach()).all():
                return name
        return None

    def build_critic(self):
        raise ValueError(
            "trainer.backend=fsdp has no critic yet: trainer.loss.advantage=ppo needs trainer.backend=megatron"
        )
