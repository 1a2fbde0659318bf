"""The RL trainer: one `step()` = fetch complete groups -> old logprobs -> advantages -> loss ->
optimizer step -> version + 1 -> announce -> (maybe) push weights / checkpoint.

API (what the pipeline launcher uses, also from inside a Ray actor):
    trainer = Trainer(tc, run, source, model_path, weights=wc)  # source only needed on rank 0
    trainer.attach_sender(sender)                                # optional WeightSender (rank 0)
    metrics = trainer.step()                                     # one optimizer step; dict of floats
    trainer.version                                              # policy version = optimizer steps taken
    trainer.close()                                              # waits for the last push, saves a checkpoint

Taking turns with the engines on shared GPUs (cluster.offload, run.mode=sync; the driver's hand-over,
pipeline/orchestration/handover.py, orders the calls): `fetch()`, `train_turn(batch)`, `push_turn()`,
with the state moved off the device and back by `trainer.memory` (offload.py).

`tc` is the `trainer:` section, `wc` the `weights:` one, and `run` (config.TrainerRun) the few run-wide
values the trainer reads. The trainer is made of parts: the batch feed (feed.py), the backend that
runs the model (backend.py; megatron_backend.py), the critic (critic.py), the weight publisher
(stages/weights/publisher.py) and the checkpoint manager (checkpoint.py). This class holds the
algorithm's order of things and the policy version.

All ranks call step() together; rank 0 fetches and broadcasts the batch. torch.distributed is
initialised on demand (gloo world of 1 on a free port when not under torchrun).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from stages.trainer import advantages, losses
from stages.trainer.backend import TrainBackend, ValueModel
from stages.trainer.checkpoint import ROOT, CheckpointManager, resolve_checkpoint
from stages.trainer.config import TrainerConfig, TrainerRun, check_critic_layout
from stages.trainer.distill import served_teacher_logprobs
from stages.trainer.feed import BatchFeed, SourceExhausted
from stages.trainer.hooks import TrainerHookContext, TrainerHooks
from stages.trainer.offload import GRADS, OPTIMIZER, PARTS, TrainerMemory, WakingPublisher
from stages.trainer.optimizer import lr_at
from stages.trainer.packing import MicroBatch, TokenBatch, mini_batch_parts, shard_samples, to_token_batch
from stages.trainer.sft import SftData, mark_sft
from stages.trainer.shaping import shape_batch
from stages.trainer.step_metrics import (
    STAT_KEYS,
    accumulate,
    engine_mismatch,
    perf,
    reward_metrics,
    step_metrics,
)
from stages.weights.config import WeightsConfig
from stages.weights.publisher import rank0_says

__all__ = ["SourceExhausted", "Trainer"]  # SourceExhausted: where launchers have always imported it

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        tc: TrainerConfig,
        run: TrainerRun,
        source: Any,
        model_path: str,
        *,
        weights: WeightsConfig | None = None,
        sender: Any = None,
        backend: TrainBackend | None = None,
    ):
        """`backend`: the model's framework (default: megatron-core, built from `model_path` here)."""
        self.tc, self.run = tc, run
        self.run_dir = str(run.run_dir)
        tc.loss.validate()  # again: fields may have been set after the config was built
        check_critic_layout(tc)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if backend is None:  # trainer.backend: megatron-core, or the HF-native FSDP2 one (fsdp_backend.py)
            if tc.backend == "fsdp":
                from stages.trainer.fsdp_backend import FsdpBackend as Backend
            else:
                from stages.trainer.megatron_backend import MegatronBackend as Backend
            backend = Backend(tc, run, model_path)
        self.backend = backend
        self.rank, self.device = backend.rank, backend.device
        if self.rank == 0 and source is None:
            raise ValueError(
                "Trainer on rank 0 needs a BatchSource (buffer client, in-process buffer or replay)"
            )
        # a push that finds the weights offloaded brings them back for itself (offload.py)
        self.publisher = WakingPublisher(
            weights or WeightsConfig(),
            backend.weight_export(),
            rank=self.rank,
            device=self.device,
            stages=tc.pp,
            sender=sender,
        )
        self.feed = BatchFeed(source, tc, run, self.publisher, rank=self.rank, device=self.device)
        # the value model of advantage=ppo: same build settings and parallelism as the policy
        self.critic: ValueModel | None = backend.build_critic() if tc.loss.advantage == "ppo" else None
        self.sft = _sft_data(tc, model_path)  # trainer.sft's conversations, trained beside each batch
        self.checkpoints = CheckpointManager(self.run_dir, keep=tc.keep_checkpoints, async_save=tc.async_save)
        self._memory: TrainerMemory | None = None  # made at the first offload (`memory`)
        self._offload_s = 0.0  # this turn's offload seconds so far (train_turn, then push_turn)
        self.version = 0
        self._applied = 0  # optimizer updates applied in the current step (a skipped step applies none)
        self.skipped_steps = 0  # optimizer steps not applied (non-finite loss or gradients)
        self._checkpointed_at = time.monotonic()  # trainer.checkpoint_every_s counts from here
        self._params: int | None = None  # the whole model's parameters (perf/tflops)
        self.last_checkpoint = -1
        parts, backend = self._checkpoint_parts(), tc.backend
        state = self.checkpoints.load_latest(parts, backend=backend) if tc.resume else None
        if state:
            self.version = int(state["version"])
            self.last_checkpoint = self.version
        elif tc.load:  # a run with no checkpoint of its own starts from another run's (or a converted one)
            path = resolve_checkpoint(tc.load, tc.ckpt_step)
            state = self.checkpoints.load(parts, path, optimizer=not tc.finetune, backend=backend)
            self.version = 0 if tc.finetune else int(state["version"])
        # the engines start from the model folder: they lack this trainer's weights when it resumed or
        # loaded a checkpoint (trainer.finetune's too, at version 0) or its adapters start from a PEFT
        # folder, and then the launcher pushes its weights before the first step
        self.engines_start_behind = bool(state) or bool(tc.lora.rank and tc.lora.init_from)
        self.hooks = TrainerHooks(tc.hooks)
        self.hooks.call("init", self._hook_context())
        self.start_version = self.version  # where this trainer began (resumed): logs and tests only
        self.feed.set_version(self.version)

    @property
    def policy(self) -> Any:
        """The backend's policy model (megatron: model.Policy), for tests and benches that look inside."""
        return self.backend.policy

    def attach_sender(self, sender: Any) -> None:
        self.publisher.attach(sender)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> dict:
        """Fetch one batch and train on it. Raises TimeoutError / WeightPushError / SourceExhausted."""
        self._require_resident("a training step")  # before the fetch: a refused step takes no batch
        t0 = time.perf_counter()
        batch = self.feed.fetch(self.version)
        wait = time.perf_counter() - t0
        metrics = self.train_on_batch(batch)
        metrics["time/data_wait_s"] = wait
        metrics["time/step_s"] = time.perf_counter() - t0
        self.after_step(metrics)
        return metrics

    def train_on_batch(self, batch: pa.RecordBatch) -> dict:
        """Optimizer step on one batch of complete groups; version += 1, unless every update of the batch
        was skipped as non-finite (trainer.on_nonfinite=skip): the weights did not change, so neither does
        the policy version. Collective over all ranks."""
        t0 = time.perf_counter()
        self._require_resident("a training step")
        self._applied = 0  # optimizer updates of this batch that were applied (not skipped)
        n_sft = 0
        if self.sft is not None:  # picked by the version: a resumed run trains the rows an unbroken one would
            batch, n_sft = self.sft.extend(batch, step=self.version, version=self.version)
        raw = mark_sft(_token_batch(batch), n_sft) if n_sft else _token_batch(batch)
        tb = shape_batch(raw, self.tc.loss, self.run.max_new_tokens)
        self.backend.check_batch(tb)
        shard = shard_samples(tb, self.backend.dp)[self.backend.dp_rank]
        mbs = self.backend.pack(tb, shard)
        self.hooks.call("before_log_prob", self._hook_context(), tb)
        separate = self._separate_old_pass()
        old = self.backend.logprobs(tb, mbs) if separate else None
        ref = self._reference_logprobs(tb, mbs)
        adv, value_batch = self._advantages(tb, mbs, old, ref)
        self.hooks.call("before_train_step", self._hook_context(), tb)
        if self.tc.ppo_epochs * self.tc.mini_batches == 1:
            stats, old = self._update(tb, mbs, adv, old, ref, value_batch, first=True)
        else:
            stats, old = self._updates(tb, shard, adv, old, ref, value_batch), old.cpu()
        stats.update(engine_mismatch(tb, old, shard, self.version))
        trained_at = self.version
        if self._applied:  # a skipped step leaves the policy, and so its version, as it was
            self.version += 1
        metrics = self._metrics(tb, adv, stats, value_batch, trained_at + 1)
        if tb.rewards is not raw.rewards:  # reward/* stay the task's; the shaped mean beside them
            metrics["reward/shaped_mean"] = float(tb.rewards[tb.rl_rows()].mean())
            metrics.update(reward_metrics(raw.rewards[raw.rl_rows()]))
        metrics["version"] = self.version
        metrics.update(self.hooks.take_metrics())
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics.update(self._perf(metrics["tokens/total"], metrics["time/train_s"], separate))
        return metrics

    def _reference_logprobs(self, tb: TokenBatch, mbs: list[MicroBatch]) -> torch.Tensor | None:
        """The KL's reference logprobs [T]: a served teacher's, which the samples carry
        (trainer.distill.server), else the backend's reference forward; None without a KL term."""
        if self.tc.distill.server:
            return served_teacher_logprobs(tb, self.device)
        return self.backend.logprobs(tb, mbs, reference=True) if self.backend.has_reference else None

    def _hook_context(self) -> TrainerHookContext:
        return TrainerHookContext(
            config=self.tc,
            run=self.run,
            rank=self.rank,
            model=self.backend.policy.model,
            optimizer=self.backend.optimizer,
            version=self.version,
        )

    def _separate_old_pass(self) -> bool:
        """Whether logp_old takes a forward of its own. With one optimizer step per batch the training
        forward computes exactly these (same weights, no dropout), so by default they are taken from it
        (detached); several updates need logp_old of the weights before the first, and the KL in the
        reward needs it before the advantage: only a separate pass has it then."""
        tc = self.tc
        updates = tc.ppo_epochs * tc.mini_batches
        return tc.old_logprobs == "separate_pass" or updates > 1 or tc.loss.kl_in_reward_coef > 0

    def _advantages(self, tb: TokenBatch, mbs: list[MicroBatch], old, ref):
        """Per-token advantages [T] of the whole batch, the same on every rank, and for ppo the critic's
        (values, returns) [T]. The statistics (whitening, group means) are over the whole batch, so the
        per-token inputs computed per shard (logp_old, logp_ref, values) are gathered first."""
        lc, whole = self.tc.loss, self.backend.batch_whole
        kl = None
        if lc.kl_in_reward_coef:  # k1 per token, as the REINFORCE++ paper and slime put it into the reward
            kl = losses.kl_penalty(whole(old), whole(ref), "k1")
        groups = advantages.group_ids_to_index(tb.group_ids)
        if self.critic is None:
            adv = advantages.token_advantages(
                tb.rewards, groups, tb.seq, tb.mask, lc, valid=tb.trainable, kl=kl
            )
            return adv, None
        values = whole(self.critic.values(tb, mbs))
        adv, returns = advantages.ppo_advantages(
            tb.rewards, tb.seq, tb.mask, values, lc, valid=tb.trainable, kl=kl
        )
        return adv, (values, returns)

    def _update(self, tb: TokenBatch, mbs: list[MicroBatch], adv, old, ref, value_batch, first: bool):
        """One optimizer update of the policy on `mbs` (then of the critic, toward the returns of
        `value_batch`); returns its statistics and logp_old [T]."""
        lr = lr_at(self.tc, self.version, self.run.steps)
        stats, old = self.backend.train(
            tb, mbs, adv, old, ref, lr=lr, version=self.version, count_unpacked=first
        )
        if not stats["sum/skipped"]:
            self._applied += 1
        else:
            self.skipped_steps += 1
            log.warning(
                "optimizer step skipped at version %d (non-finite loss or gradients); %d skipped so far",
                self.version,
                self.skipped_steps,
            )
        if value_batch is not None:
            accumulate(
                stats,
                self.critic.update(
                    tb, mbs, *value_batch, policy_lr=lr, version=self.version, count_unpacked=first
                ),
            )
        return stats, old

    def _updates(self, tb: TokenBatch, shard: list[int], adv, old, ref, value_batch) -> dict:
        """trainer.ppo_epochs x trainer.mini_batches optimizer updates on one batch (each followed by the
        critic's on the same mini-batch). Statistics are summed over the updates (token means stay
        means; tokens/trained counts each update's tokens); grad norms and lr are their means."""
        m = self.tc.mini_batches
        if len(shard) < m:
            raise ValueError(
                f"trainer.mini_batches={m} but this rank has {len(shard)} samples of the batch; lower "
                "trainer.mini_batches or raise trainer.batch_groups"
            )
        parts = mini_batch_parts(tb, shard, m)
        packed = [self.backend.pack(tb, p) for p in parts]
        acc: dict = {}
        for epoch in range(self.tc.ppo_epochs):
            for i, mbs in enumerate(packed):
                st, _ = self._update(tb, mbs, adv, old, ref, value_batch, first=epoch == 0 and i == 0)
                accumulate(acc, st)
        n = self.tc.ppo_epochs * m
        for k in ("sum/grad_norm", "sum/lr", "sum/critic_grad_norm"):
            if k in acc:
                acc[k] = acc[k] / n
        return acc

    def _metrics(self, tb: TokenBatch, adv, stats: dict, value_batch, made: int) -> dict:
        """Statistics reduced over micro-batches and ranks into one flat dict (same on every rank).
        `made`: the version the step makes when applied (staleness is counted from the one before)."""
        red = self.backend.reduce_stats(stats, STAT_KEYS)
        metrics = step_metrics(
            red,
            tb,
            adv,
            version=made,
            skipped_total=self.skipped_steps,
            kl=self.backend.has_reference or bool(self.tc.distill.server),
            critic=self.critic is not None,
        )
        metrics.update(self.backend.model_metrics())
        if value_batch is not None:  # the critic's values of this batch before its update
            on = (tb.mask > 0) & tb.trainable[tb.seq]
            metrics["critic/value_mean"] = float(value_batch[0][on].mean()) if on.any() else 0.0
        return metrics

    def _perf(self, tokens: float, seconds: float, separate_pass: bool) -> dict:
        if self._params is None:
            self._params = self.backend.active_params()
        world = dist.get_world_size()
        return perf(self._params, tokens, seconds, separate_pass, world, self.tc.peak_tflops)

    # -- after the step: announce, push, checkpoint --------------------------------------------------
    def after_step(self, metrics: dict) -> None:
        if not self._announce(metrics):
            return  # nothing changed: no new weights to push, checkpoint or export
        if self.publisher.due(self.version):
            metrics.update(self.push_weights())
        self._save_if_due()

    def _announce(self, metrics: dict) -> bool:
        """Tell the source the new version, surface a failed background push; whether the step changed
        the weights (False: every update of it was skipped as non-finite)."""
        self.feed.set_version(self.version)
        self.publisher.raise_if_failed()
        return not (metrics.get("optimizer/skipped") and self._applied == 0)

    def _save_if_due(self) -> None:
        ce, every_s = self.tc.checkpoint_every, self.tc.checkpoint_every_s
        due = bool(ce and self.version % ce == 0)
        if not due and every_s:  # rank 0's clock decides for all: a checkpoint is collective
            due = rank0_says(time.monotonic() - self._checkpointed_at >= every_s, self.device)
        if due:
            self.save_checkpoint()
        if self.tc.save_hf_every and self.version % self.tc.save_hf_every == 0:
            self.save_hf()

    def push_weights(self) -> dict:
        """Check the previous push, take the weights (collective), start the next push."""
        return self.publisher.push(self.version)

    def wait_push(self) -> dict | None:
        return self.publisher.wait()

    def _checkpoint_parts(self) -> dict:
        return {ROOT: self.backend.checkpoint_part(), "critic": self.critic and self.critic.checkpoint_part()}

    def save_checkpoint(self) -> str:
        self._require_resident("a checkpoint")
        bad = self.backend.nonfinite_param()
        if bad is not None:  # a NaN checkpoint would poison every resume
            raise FloatingPointError(
                f"not saving a checkpoint at version {self.version}: parameter {bad} is not finite"
            )
        meta = {"model_path": self.backend.model_path, "backend": self.tc.backend}
        path = self.checkpoints.save(self.version, self._checkpoint_parts(), meta)
        self.last_checkpoint = self.version
        self._checkpointed_at = time.monotonic()
        return path

    def save_hf(self, out_dir: str | None = None) -> str | None:
        self._require_resident("an HF export")
        return self.backend.save_hf(out_dir or f"{self.run_dir}/hf/step_{self.version:06d}")

    # -- taking turns with the engines (cluster.offload; pipeline/orchestration/handover.py) ---------
    @property
    def memory(self) -> TrainerMemory:
        """The trainer's state parts as the hand-over moves them (offload.py)."""
        if self._memory is None:
            self._memory = TrainerMemory(self.backend, self.critic, self.device, self.rank)
            self.publisher.memory = self._memory
        return self._memory

    def _require_resident(self, what: str) -> None:
        if self._memory is not None:
            self._memory.require_resident(what)

    def fetch(self) -> tuple[pa.RecordBatch, float]:
        """The next batch (collective: rank 0 fetches, every rank gets it) and the seconds waited."""
        t0 = time.perf_counter()
        return self.feed.fetch(self.version), time.perf_counter() - t0

    def train_turn(self, batch: pa.RecordBatch, offload: bool) -> dict:
        """The trainer's turn on the device: its state back, one step on `batch` with its checkpoint
        and HF export when due, and with `offload` its gradients and optimizer state handed back at
        once (the weights stay on for the push; the engines wake theirs meanwhile)."""
        wake = self.memory.onload(PARTS)
        metrics = self.train_on_batch(batch)
        if self._announce(metrics):
            self._save_if_due()
        metrics["onload/train_s"] = wake["seconds"]
        metrics["memory/train_gb/train"] = self.memory.device_bytes() / 1e9
        self._offload_s = self.memory.offload((GRADS, OPTIMIZER))["seconds"] if offload else 0.0
        return metrics

    def push_turn(self, offload: bool) -> dict:
        """The hand-over's push, waited for: the engines woke their weights for it, so it goes whatever
        weights.push_every and a skipped step say (an SGLang server's woken weights hold nothing until
        pushed). Then with `offload` the weights are handed back too (at start-up, with the whole
        state still on, everything goes)."""
        metrics = self.push_weights()
        t0 = time.perf_counter()
        res = self.wait_push() or {}
        metrics["push/wait_s"] = time.perf_counter() - t0
        metrics["push/seconds"] = res.get("seconds", 0.0)
        if offload:
            self._offload_s += self.memory.offload(PARTS)["seconds"]
        metrics["offload/train_s"], self._offload_s = self._offload_s, 0.0
        metrics["memory/train_gb/generate"] = self.memory.device_bytes() / 1e9
        return metrics

    def close(self, save: bool = True) -> None:
        """Finish the in-flight push (raising if it failed) and save the final checkpoint unless
        trainer.save_at_end is off (an offloaded state is brought back for it: the driver has the engines
        release theirs first)."""
        save = save and self.tc.save_at_end
        try:
            self.wait_push()
        finally:
            if self._memory is not None and save:
                self._memory.onload(PARTS)
            if save and self.last_checkpoint != self.version:
                self.save_checkpoint()
            self.checkpoints.close()  # a save still written in the background: committed before close returns


def _sft_data(tc: TrainerConfig, model_path: str) -> SftData | None:
    if tc.loss.sft_coef <= 0:
        return None
    from stages.models import load_tokenizer

    return SftData(tc.sft, load_tokenizer(model_path), max_tokens=tc.micro_batch_tokens)


def _token_batch(batch: pa.RecordBatch) -> TokenBatch:
    tb = to_token_batch(batch)
    if len(tb.response_ids) == 0:
        statuses = sorted(set(batch.column("status").to_pylist()))
        raise ValueError(
            f"batch of {tb.n} samples has no response tokens at all (statuses: {statuses}; first uids: "
            f"{batch.column('uid').to_pylist()[:3]}): nothing to train on; check the engine's "
            "max_new_tokens and why generation ended at once"
        )
    return tb
