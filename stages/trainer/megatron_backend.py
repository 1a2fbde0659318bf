"""The megatron-core backend: the policy (and the KL reference) built from an HF folder as megatron
GPTModels under TP/PP/CP/DP/EP, megatron's forward/backward schedule, its optimizer, reductions over
its process groups, its sharded state for checkpoints and the gather back to HF tensors.

The step itself (trainer.py) sees none of this: it calls the TrainBackend methods (backend.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from stages.trainer import cpu_shim, critic, moe
from stages.trainer.checkpoint import MegatronPart
from stages.trainer.config import TrainerConfig, TrainerRun
from stages.trainer.context_parallel import cp_info, local_positions, local_view
from stages.trainer.export import PolicyExport, export_hf_state, save_hf
from stages.trainer.lm_head import head_logprobs
from stages.trainer.lora import save_peft
from stages.trainer.model import build_policy, head_weight, init_distributed, unwrap
from stages.trainer.optimizer import build_optimizer, use_fused_adam
from stages.trainer.packing import ROW_ALIGN, MicroBatch, TokenBatch, pack
from stages.trainer.routing_replay import RoutingReplay
from stages.trainer.row_layout import causal_block_mask, packed_row_params
from stages.trainer.step_loss import StepLoss, refuse_nonfinite, step_stats

log = logging.getLogger(__name__)


def check_reference(ref_hc, policy_hc, ref_load: str) -> None:
    """The KL compares the two models' distributions over one vocabulary: refuse another one."""
    if ref_load and ref_hc.vocab_size != policy_hc.vocab_size:
        raise ValueError(
            f"trainer.ref_load={ref_load!r} has a vocabulary of {ref_hc.vocab_size}, the policy "
            f"{policy_hc.vocab_size}: the KL needs the same tokenizer (a checkpoint of the same model family)"
        )


class MegatronBackend:
    """TrainBackend (backend.py) on megatron-core. Joins torch.distributed on construction."""

    def __init__(self, tc: TrainerConfig, run: TrainerRun, model_path: str):
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig

        self.tc, self.run, self.model_path = tc, run, model_path
        init_distributed(tc.tp, tc.pp, seed=run.seed, cp=tc.cp, ep=tc.ep, etp=tc.etp or tc.tp)
        self.rank = dist.get_rank()
        self.cp_group, self.cp, self.cp_rank = cp_info()
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        if tc.dp not in (1, self.dp):
            raise ValueError(f"trainer.dp={tc.dp} but the world gives dp={self.dp} (= world / (tp*pp*cp))")
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        bf16 = tc.precision == "bf16"
        # megatron shards only Adam state (over DP; expert parameters' over the expert-DP group). Opt-in: a
        # checkpoint's optimizer state loads only into the same format (checkpoint.py refuses the other)
        self.dist_opt = self.dp > 1 and tc.optimizer == "adam" and tc.distributed_optimizer
        # the KL reference and the critic must compute exactly as the policy does: one set of build settings
        self.arch = dict(
            tp=tc.tp,
            pp=tc.pp,
            cp=tc.cp,
            sequence_parallel=tc.sequence_parallel,
            bf16=bf16,
            layer_spec=tc.layer_spec,
            attention=tc.attention,
            output_hidden=True,  # the LM head runs fused with the logprob (lm_head.head_logprobs)
            moe_aux_loss_coef=tc.moe_aux_loss_coef,
            moe_experts=tc.moe_experts,
        )
        self.policy = build_policy(
            model_path,
            **self.arch,
            recompute=tc.megatron_recompute(),
            distributed_optimizer=self.dist_opt,
            lora=tc.lora,
            seed=run.seed,
        )
        self.hf_config = self.policy.hf_config
        self.replay = None  # trainer.routing_replay: the policy's routers take the engine's experts
        if tc.routing_replay:
            if self.policy.router_stats is None:
                raise ValueError(
                    f"trainer.routing_replay is on but {self.hf_config.model_type} has no experts to "
                    "replay; turn it off for a dense model"
                )
            self.replay = RoutingReplay(unwrap(self.policy.model), self.hf_config)
        self.ref = None
        # a KL term's frozen reference model; a served teacher's logprobs come with the samples instead
        self.has_reference = (tc.loss.kl_coef > 0 or tc.loss.kl_in_reward_coef > 0) and not tc.distill.server
        # the KL's frozen reference: trainer.ref_load, else the initial policy; with LoRA and no ref_load
        # the policy itself with its adapters off (no copy)
        if self.has_reference and (self.policy.lora is None or tc.ref_load):
            self.ref = build_policy(tc.ref_load or model_path, **self.arch, ddp=False)
            check_reference(self.ref.hf_config, self.hf_config, tc.ref_load)
            unwrap(self.ref.model).eval().requires_grad_(False)
        self.opt_cfg = OptimizerConfig(
            optimizer=tc.optimizer,
            lr=tc.lr,
            min_lr=tc.min_lr,
            weight_decay=tc.weight_decay,
            adam_beta1=tc.adam_beta1,
            adam_beta2=tc.adam_beta2,
            clip_grad=tc.grad_clip,
            bf16=bf16,
            params_dtype=torch.float32,
            use_distributed_optimizer=self.dist_opt,
        )
        self.optimizer = build_optimizer(self.opt_cfg, self.policy.model)
        if self.device.type == "cuda":
            use_fused_adam(self.optimizer)

    # -- the schedule ------------------------------------------------------------------------------
    def run_schedule(self, model: Any, mbs: list[MicroBatch], loss_fn, forward_only: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        tc, layout = self.tc, self.policy.layout
        extra = {"fp32_output": False} if tc.precision == "bf16" else {}  # hidden stays bf16
        # only the policy's routers replay: the reference model and the critic route themselves
        replay = self.replay if model is self.policy.model else None
        # megatron scatters padding_mask for sequence parallelism on the first pipeline stage only
        moe_padding = self.policy.router_stats is not None and not (tc.pp > 1 and tc.sequence_parallel)

        def forward_step(it, m):
            mb = next(it)
            tokens = mb.tokens.to(self.device)
            if self.cp > 1:  # this rank's positions of the row (RoPE takes them from megatron's CP split)
                pos = local_positions(mb.segments.shape[1], self.cp, self.cp_rank, self.device)
            else:
                pos = torch.arange(tokens.shape[1], device=self.device)
            pos = pos[None].expand_as(tokens)
            kw = dict(extra)
            if replay is not None:
                sp = tc.sequence_parallel
                routed = None if mb.routed is None else mb.routed.to(self.device)  # once, not per layer
                replay.set_microbatch(routed, ps.get_tensor_model_parallel_rank(), tc.tp if sp else 1)
            if moe_padding:  # MoE: padding positions left out of router metrics and load-balancing loss
                kw["padding_mask"] = mb.segments.to(self.device).gather(1, pos) < 0
            if layout in ("varlen", "te"):  # one packed row; sequence boundaries as cu_seqlens, no mask
                out = m(tokens, pos, None, packed_seq_params=packed_row_params(mb, layout, self.device), **kw)
            else:  # explicit block-diagonal mask (W3, and it keeps packed sequences apart)
                out = m(tokens, pos, causal_block_mask(mb.segments.to(self.device)), **kw)
            return out, lambda hidden: loss_fn(mb, hidden)

        try:
            with cpu_shim.device_mode():
                return get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(mbs),
                    model=[model],
                    num_microbatches=len(mbs),
                    seq_length=mbs[0].segments.shape[1],  # the whole row: megatron divides by cp and SP's tp
                    micro_batch_size=mbs[0].tokens.shape[0],
                    forward_only=forward_only,
                )
        finally:
            if replay is not None:  # no later forward (an export check, an eval) replays stale targets
                replay.set_microbatch(None)

    def grads_finite(self, acc: dict, model: Any) -> bool:
        """The step's loss and every gradient of `model` are finite, agreed by all ranks (TP/PP ranks
        hold different gradient shards; DP replicas hold the same reduced ones)."""
        bad = torch.zeros((), device=self.device)
        if "sum/loss_num" in acc:
            bad += (~torch.isfinite(acc["sum/loss_num"].to(self.device))).float()
        buffers = model.buffers if isinstance(getattr(model, "buffers", None), list) else []
        for buf in buffers + list(getattr(model, "expert_parallel_buffers", [])):
            # the sum is NaN/inf exactly when an element is (fp32 gradients never add up to 3e38); unlike
            # isfinite over the buffer, which builds a buffer-sized abs() temporary: 14 GiB per rank for
            # a 7B model at TP=2, the allocation that ran the 7B pipeline out of memory (bench/RESULTS.md)
            bad += (~torch.isfinite(buf.grad_data.sum())).float()
        if dist.get_world_size() > 1:
            dist.all_reduce(bad)
        return bool(bad.item() == 0)

    def _mb_logprobs(self, model: Any, mb: MicroBatch, hidden, entropy=False, entropy_grad=False):
        """hidden [b, s, h] of a micro-batch -> logprob (and entropy) of its response tokens [t]."""
        if self.tc.sequence_parallel:  # [b, s/tp, h] -> [b, s, h]; the head all-reduces the gradient
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden.transpose(0, 1), tensor_parallel_output_grad=False
            ).transpose(0, 1)
        pick = mb.resp_pos.to(hidden.device)
        return head_logprobs(
            hidden.reshape(-1, hidden.shape[-1])[pick],
            head_weight(model),
            mb.targets.reshape(-1).to(hidden.device)[pick],
            temperature=self.run.temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            chunk=self.tc.logits_chunk_tokens,
            fp32_logits=self.run.fp32_lm_head,
            vocab_size=self.hf_config.vocab_size,
        )

    @torch.no_grad()
    def logprobs(self, tb: TokenBatch, mbs: list[MicroBatch], *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs of the policy (or the reference) for this rank's micro-batches (filled on
        the last PP stage), on the trainer's device."""
        base_only = reference and self.ref is None  # LoRA: the reference is the base, adapters off
        model = self.ref.model if reference and not base_only else self.policy.model
        out = torch.zeros(len(tb.rollout_logprobs), dtype=torch.float32, device=self.device)
        model.eval()

        def loss_fn(mb, hidden):
            if mb.num_tokens == 0:  # an empty micro-batch (moe.equalize_microbatches)
                return hidden.new_zeros(()), torch.tensor(1, dtype=torch.int), {}
            lp, _ = self._mb_logprobs(model, mb, hidden)
            out[mb.tok_index.to(self.device)] = lp.float()
            return hidden.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        with self.policy.lora.disabled() if base_only else contextlib.nullcontext():
            self.run_schedule(model, mbs, loss_fn, forward_only=True)
        model.train()
        return self._cp_whole(out)

    def _cp_whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values [T] each CP rank filled at its own tokens (zeros elsewhere) -> all of them."""
        if self.cp > 1:
            dist.all_reduce(per_token, group=self.cp_group)
        return per_token

    def batch_whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values [T] this rank filled for its DP shard (on the last PP stage; whole sequences
        on every CP rank after _cp_whole) -> the whole batch's, on every rank, on the CPU: one all-reduce
        to which exactly one rank contributes each token."""
        from megatron.core import parallel_state as ps

        x = per_token.detach().clone()
        if dist.get_world_size() > 1:
            own = (
                ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and self.cp_rank == 0
            )
            if not own:
                x.zero_()
            dist.all_reduce(x)
        return x.cpu()

    def check_batch(self, tb: TokenBatch) -> None:
        if self.replay is not None:
            self.replay.check_batch(tb)

    def pack(self, tb: TokenBatch, samples: list[int]) -> list[MicroBatch]:
        """`samples` of the batch in micro-batches of trainer.micro_batch_tokens (one packed row each
        on the varlen / TE layouts). Under context parallelism each is this rank's part of it."""
        split = 2 * self.cp * (self.tc.tp if self.tc.sequence_parallel else 1)  # rows cut in equal parts
        align = math.lcm(ROW_ALIGN, split)
        mbs = pack(
            tb,
            samples,
            self.tc.micro_batch_tokens,
            packed_row=self.policy.layout in ("varlen", "te"),
            align=align,
            routed_shape=self.replay.shape if self.replay is not None else None,
        )
        # expert parallelism: every DP rank runs as many micro-batches as the others (collective)
        mbs = moe.equalize_microbatches(mbs, align)
        return [local_view(mb, self.cp, self.cp_rank) for mb in mbs] if self.cp > 1 else mbs

    # -- the update --------------------------------------------------------------------------------
    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

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
        """Forward/backward over the micro-batches and one optimizer step (`adv`: per token [T]).
        Returns the statistics and logp_old ([T], this rank's tokens; taken from the training forward
        when `old` is None)."""
        from megatron.core import parallel_state as ps

        lc = self.tc.loss
        first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        loss = StepLoss(
            tb,
            adv,
            old,
            ref,
            self.tc,
            self.device,
            count_unpacked=count_unpacked,
            first_rank=first,
            cp_group=self.cp_group,
        )

        def loss_fn(mb: MicroBatch, hidden):
            if mb.num_tokens == 0:  # an empty micro-batch (moe.equalize_microbatches): no loss, but
                # its backward must run, through the MoE all-to-alls the other EP ranks take part in
                return hidden.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
            logp, ent = self._mb_logprobs(
                self.policy.model, mb, hidden, entropy=True, entropy_grad=lc.entropy_coef > 0
            )
            num, den = loss(mb, logp, ent)
            return num, den.round().int(), {}

        self.policy.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._set_lr(lr)
        self.run_schedule(self.policy.model, mbs, loss_fn, forward_only=False)
        if self.grads_finite(loss.stats, self.policy.model):
            with cpu_shim.device_mode():
                ok, grad_norm, _ = self.optimizer.step()
        else:
            refuse_nonfinite(self.tc, version)
            ok, grad_norm = False, float("nan")
        stats = step_stats(loss.stats, applied=ok, grad_norm=grad_norm, lr=lr)
        return stats, (self._cp_whole(loss.old) if loss.from_train else loss.old).cpu()

    # -- figures -----------------------------------------------------------------------------------
    def reduce_stats(self, stats: dict, keys: tuple[str, ...]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        # only the last stage computes the loss; its TP ranks hold identical copies, so count one
        contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        red = {}
        for op, neutral in (("sum", 0.0), ("min", math.inf), ("max", -math.inf)):
            names = [k for k in keys if k.startswith(op + "/")]
            v = torch.tensor(
                [float(stats.get(k, neutral)) if contributes else neutral for k in names],
                dtype=torch.float64,
                device=self.device,
            )
            if dist.get_world_size() > 1:
                dist.all_reduce(
                    v, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
                )
            red.update(zip(names, v.tolist()))
        # grad norms / lr were summed over the DP and CP ranks of the last stage
        dp_div = max(1, self.dp * self.cp)
        for k in ("sum/grad_norm", "sum/lr", "sum/critic_grad_norm"):
            if k in red:
                red[k] /= dp_div
        return red

    def model_metrics(self) -> dict:
        out = {}
        if self.policy.router_stats is not None:  # MoE: tokens per expert etc. (collective)
            out.update(self.policy.router_stats.metrics())
        if self.replay is not None:
            out.update(self.replay.metrics())
        return out

    def active_params(self) -> int:
        """The whole model's parameters a token uses, from this rank's shards: dense ones are split over
        TP and PP; experts over EP and expert-TP within a PP stage (replicated norms counted tp times: a
        rounding error)."""
        from megatron.core import parallel_state as ps

        dense = experts = 0
        for name, p in unwrap(self.policy.model).named_parameters():
            if ".experts." in name:
                experts += p.numel()
            else:
                dense += p.numel()
        pp = ps.get_pipeline_model_parallel_world_size()
        total = dense * ps.get_tensor_model_parallel_world_size() * pp
        if experts:
            hc = self.hf_config
            ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
            total += experts * ep * etp * pp * hc.num_experts_per_tok // moe.num_experts(hc)
        return total

    # -- weights out, state in and out ---------------------------------------------------------------
    def weight_export(self) -> PolicyExport:
        return PolicyExport(self.policy)

    def save_hf(self, out_dir: str) -> str | None:
        """The merged model as a save_pretrained folder; with LoRA also the adapters alone as a PEFT
        folder in its `adapter/` (a sub-folder: transformers would take an adapter_config.json beside
        config.json for an adapter to load onto the base)."""
        state = export_hf_state(self.policy)
        if self.policy.lora is not None:
            save_peft(self.policy.lora, os.path.join(out_dir, "adapter"), self.policy.model_path, state)
        if self.rank != 0:
            return None
        return save_hf(state, self.policy.model_path, out_dir)

    def checkpoint_part(self) -> MegatronPart:
        # with LoRA the checkpoint holds the adapters and their optimizer state (the base is the model folder)
        lora = self.policy.lora
        return MegatronPart(self.policy.model, self.optimizer, keep=lora.trains if lora is not None else None)

    def nonfinite_param(self) -> str | None:
        for name, p in unwrap(self.policy.model).named_parameters():
            if not torch.isfinite(p.detach()).all():
                return name
        return None

    def build_critic(self) -> critic.Critic:
        """The value model: the policy's build settings and parallelism, its own optimizer."""
        built = critic.build_critic(
            self.model_path, self.arch, self.opt_cfg, self.tc, self.device, runner=self
        )
        if self.device.type == "cuda":
            use_fused_adam(built.optimizer)
        return built
