"""The megatron-core RL trainer: one `step()` = fetch complete groups -> old logprobs -> loss ->
optimizer step -> version + 1 -> announce -> (maybe) push weights / checkpoint.

API (what the pipeline launcher uses, also from inside a Ray actor):
    trainer = Trainer(cfg, source, model_path, run_dir)  # source only needed on rank 0
    trainer.attach_sender(sender)                          # optional WeightSender (rank 0)
    metrics = trainer.step()                               # one optimizer step; dict of floats
    trainer.version                                        # policy version = optimizer steps taken
    trainer.close()                                        # waits for the last push, saves a checkpoint

All ranks call step() together; rank 0 fetches and broadcasts the batch. torch.distributed is
initialised on demand (gloo world of 1 on a free port when not under torchrun).
"""

from __future__ import annotations

import io
import logging
import math
import time

import pyarrow as pa
import torch
import torch.distributed as dist

from pipeline.config import RunConfig
from stages.trainer import advantages, checkpoint, cpu_shim, critic, losses, moe
from stages.trainer.config import check_critic_layout
from stages.trainer.context_parallel import cp_info, local_positions, local_view
from stages.trainer.lm_head import head_logprobs
from stages.trainer.model import (
    build_policy,
    causal_block_mask,
    head_weight,
    init_distributed,
    packed_row_params,
    unwrap,
)
from stages.trainer.optimizer import build_optimizer, use_fused_adam
from stages.trainer.packing import ROW_ALIGN, MicroBatch, TokenBatch, pack, shard_samples, to_token_batch
from stages.trainer.routing_replay import RoutingReplay

log = logging.getLogger(__name__)
# with a weight sender, the trainer's wait for data is cut into slices of this many seconds, and
# between them the last weights go to it again (Trainer._fetch_catching_up)
CATCH_UP_EVERY_S = 10.0
_PUSH_AGAIN = object()  # _fetch_catching_up: an engine needs the current weights before data can come


class SourceExhausted(Exception):
    """A finite source (a replay directory) has no more complete groups: the run ends normally."""


class Trainer:
    def __init__(self, cfg: RunConfig, source, model_path: str, run_dir: str, *, sender=None):
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig

        self.cfg, self.tc = cfg, cfg.trainer
        self.source, self.sender, self.run_dir = source, sender, str(run_dir)
        self.tc.loss.validate()  # again: fields may have been set after the config was built
        check_critic_layout(self.tc)
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        init_distributed(
            self.tc.tp,
            self.tc.pp,
            seed=cfg.run.seed,
            cp=self.tc.cp,
            ep=self.tc.ep,
            etp=self.tc.etp or self.tc.tp,
        )
        self.rank = dist.get_rank()
        self.cp_group, self.cp, self.cp_rank = cp_info()
        self.dp = ps.get_data_parallel_world_size()
        if self.tc.dp not in (1, self.dp):
            raise ValueError(
                f"trainer.dp={self.tc.dp} but the world gives dp={self.dp} (= world / (tp*pp*cp))"
            )
        if self.rank == 0 and source is None:
            raise ValueError(
                "Trainer on rank 0 needs a BatchSource (buffer client, in-process buffer or replay)"
            )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        bf16 = self.tc.precision == "bf16"
        # megatron shards only Adam state; opt-in because resuming it fails in megatron-core 0.16
        self.dist_opt = self.dp > 1 and self.tc.optimizer == "adam" and self.tc.distributed_optimizer
        # the KL reference below must compute exactly as the policy does: one set of build settings
        arch = dict(
            tp=self.tc.tp,
            pp=self.tc.pp,
            cp=self.tc.cp,
            sequence_parallel=self.tc.sequence_parallel,
            bf16=bf16,
            layer_spec=self.tc.layer_spec,
            attention=self.tc.attention,
            output_hidden=True,  # the LM head runs fused with the logprob (lm_head.head_logprobs)
            moe_aux_loss_coef=self.tc.moe_aux_loss_coef,
        )
        self.policy = build_policy(
            model_path, **arch, recompute=self.tc.recompute, distributed_optimizer=self.dist_opt
        )
        self.replay = None  # trainer.routing_replay: the policy's routers take the engine's experts
        if self.tc.routing_replay:
            if self.policy.router_stats is None:
                raise ValueError(
                    f"trainer.routing_replay is on but {self.policy.hf_config.model_type} has no experts to "
                    "replay; turn it off for a dense model"
                )
            self.replay = RoutingReplay(unwrap(self.policy.model), self.policy.hf_config)
        self.ref = None
        if self.tc.loss.kl_coef > 0 or self.tc.loss.kl_in_reward_coef > 0:  # frozen initial policy for the KL
            self.ref = build_policy(model_path, **arch, ddp=False)
            unwrap(self.ref.model).eval().requires_grad_(False)
        opt_cfg = OptimizerConfig(
            optimizer=self.tc.optimizer,
            lr=self.tc.lr,
            min_lr=self.tc.min_lr,
            weight_decay=self.tc.weight_decay,
            adam_beta1=self.tc.adam_beta1,
            adam_beta2=self.tc.adam_beta2,
            clip_grad=self.tc.grad_clip,
            bf16=bf16,
            params_dtype=torch.float32,
            use_distributed_optimizer=self.dist_opt,
        )
        self.optimizer = build_optimizer(opt_cfg, self.policy.model)
        self.critic = None
        if self.tc.loss.advantage == "ppo":  # the value model, same build settings and parallelism
            self.critic = critic.build_critic(model_path, arch, opt_cfg, self.tc, self.device)
        if self.device.type == "cuda":
            use_fused_adam(self.optimizer)
            if self.critic is not None:
                use_fused_adam(self.critic.optimizer)
        self.temperature = cfg.rollout.sampling.temperature
        self.version = 0
        self.skipped_steps = 0  # optimizer steps not applied (non-finite loss or gradients)
        self.pending_push = None
        self._host_snapshot = None  # pinned host copy of the weights (weights.snapshot=cpu on a GPU)
        self._direct_result = None  # the last direct push's figures, until wait_push() takes them
        self._pushes_direct: bool | None = None  # decided at the first push (_goes_direct)
        self._checkpointed_at = time.monotonic()  # trainer.checkpoint_every_s counts from here
        self._params: int | None = None  # the whole model's parameters (perf/tflops)
        self.last_checkpoint = -1
        if self.tc.resume:
            state = checkpoint.load_latest(self)
            if state:
                self.version = int(state["version"])
                self.last_checkpoint = self.version
        if self.rank == 0:
            self.source.set_version(self.version)

    # -- data --------------------------------------------------------------------------------------
    def attach_sender(self, sender) -> None:
        self.sender = sender

    def _fetch(self) -> pa.RecordBatch:
        """Rank 0 fetches within trainer.fetch_timeout_s; every rank gets the batch (broadcast), or rank
        0's error (the other ranks would otherwise wait in the broadcast). An engine found running older
        weights than the last push (relaunched since: needs_push) gets the current weights first: every
        rank takes part in that snapshot, then the wait goes on."""
        shared = dist.get_world_size() > 1  # other ranks need the batch: send it as Arrow IPC bytes
        deadline = time.monotonic() + self.tc.fetch_timeout_s
        while True:
            payload, failure = [None], None
            if self.rank == 0:
                try:
                    batch = self._fetch_catching_up(deadline)
                    if batch is _PUSH_AGAIN:
                        payload[0] = ("push", None)
                    elif batch is None:
                        payload[0] = ("timeout", None)
                    else:
                        payload[0] = ("ok", _to_ipc(batch) if shared else batch)
                except SourceExhausted:
                    payload[0] = ("exhausted", None)
                except Exception as e:
                    if not shared:
                        raise
                    payload[0], failure = ("error", f"{type(e).__name__}: {e}"), e
            if shared:
                dist.broadcast_object_list(
                    payload, src=0, device=self.device if self.device.type == "cuda" else None
                )
            kind, data = payload[0]
            if kind == "push":
                self.push_weights()
                continue
            if kind == "error":
                if failure is not None:
                    raise failure
                raise RuntimeError(f"trainer rank 0 failed while fetching a batch: {data}")
            if kind == "exhausted":
                raise SourceExhausted("the replay source has no more complete groups")
            if kind == "timeout":
                raise TimeoutError(self._fetch_timeout_message())
            return pa.ipc.open_stream(data).read_next_batch() if shared else data

    def _fetch_catching_up(self, deadline: float):
        """source.fetch until `deadline`; None at the deadline, or _PUSH_AGAIN when an engine needs the
        current weights. With a weight sender the wait is cut into CATCH_UP_EVERY_S slices: before each
        the sender may push the last weights again to an engine it left out while it restarted
        (catch_up), and after a slice that came back empty it is asked for an engine relaunched since
        the last push (needs_push; not before, so a step with data waiting pays nothing for it). With
        one engine no fresh batch can come before the relaunched server has the current weights."""
        waited = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            if self.sender is None:
                return self.source.fetch(self.tc.batch_groups, self.version, self.cfg.run.max_staleness, left)
            idle = self._catch_up()
            if waited and idle:
                stale = self.sender.needs_push()
                if stale:
                    log.warning(
                        "trainer at version %d: %s run older weights (relaunched since the last push) or "
                        "partly loaded ones (another server died mid-push): pushing them the current ones",
                        self.version,
                        stale,
                    )
                    return _PUSH_AGAIN
            wait = min(left, CATCH_UP_EVERY_S)
            t0 = time.monotonic()
            batch = self.source.fetch(self.tc.batch_groups, self.version, self.cfg.run.max_staleness, wait)
            # a source answers None only at its timeout, or at once when it has no more (a replay)
            if batch is not None or time.monotonic() >= deadline or time.monotonic() - t0 < 0.5 * wait:
                return batch
            waited = True

    def _catch_up(self) -> bool:
        """Start a catch-up push if an engine is behind and no push is in flight (one in flight may
        reach the lagging server: it is asked again after the next slice). True when no push is in
        flight, then or now."""
        if self.pending_push is not None and not self.pending_push.done():
            return False
        handle = self.sender.catch_up()
        if handle is None:
            return True
        if self.pending_push is not None:
            self.pending_push.result()  # a failure of the previous push is raised here, not lost
        self.pending_push = handle  # push_weights waits for it before the next snapshot
        return False

    def _fetch_timeout_message(self) -> str:
        where = getattr(self.source, "address", None) or type(self.source).__name__
        try:
            stats = self.source.stats() if self.rank == 0 else {}
        except Exception as e:  # noqa: BLE001 - only used to enrich the message
            stats = {"stats unavailable": str(e)}
        return (
            f"trainer at version {self.version}: no {self.tc.batch_groups} complete groups from the buffer at "
            f"{where} within trainer.fetch_timeout_s={self.tc.fetch_timeout_s:g}s. Check that the buffer is "
            f"running at that address, that generators are connected and producing, and that "
            f"run.max_staleness={self.cfg.run.max_staleness} is not dropping everything. Buffer stats: {stats}"
        )

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> dict:
        """Fetch one batch and train on it. Raises TimeoutError / WeightPushError / SourceExhausted."""
        t0 = time.perf_counter()
        batch = self._fetch()
        wait = time.perf_counter() - t0
        metrics = self.train_on_batch(batch)
        metrics["time/data_wait_s"] = wait
        metrics["time/step_s"] = time.perf_counter() - t0
        self.after_step(metrics)
        return metrics

    def train_on_batch(self, batch: pa.RecordBatch) -> dict:
        """Optimizer step on one batch of complete groups; version += 1. Collective over all ranks."""
        from megatron.core import parallel_state as ps

        t0 = time.perf_counter()
        tb = to_token_batch(batch)
        if len(tb.response_ids) == 0:
            statuses = sorted(set(batch.column("status").to_pylist()))
            raise ValueError(
                f"batch of {tb.n} samples has no response tokens at all (statuses: {statuses}; first uids: "
                f"{batch.column('uid').to_pylist()[:3]}): nothing to train on; check the engine's "
                "max_new_tokens and why generation ended at once"
            )
        if self.replay is not None:
            self.replay.check_batch(tb)
        shard = shard_samples(tb, self.dp)[ps.get_data_parallel_rank()]
        mbs = self._pack(tb, shard)
        # logp_old = the current weights' logprobs, before the update. With one optimizer step per batch
        # the training forward computes exactly these (same weights, no dropout), so by default they
        # are taken from it (detached) instead of from a second forward over the batch
        updates = self.tc.ppo_epochs * self.tc.mini_batches
        # several updates need logp_old of the weights before the first, and the KL in the reward needs it
        # before the advantage: only a separate pass has it then
        separate = (
            self.tc.old_logprobs == "separate_pass" or updates > 1 or self.tc.loss.kl_in_reward_coef > 0
        )
        old = self._logprobs(self.policy.model, tb, mbs) if separate else None
        ref = self._logprobs(self.ref.model, tb, mbs) if self.ref is not None else None
        adv, value_batch = self._advantages(tb, mbs, old, ref)
        if updates == 1:
            stats, old = self._train(tb, mbs, adv, old, ref)
            if value_batch is not None:
                _accumulate(stats, critic.update(self, tb, mbs, *value_batch, count_unpacked=True))
        else:
            stats, old = self._train_updates(tb, shard, adv, old, ref, value_batch), old.cpu()
        stats.update(_engine_mismatch(tb, old, shard, self.version))
        self.version += 1
        metrics = self._finish_metrics(tb, adv, stats)
        if self.policy.router_stats is not None:  # MoE: tokens per expert etc. (collective)
            metrics.update(self.policy.router_stats.metrics())
        if self.replay is not None:
            metrics.update(self.replay.metrics())
        if value_batch is not None:  # the critic's values of this batch before its update
            on = (tb.mask > 0) & tb.trainable[tb.seq]
            metrics["critic/value_mean"] = float(value_batch[0][on].mean()) if on.any() else 0.0
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics.update(self._perf(metrics["tokens/total"], metrics["time/train_s"], separate))
        return metrics

    def _advantages(self, tb: TokenBatch, mbs, old, ref):
        """Per-token advantages [T] of the whole batch, the same on every rank, and for ppo the critic's
        (values, returns) [T]. The statistics (whitening, group means) are over the whole batch, so the
        per-token inputs computed per shard (logp_old, logp_ref, values) are gathered first."""
        lc = self.tc.loss
        kl = None
        if lc.kl_in_reward_coef:  # k1 per token, as the REINFORCE++ paper and slime put it into the reward
            kl = losses.kl_penalty(self._batch_whole(old), self._batch_whole(ref), "k1")
        groups = advantages.group_ids_to_index(tb.group_ids)
        if self.critic is None:
            adv = advantages.token_advantages(
                tb.rewards, groups, tb.seq, tb.mask, lc, valid=tb.trainable, kl=kl
            )
            return adv, None
        values = self._batch_whole(critic.values(self, tb, mbs))
        adv, returns = advantages.ppo_advantages(
            tb.rewards, tb.seq, tb.mask, values, lc, valid=tb.trainable, kl=kl
        )
        return adv, (values, returns)

    def _batch_whole(self, per_token: torch.Tensor) -> torch.Tensor:
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

    def _perf(self, tokens: float, seconds: float, separate_pass: bool) -> dict:
        """Model TFLOP/s per GPU (or process) in the 6 x params x tokens convention (fwd + bwd; 8 x with
        the separate logp_old pass), as slime's perf/actor_train_tflops; MFU against trainer.peak_tflops
        when it is given (the card's measured bf16 peak: bench/trainer_gpu.py prints it). For MoE models
        the parameters are the active ones: all but the experts, plus top_k / num_experts of those."""
        if self._params is None:
            self._params = self._active_params()
        flops = (8 if separate_pass else 6) * self._params * tokens
        tflops = flops / max(seconds, 1e-9) / dist.get_world_size() / 1e12
        out = {"perf/tflops": tflops}
        if self.tc.peak_tflops:
            out["perf/mfu"] = tflops / self.tc.peak_tflops
        return out

    def _active_params(self) -> int:
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
            hc = self.policy.hf_config
            ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
            total += experts * ep * etp * pp * hc.num_experts_per_tok // hc.num_experts
        return total

    def _set_lr(self) -> float:
        lr = self._lr_now()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _lr_now(self) -> float:
        """The policy's learning rate at this version (warmup, then constant or cosine)."""
        s, tc = self.version, self.tc
        if tc.warmup_steps and s < tc.warmup_steps:
            lr = tc.lr * (s + 1) / tc.warmup_steps
        elif tc.lr_schedule == "constant":
            lr = tc.lr
        else:  # cosine from lr to min_lr over the run
            frac = min(1.0, (s - tc.warmup_steps) / max(1, self.cfg.run.steps - tc.warmup_steps))
            lr = tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * frac))
        return lr

    def _run_schedule(self, model, mbs, loss_fn, forward_only: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        layout = self.policy.layout
        extra = {"fp32_output": False} if self.tc.precision == "bf16" else {}  # hidden stays bf16
        # only the policy's routers replay: the reference model and the critic route themselves
        replay = self.replay if model is self.policy.model else None
        # megatron scatters padding_mask for sequence parallelism on the first pipeline stage only
        moe_padding = self.policy.router_stats is not None and not (
            self.tc.pp > 1 and self.tc.sequence_parallel
        )

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
                sp = self.tc.sequence_parallel
                routed = None if mb.routed is None else mb.routed.to(self.device)  # once, not per layer
                replay.set_microbatch(routed, ps.get_tensor_model_parallel_rank(), self.tc.tp if sp else 1)
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

    def _mb_logprobs(self, model, mb: MicroBatch, hidden, entropy=False, entropy_grad=False):
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
            temperature=self.temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            chunk=self.tc.logits_chunk_tokens,
            fp32_logits=self.cfg.model.fp32_lm_head,
            vocab_size=self.policy.hf_config.vocab_size,
        )

    @torch.no_grad()
    def _logprobs(self, model, tb: TokenBatch, mbs) -> torch.Tensor:
        """Per-token logprobs of `model` for this rank's micro-batches (filled on the last PP stage),
        on the trainer's device."""
        out = torch.zeros(len(tb.rollout_logprobs), dtype=torch.float32, device=self.device)
        model.eval()

        def loss_fn(mb, hidden):
            if mb.num_tokens == 0:  # an empty micro-batch (moe.equalize_microbatches)
                return hidden.new_zeros(()), torch.tensor(1, dtype=torch.int), {}
            lp, _ = self._mb_logprobs(model, mb, hidden)
            out[mb.tok_index.to(self.device)] = lp.float()
            return hidden.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        self._run_schedule(model, mbs, loss_fn, forward_only=True)
        model.train()
        return self._cp_whole(out)

    def _cp_whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values [T] each CP rank filled at its own tokens (zeros elsewhere) -> all of them."""
        if self.cp > 1:
            dist.all_reduce(per_token, group=self.cp_group)
        return per_token

    def _pack(self, tb: TokenBatch, samples: list[int]) -> list:
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

    def _train_updates(self, tb: TokenBatch, shard: list[int], adv, old, ref, value_batch=None) -> dict:
        """trainer.ppo_epochs x trainer.mini_batches optimizer updates on one batch (each followed by the
        critic's on the same mini-batch, with `value_batch` = (old values, returns)). Statistics are
        summed over the updates (token means stay means; tokens/trained counts each update's tokens);
        grad norms and lr are their means."""
        m = self.tc.mini_batches
        if len(shard) < m:
            raise ValueError(
                f"trainer.mini_batches={m} but this rank has {len(shard)} samples of the batch; lower "
                "trainer.mini_batches or raise trainer.batch_groups"
            )
        parts = [shard[i * len(shard) // m : (i + 1) * len(shard) // m] for i in range(m)]
        packed = [self._pack(tb, p) for p in parts]
        acc: dict = {}
        for epoch in range(self.tc.ppo_epochs):
            for i, mbs in enumerate(packed):
                first = epoch == 0 and i == 0
                st, _ = self._train(tb, mbs, adv, old, ref, count_unpacked=first)
                _accumulate(acc, st)
                if value_batch is not None:
                    _accumulate(acc, critic.update(self, tb, mbs, *value_batch, count_unpacked=first))
        n = self.tc.ppo_epochs * m
        for k in ("sum/grad_norm", "sum/lr", "sum/critic_grad_norm"):
            if k in acc:
                acc[k] = acc[k] / n
        return acc

    def _train(
        self, tb: TokenBatch, mbs, adv, old, ref, count_unpacked: bool = True
    ) -> tuple[dict, torch.Tensor]:
        """Forward/backward over the micro-batches and one optimizer step (`adv`: per token [T]).
        Returns the statistics and logp_old ([T], this rank's tokens; taken from the training forward
        when `old` is None)."""
        from megatron.core import parallel_state as ps

        lc = self.tc.loss
        acc: dict[str, torch.Tensor] = {}
        dev = self.device
        # token tensors go to the device once per step, not once per micro-batch
        rollout, mask, seq = (x.to(dev) for x in (tb.rollout_logprobs, tb.mask, tb.seq))
        adv_tok = adv.to(dev)
        # sample-mean over every sample of the step (sample_mean_denominator=all, slime): samples without
        # response tokens are in no micro-batch, so DP rank 0's first micro-batch counts them
        unpacked = [0]
        if count_unpacked and losses.aggregation_mode(lc) == "sample" and lc.sample_mean_denominator == "all":
            if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
                unpacked[0] = int((torch.bincount(tb.seq, minlength=tb.n) == 0).sum())
        from_train = old is None
        if from_train:
            old = torch.zeros_like(rollout)

        def loss_fn(mb: MicroBatch, hidden):
            if mb.num_tokens == 0:  # an empty micro-batch (moe.equalize_microbatches): no loss, but
                # its backward must run, through the MoE all-to-alls the other EP ranks take part in
                return hidden.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
            logp, ent = self._mb_logprobs(
                self.policy.model, mb, hidden, entropy=True, entropy_grad=lc.entropy_coef > 0
            )
            ix = mb.tok_index.to(dev)
            if from_train:
                old[ix] = logp.detach()
            num, den, st = losses.policy_loss(
                logp,
                old[ix],
                rollout[ix],
                adv_tok[ix],
                mask[ix],
                seq[ix],
                tb.n,
                lc,
                logp_ref=ref[ix] if ref is not None else None,
                entropy=ent,
                cp_group=self.cp_group,
            )
            if unpacked[0]:
                den = den + unpacked[0]
                st["sum/loss_den"] = st["sum/loss_den"] + unpacked[0]
                unpacked[0] = 0
            _accumulate(acc, st)
            return num, den.round().int(), {}

        self.policy.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._set_lr()
        self._run_schedule(self.policy.model, mbs, loss_fn, forward_only=False)
        if self._loss_and_grads_finite(acc):
            with cpu_shim.device_mode():
                ok, grad_norm, _ = self.optimizer.step()
        else:  # one NaN reward or logprob would otherwise turn every weight into NaN, for good
            if self.tc.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"trainer at version {self.version}: the loss or a gradient is not finite (NaN/inf); "
                    "nothing was applied. Check the batch's rewards and logprobs, or set "
                    "trainer.on_nonfinite=skip to skip such steps"
                )
            ok, grad_norm = False, float("nan")
        if not ok:
            self.skipped_steps += 1
            log.warning(
                "optimizer step skipped at version %d (non-finite loss or gradients); %d skipped so far",
                self.version,
                self.skipped_steps,
            )
        acc = {k: v.cpu() for k, v in acc.items()}  # one transfer per step, after the GPU work
        acc["sum/skipped"] = torch.tensor(float(not ok))
        acc["sum/grad_norm"] = torch.tensor(float(0.0 if grad_norm is None else grad_norm))
        acc["sum/lr"] = torch.tensor(lr)
        return acc, (self._cp_whole(old) if from_train else old).cpu()

    def _loss_and_grads_finite(self, acc: dict, model=None) -> bool:
        """The step's loss and every gradient of `model` (the policy's by default) are finite, agreed by
        all ranks (TP/PP ranks hold different gradient shards; DP replicas hold the same reduced ones)."""
        bad = torch.zeros((), device=self.device)
        if "sum/loss_num" in acc:
            bad += (~torch.isfinite(acc["sum/loss_num"].to(self.device))).float()
        model = self.policy.model if model is None else model
        buffers = model.buffers if isinstance(getattr(model, "buffers", None), list) else []
        for buf in buffers + list(getattr(model, "expert_parallel_buffers", [])):
            # the sum is NaN/inf exactly when an element is (fp32 gradients never add up to 3e38); unlike
            # isfinite over the buffer, which builds a buffer-sized abs() temporary: 14 GiB per rank for
            # a 7B model at TP=2, the allocation that ran the 7B pipeline out of memory (bench/RESULTS.md)
            bad += (~torch.isfinite(buf.grad_data.sum())).float()
        if dist.get_world_size() > 1:
            dist.all_reduce(bad)
        return bool(bad.item() == 0)

    def _finish_metrics(self, tb: TokenBatch, adv, stats) -> dict:
        """Reduce statistics over micro-batches and ranks into one flat dict (same on every rank)."""
        from megatron.core import parallel_state as ps

        # only the last stage computes the loss; its TP ranks hold identical copies, so count one
        contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        red = {}
        for op, neutral in (("sum", 0.0), ("min", math.inf), ("max", -math.inf)):
            keys = [k for k in STAT_KEYS if k.startswith(op + "/")]
            v = torch.tensor(
                [float(stats.get(k, neutral)) if contributes else neutral for k in keys],
                dtype=torch.float64,
                device=self.device,
            )
            if dist.get_world_size() > 1:
                dist.all_reduce(
                    v, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
                )
            red.update(zip(keys, v.tolist()))
        # grad norms / lr were summed over the DP and CP ranks of the last stage
        dp_div = max(1, self.dp * self.cp)
        ntok = max(red.get("sum/tokens", 0.0), 1.0)
        stale = (self.version - 1) - _min_versions(tb)
        m = {
            "version": self.version,
            "loss": red["sum/loss_num"] / max(red["sum/loss_den"], 1.0),
            "grad_norm": red["sum/grad_norm"] / dp_div,
            # 1 when this step's update was not applied (non-finite loss or gradients), and the count so far
            "optimizer/skipped": float(red["sum/skipped"] > 0),
            "optimizer/skipped_total": self.skipped_steps,
            "lr": red["sum/lr"] / dp_div,
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
            **({"kl/value": red["sum/kl"] / ntok} if self.ref is not None else {}),
            **(self._critic_metrics(red, dp_div) if self.critic is not None else {}),
            "staleness/mean": float(stale.float().mean()),
            "staleness/max": float(stale.max()),
            **{
                f"staleness/hist_{k}": int(c)
                for k, c in enumerate(torch.bincount(stale.clamp(min=0)).tolist())
            },
            # share of samples the verifier scored as fully right (reward >= 1): the accuracy of training data
            "reward/accuracy": float((tb.rewards >= 1.0).float().mean()),
            "reward/mean": float(tb.rewards.mean()),
            "reward/std": float(tb.rewards.std(correction=0)),
            # mean |advantage| over trained tokens (advantages are per token)
            "adv/abs_mean": float((adv.abs() * tb.mask).sum() / tb.mask.sum().clamp(min=1.0)),
            "tokens/trained": red["sum/tokens"],
            "tokens/total": float(len(tb.prompt_ids) + len(tb.response_ids)),
            "samples": tb.n,
        }
        return m

    @staticmethod
    def _critic_metrics(red: dict, dp_div: int) -> dict:
        return {
            "critic/value_loss": red["sum/value_loss_num"] / max(red["sum/value_loss_den"], 1.0),
            # tokens whose value moved more than trainer.loss.value_clip from the value before the update
            "critic/clip_frac": red["sum/value_clipped"] / max(red["sum/value_tokens"], 1.0),
            "critic/grad_norm": red["sum/critic_grad_norm"] / dp_div,
            "critic/skipped": float(red["sum/critic_skipped"] > 0),
        }

    # -- after the step: announce, push, checkpoint --------------------------------------------------
    def after_step(self, metrics: dict) -> None:
        if self.rank == 0:
            self.source.set_version(self.version)
        if self.rank == 0 and self.pending_push is not None and self.pending_push.done():
            self.pending_push.result()  # a failed push surfaces at the next step, not only at the next push
        wc = self.cfg.weights
        if wc.push_every and self.version % wc.push_every == 0 and self._has_sender():
            metrics.update(self.push_weights())
        ce, every_s = self.tc.checkpoint_every, self.tc.checkpoint_every_s
        due = bool(ce and self.version % ce == 0)
        if not due and every_s:  # rank 0's clock decides for all: a checkpoint is collective
            due = self._rank0_says(time.monotonic() - self._checkpointed_at >= every_s)
        if due:
            self.save_checkpoint()
        if self.tc.save_hf_every and self.version % self.tc.save_hf_every == 0:
            self.save_hf()

    def _has_sender(self) -> bool:
        """Only rank 0 holds the sender, but the snapshot is collective: every rank must agree."""
        return self._rank0_says(self.sender is not None)

    def _rank0_says(self, yes: bool) -> bool:
        """Rank 0's `yes` on every rank (for decisions that lead into a collective)."""
        flag = torch.tensor([float(yes)], device=self.device)
        if dist.get_world_size() > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def push_weights(self) -> dict:
        """Check the previous push, snapshot (collective), start the next push in the background."""
        from stages.trainer.export import export_hf_state

        out = {}
        t0 = time.perf_counter()
        if self.pending_push is not None and self.rank == 0:
            res = self.pending_push.result()  # raises WeightPushError on failure or timeout
            out.update(
                {f"push/prev_{k}": v for k, v in res.items() if isinstance(v, int | float) and k != "version"}
            )
        out["push/wait_prev_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self._goes_direct():
            out.update(self._push_direct())
            out["push/direct_s"] = time.perf_counter() - t1
            return out
        state = export_hf_state(self.policy, **self._snapshot_target())  # collective; full tensors on rank 0
        if self.rank == 0 and self.sender is not None:
            self.pending_push = self.sender.push(self.version, list(state.items()))
        out["push/snapshot_s"] = time.perf_counter() - t1
        return out

    def _push_direct(self) -> dict:
        """weights.snapshot=direct: no copy; rank 0 pushes the tensors as every rank gathers them from the
        live weights, and training waits for it (collective). Its figures go under the names a
        background push reports them at the next step (`push/prev_*`): it is done now."""
        from stages.trainer.export import iter_hf_state

        named = iter_hf_state(self.policy)
        if self.rank == 0 and self.sender is not None:
            if not hasattr(self.sender, "push_now"):
                for _ in named:  # the other ranks are gathering: finish in step, then refuse
                    pass
                raise ValueError(
                    f"weights.snapshot=direct pushes into SGLang servers (weights.transport nccl or cuda_ipc); "
                    f"{type(self.sender).__name__} keeps each push for late joiners: use weights.snapshot=auto"
                )
            res = self._direct_result = self.sender.push_now(self.version, named, self._model_bytes())
            return {
                f"push/prev_{k}": v for k, v in res.items() if isinstance(v, int | float) and k != "version"
            }
        for _ in named:  # take part in every gather
            pass
        return {}

    def _goes_direct(self) -> bool:
        """Whether pushes take no copy (_push_direct): weights.snapshot=direct; with auto, where the model
        is over 10 % of the trainer's GPU (where the GPU copy does not go), rank 0's sender pushes into
        SGLang servers and trainer.pp is 1. At 7B on H100s the host copy cost 0.34 s of each training
        step and stood the engines still 0.35 s a push (copied back to the GPU meanwhile), where the
        direct push took 0.16 s of both (bench/RESULTS.md, 2026-11-27). Rank 0 decides once, for every
        rank: the ranks gather in step."""
        if self._pushes_direct is None:
            choice = self.cfg.weights.snapshot
            if choice == "auto":
                self._pushes_direct = self._rank0_says(
                    self.rank == 0
                    and self.tc.pp == 1
                    and hasattr(self.sender, "push_now")
                    and self.device.type == "cuda"
                    and not self._copy_fits_gpu()
                )
            else:
                self._pushes_direct = choice == "direct"
        return self._pushes_direct

    def _copy_fits_gpu(self) -> bool:
        """The 10 % rule of weights.snapshot=auto: a model copy of at most a tenth of the GPU's memory."""
        return self._model_bytes() <= 0.1 * torch.cuda.get_device_properties(self.device).total_memory

    def _model_bytes(self) -> int:
        """The whole model's bytes, about what a push sends (at most: megatron pads the vocabulary):
        this rank's share times the ranks that hold the others (TP and PP; for expert parameters EP,
        expert-TP and PP)."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        dense = ps.get_tensor_model_parallel_world_size() * pp
        experts = ps.get_expert_model_parallel_world_size() * ps.get_expert_tensor_parallel_world_size() * pp
        return sum(
            p.numel() * p.element_size() * (experts if moe.is_expert_param(key) else dense)
            for key, p in unwrap(self.policy.model).named_parameters()
        )

    def _snapshot_target(self) -> dict:
        """Where rank 0 keeps the pushed copy (weights.snapshot): on its GPU for the SGLang transports
        (the sender's `snapshot_device`) unless the model is over 10 % of that GPU (then auto pushes
        direct, but with pipeline stages), else in pinned host buffers reused from push to push."""
        from stages.trainer.export import HostSnapshot

        choice = self.cfg.weights.snapshot
        device = getattr(self.sender, "snapshot_device", "cpu")
        if choice == "auto" and device == "cuda":
            choice = "gpu" if self._copy_fits_gpu() else "cpu"
        # pinned buffers are refilled at the next push, so only for senders that keep nothing of a push
        # once it is done: the SGLang ones; the CPU transport keeps its last snapshot for late joiners
        if choice == "cpu" and self.device.type == "cuda" and device == "cuda":
            if self._host_snapshot is None:
                self._host_snapshot = HostSnapshot()
            return {"host": self._host_snapshot}
        return {"device": "cuda" if choice == "gpu" and self.device.type == "cuda" else device}

    def wait_push(self) -> dict | None:
        if self.rank != 0:
            return None
        if self.pending_push is None:  # a direct push is done when push_weights returns
            res, self._direct_result = self._direct_result, None
            return res
        res, self.pending_push = self.pending_push.result(), None
        return res

    def save_checkpoint(self) -> str:
        for name, p in unwrap(self.policy.model).named_parameters():
            if not torch.isfinite(p.detach()).all():  # a NaN checkpoint would poison every resume
                raise FloatingPointError(
                    f"not saving a checkpoint at version {self.version}: parameter {name} is not finite"
                )
        path = checkpoint.save(self)
        self.last_checkpoint = self.version
        self._checkpointed_at = time.monotonic()
        return path

    def save_hf(self, out_dir: str | None = None) -> str | None:
        from stages.trainer.export import export_hf_state, save_hf

        state = export_hf_state(self.policy)
        if self.rank != 0:
            return None
        out_dir = out_dir or f"{self.run_dir}/hf/step_{self.version:06d}"
        return save_hf(state, self.policy.model_path, out_dir)

    def close(self, save: bool = True) -> None:
        """Finish the in-flight push (raising if it failed) and save the final checkpoint."""
        try:
            self.wait_push()
        finally:
            if save and self.last_checkpoint != self.version:
                self.save_checkpoint()


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
)


def _engine_mismatch(tb: TokenBatch, old: torch.Tensor, shard: list[int], version: int) -> dict:
    """Sum of |logp_old - logp_rollout| over this rank's trained tokens generated at `version` (the
    weights logp_old was computed with), and their count."""
    rows = torch.zeros(tb.n, dtype=torch.bool)
    rows[torch.as_tensor(shard, dtype=torch.long)] = True
    fresh = rows[tb.seq] & (tb.versions == version) & (tb.mask > 0)
    diff = (old.float() - tb.rollout_logprobs).abs()
    return {"sum/abs_logp_diff_fresh": diff[fresh].double().sum(), "sum/fresh_tokens": fresh.double().sum()}


def _accumulate(acc: dict, st: dict) -> None:
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


def _min_versions(tb: TokenBatch) -> torch.Tensor:
    """Oldest token version per sample (samples without response tokens count as fresh)."""
    big = torch.iinfo(torch.int64).max
    mins = torch.full((tb.n,), big, dtype=torch.int64).scatter_reduce(0, tb.seq, tb.versions, "amin")
    return torch.where(mins == big, torch.zeros_like(mins), mins)


def _to_ipc(batch: pa.RecordBatch | pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write(batch)
    return sink.getvalue()
