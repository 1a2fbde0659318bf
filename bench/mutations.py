"""Mutation check: known-bad edits, each applied to a copy of the repository and run against the tests
that claim to cover it. A green suite must mean these bugs are absent, so every one must be caught.

    .venv/bin/python bench/mutations.py                 # all mutations
    .venv/bin/python bench/mutations.py --only adv_sign,fsync_segment

Each mutation replaces one exact snippet (it must occur exactly once: a refactor that moves the code
makes the bench fail loudly instead of testing nothing). Prints a table, then one JSON line last:
{"caught": n, "total": n, "missed": [...], "seconds": s}. Run it before closing an issue that touches
the trainer, buffer durability, weight push, staleness or admission; the table goes in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from _results import record  # bench/ is on sys.path when a bench runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # the bug it stands for
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # what claims to cover it (pytest node ids or files)


MUTATIONS = [
    Mutation(
        "adv_sign",
        "the trainer climbs the wrong way (advantage sign flipped)",
        "stages/trainer/trainer.py",
        "        adv, value_batch = self._advantages(tb, mbs, old, ref)\n",
        "        adv, value_batch = self._advantages(tb, mbs, old, ref)\n        adv = -adv\n",
        ("tests/test_trainer_direction.py", "tests/test_learning.py"),
    ),
    Mutation(
        "lr_zero",
        "the learning rate never reaches the optimizer",
        "stages/trainer/megatron_backend.py",
        '        for g in self.optimizer.param_groups:\n            g["lr"] = lr\n',
        '        for g in self.optimizer.param_groups:\n            g["lr"] = 0.0\n',
        ("tests/test_trainer_direction.py",),
    ),
    Mutation(
        "skip_optimizer_step",
        "gradients are computed but never applied",
        "stages/trainer/megatron_backend.py",
        "                ok, grad_norm, _ = self.optimizer.step()\n",
        "                ok, grad_norm = True, 0.0\n",
        ("tests/test_trainer_direction.py",),
    ),
    Mutation(
        "logp_old_is_rollout",
        "logp_old replaced by the engine's logprobs (the correction silently off)",
        "stages/trainer/step_loss.py",
        "            self.old[ix] = logp.detach()\n",
        "            self.old[ix] = self.rollout[ix]\n",
        ("tests/test_trainer_direction.py",),
    ),
    Mutation(
        "tis_negated",
        "the truncated importance weight flips the sign of every token's term",
        "stages/trainer/losses.py",
        "    per_token = w * pg\n",
        "    per_token = -w * pg\n",
        ("tests/test_losses.py", "tests/test_trainer_direction.py"),
    ),
    Mutation(
        "fsync_segment",
        "acks leave before the segment is durable",
        "buffer/segments.py",
        "                self._sink.flush()\n                os.fsync(self._sink.fileno())\n",
        "                self._sink.flush()\n",
        ("tests/test_buffer_durability.py",),
    ),
    Mutation(
        "engine_keeps_old_weights",
        "a push bumps the engine's version but not its weights",
        "stages/rollout/torch_engine.py",
        "                dst.data.copy_(t.to(device=dst.device, dtype=dst.dtype))\n",
        "                pass\n",
        ("tests/test_pipeline_e2e.py::test_sync_mode_trains_on_policy_with_the_pushed_weights",),
    ),
    Mutation(
        "staleness_bound_off_by_one",
        "groups one version past the staleness bound are still served",
        "buffer/storage.py",
        "[g for g in pool.values() if g.staleness(version) > max_staleness], version)\n",
        "[g for g in pool.values() if g.staleness(version) > max_staleness + 1], version)\n",
        ("tests/test_buffer_storage.py",),
    ),
    Mutation(
        "admission_unbounded",
        "generators run ahead of the staleness bound",
        "stages/rollout/admission.py",
        "        return live - self._kept_offset < (version + self.max_staleness + 1) * self.batch_groups\n",
        "        return live - self._kept_offset < (version + self.max_staleness + 2) * self.batch_groups\n",
        ("tests/test_rollout_generator.py",),
    ),
    Mutation(
        "entropy_grad_sign",
        "the entropy bonus pushes entropy down",
        "stages/trainer/lm_head.py",
        "        coef = coef + g_ent[:, None] * (logp + ent[:, None])\n",
        "        coef = coef - g_ent[:, None] * (logp + ent[:, None])\n",
        ("tests/test_trainer_head.py",),
    ),
    Mutation(
        "vocab_padding_in_softmax",
        "TP padding rows of the vocabulary take probability mass",
        "stages/trainer/lm_head.py",
        "    if real_cols < z.shape[1]:\n",
        "    if False:\n",
        ("tests/test_trainer_parallel.py::test_parallel_layout_matches_tp1[tp2]",),
    ),
    Mutation(
        "nan_reward_accepted",
        "the buffer acks a NaN reward",
        "buffer/values.py",
        "    if not np.isfinite(reward).all():\n",
        "    if False:\n",
        ("tests/test_bad_values.py",),
    ),
    Mutation(
        "nonfinite_step_applied",
        "a NaN loss reaches the weights",
        "stages/trainer/megatron_backend.py",
        "        if self.grads_finite(loss.stats, self.policy.model):\n",
        "        if True:\n",
        ("tests/test_bad_values.py",),
    ),
    Mutation(
        "resume_reruns_steps",
        "a resumed run trains run.steps more steps instead of up to run.steps",
        "pipeline/orchestration/driver.py",
        "        while step < cfg.run.steps:\n",
        "        while step < start + cfg.run.steps:\n",
        (
            "tests/test_pipeline_e2e.py::test_rerun_in_the_same_run_dir_resumes_and_is_not_starved_by_duplicates",
        ),
    ),
    Mutation(
        "dead_engine_blocks_push",
        "a push waits for an engine whose process died",
        "stages/weights/zmq_transport.py",
        '            for ident in [i for i, hello in self.engines.items() if hello.get("engine") in gone]:\n',
        "            for ident in []:\n",
        (
            "tests/test_weights_cpu.py::test_forgetting_an_engine_frees_a_push_waiting_for_it",
            "tests/test_healing.py::test_killed_generator_is_replaced_and_the_run_finishes",
        ),
    ),
    Mutation(
        "replay_ignored",
        "MoE routing replay is on but the routers keep their own choice",
        "stages/trainer/routing_replay.py",
        "        idx = torch.where(has, target.long(), own)\n",
        "        idx = own\n",
        ("tests/test_routing_replay.py",),
    ),
    Mutation(
        "no_catch_up",
        "a relaunched SGLang server never gets the current weights while the trainer waits for data",
        "stages/weights/publisher.py",
        "        handle = self.sender.catch_up()\n",
        "        handle = None\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "relaunch_between_pushes_missed",
        "a server relaunched from the base weights between two pushes is never caught up (no push missed it)",
        "stages/weights/sglang_transport.py",
        "        return self._relaunched_behind(self._pushed_version)\n",
        "        return []\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "relaunched_server_not_pushed",
        "the trainer is told a server runs older weights and waits for data anyway",
        "stages/trainer/feed.py",
        "                    return Delivery(Got.PUSH_AGAIN)\n",
        "                    pass\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "relaunch_taken_for_trainer_going_back",
        "a relaunched engine's dip to the base weights reopens admission as if the trainer went back",
        "stages/rollout/admission.py",
        "        if relaunches > self._relaunches_seen:\n",
        "        if False:\n",
        ("tests/test_rollout_generator.py", "tests/test_relaunch_dip.py"),
    ),
    Mutation(
        "relaunch_dip_never_ends",
        "a fresh trainer at the version a relaunched server came back at is never let through",
        "stages/rollout/admission.py",
        "now - self._relaunch_dip_since < dip_wait_s",
        "True",
        ("tests/test_relaunch_dip.py",),
    ),
    Mutation(
        "relaunch_version_late",
        "a relaunching server keeps its old version until it is up: a pool admits on it meanwhile",
        "stages/rollout/sglang_engine.py",
        "                    self.restarts += 1\n                    self._version = version\n",
        "                    self.restarts += 1\n",
        ("tests/test_relaunch_dip.py",),
    ),
    Mutation(
        "freeze_gc_skipped",
        "a (re)started SGLang server keeps every start-up object in its garbage collector's reach",
        "stages/rollout/sglang_engine.py",
        "        if self.cfg.freeze_gc:\n            self._freeze_gc()\n",
        "",
        ("tests/test_sglang_freeze_gc.py",),
    ),
    Mutation(
        "rendezvous_port_race_fatal",
        "a trainer group whose rendezvous port another process took fails the run instead of starting again",
        "pipeline/orchestration/supervisors.py",
        "            if not port_taken(e) or attempt == attempts:\n",
        "            if True:\n",
        ("tests/test_rendezvous_port.py",),
    ),
    Mutation(
        "push_fails_on_server_killed_mid_push",
        "a server killed while a push loads into it fails the push (and the trainer) instead of being left out",
        "stages/weights/sglang_transport.py",
        "            if not self._left_out(e, live):\n",
        "            if True:\n",
        ("tests/test_weights_group_processes.py",),
    ),
    Mutation(
        "partly_loaded_survivor_resumed",
        "a server left partly loaded by another's death mid-push is resumed by the catch-up, not given whole weights",
        "stages/weights/sglang_transport.py",
        "        behind, last = [*self._down_since, *sorted(self._partly_loaded)], self._last\n",
        "        behind, last = list(self._down_since), self._last\n",
        ("tests/test_weights_group_processes.py",),
    ),
    Mutation(
        "auto_keeps_host_copy_at_7b",
        "weights.snapshot=auto copies a model too big for a GPU copy to host memory instead of pushing it direct",
        "stages/weights/publisher.py",
        "                    and not self._copy_fits_gpu()\n",
        "                    and False\n",
        ("tests/test_trainer_model.py",),
    ),
    Mutation(
        "paused_server_relaunched_at_one_missed_check",
        "a live SGLang server that misses one /health check (paused for a push) is relaunched",
        "stages/rollout/sglang_engine.py",
        "        return self._health_misses < 2\n",
        "        return False\n",
        ("tests/test_engine_health.py",),
    ),
    Mutation(
        "broadcast_waits_for_dead_server",
        "the push waits out a broadcast to a dead server (NCCL's watchdog then ends the trainer)",
        "stages/weights/nccl_sender.py",
        "        dead = unreachable(calls)\n        if dead:\n            return dead\n",
        "        dead = []\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "direct_push_leaves_gathers_hanging",
        "a direct push that fails stops taking the gathered tensors (the other trainer ranks wait in a gather)",
        "stages/weights/sglang_transport.py",
        "        finally:\n            for _ in it:\n                pass\n",
        "        finally:\n            pass\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "direct_push_left_out_server_forgotten",
        "a server a direct push left out waits for a catch-up that has nothing kept to send",
        "stages/weights/sglang_transport.py",
        "        if self._pushed_version is None or (self._down_since and self._last is not None):\n",
        "        if self._pushed_version is None or self._down_since:\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "per_tensor_receive_asked_flat",
        "weights.nccl_receive=per_tensor sends each tensor but asks the server for a flattened_bucket receive",
        "stages/weights/nccl_sender.py",
        "            flat=not per_tensor,\n",
        "            flat=True,\n",
        ("tests/test_weights_sglang_protocol.py", "tests/test_weights_group_processes.py"),
    ),
    Mutation(
        "per_tensor_broadcast_out_of_order",
        "the per-tensor push broadcasts a bucket's tensors in another order than the load call names them",
        "stages/weights/nccl_sender.py",
        "        parts = tensors_on(group, device) if per_tensor else [flat_bucket(group, device)]\n",
        "        parts = tensors_on(group, device)[::-1] if per_tensor else [flat_bucket(group, device)]\n",
        ("tests/test_weights_sglang_protocol.py", "tests/test_weights_group_processes.py"),
    ),
    Mutation(
        "auto_receive_never_per_tensor",
        "weights.nccl_receive=auto sends a 7B model's large tensors flat (the slower receive at that size)",
        "stages/weights/nccl_sender.py",
        "    return total >= len(group) * (PER_TENSOR_MIN_MEAN_MB << 20)\n",
        "    return False\n",
        ("tests/test_weights_sglang_protocol.py",),
    ),
    Mutation(
        "nccl_group_kept",
        "an NCCL push keeps broadcasting to the weight group of a server that died (a hang)",
        "stages/weights/nccl_sender.py",
        "        if live == self._members and not self._relaunched(live):\n            return\n",
        "        return\n",
        ("tests/test_weights_sglang_protocol.py", "tests/test_weights_group_processes.py"),
    ),
    Mutation(
        "request_cap_first_burst",
        "the request cap counts only what the engine holds: groups started in one burst overshoot it",
        "stages/rollout/generator.py",
        "        return in_flight + self._unsent + r.group_size <= r.max_inflight_requests\n",
        "        return in_flight + r.group_size <= r.max_inflight_requests\n",
        ("tests/test_request_cap.py",),
    ),
    Mutation(
        "engine_down_hot_loop",
        "a generator keeps starting and retrying groups on a dead engine (fails them all, burns the data)",
        "stages/rollout/generator.py",
        "        if self.engine.available():\n",
        "        if True:\n",
        ("tests/test_engine_down.py",),
    ),
    Mutation(
        "stale_abort_at_the_bound",
        "a group exactly at run.max_staleness is aborted too (trainable work thrown away)",
        "stages/rollout/admission.py",
        "        if f.generating and not f.aborting and now - f.start_version > max_staleness:\n",
        "        if f.generating and not f.aborting and now - f.start_version >= max_staleness:\n",
        ("tests/test_stale_abort.py",),
    ),
    Mutation(
        "direct_push_unpacked",
        "a direct push holds a bucket of gathered tensors, then their flat copy (the 7B run's out of memory)",
        "stages/weights/sglang_transport.py",
        "            pack_on = None if keep else self._bucket_device()\n",
        "            pack_on = None\n",
        (
            "tests/test_weights_sglang_protocol.py::test_a_direct_push_loads_each_bucket_as_it_is_gathered_and_drains_the_gathers_when_it_fails",
        ),
    ),
    Mutation(
        "row_shards_gathered_as_rows",
        "row-parallel TP shards (columns) gathered as if their rows concatenated: wrong weights pushed",
        "stages/trainer/export.py",
        '        if layout in ("col", "qkv"):\n',
        '        if layout in ("col", "qkv", "row"):\n',
        ("tests/test_trainer_parallel.py",),
    ),
    Mutation(
        "expandable_segments_under_ipc",
        "the trainer's memory in expandable segments under CUDA IPC pushes (pidfd_getfd refused in containers)",
        "stages/trainer/cuda_memory.py",
        'WITHOUT_CUDA_IPC = ("cpu", "nccl")\n',
        'WITHOUT_CUDA_IPC = ("cpu", "nccl", "cuda_ipc")\n',
        ("tests/test_trainer_cuda_memory.py",),
    ),
    Mutation(
        "stage_traceback_dropped",
        "a stage that raised stops the run with its last line only: where it raised is lost",
        "pipeline/orchestration/calls.py",
        '            path.write_text(str(e) + "\\n")\n',
        '            path.write_text("\\n")\n',
        ("tests/test_pipeline_e2e.py::test_failing_stage_stops_the_run_with_its_error",),
    ),
    Mutation(
        "sgd_checkpoint_unloadable",
        "trainer.optimizer=sgd cannot resume: megatron calls SGD's missing init_state_fn while loading",
        "stages/trainer/optimizer.py",
        "                part.init_state_fn = _make_sgd_state  # see there\n",
        "                pass\n",
        ("tests/test_trainer_step.py::test_a_resumed_trainer_takes_the_step_the_uninterrupted_one_takes",),
    ),
    Mutation(
        "optimizer_state_not_resumed",
        "a resumed trainer starts with fresh optimizer state (Adam's moments, SGD's momentum lost)",
        "stages/trainer/checkpoint.py",
        '            self.optimizer.load_state_dict(state["optimizer"])\n',
        "            pass\n",
        ("tests/test_trainer_step.py::test_a_resumed_trainer_takes_the_step_the_uninterrupted_one_takes",),
    ),
    Mutation(
        "empty_optimizer_state_loaded",
        "a checkpoint saved before the first step (no optimizer state) cannot be resumed: its keys are missing",
        "stages/trainer/checkpoint.py",
        "                with_optimizer = optimizer and state.get(_flag(part_name), True)\n",
        "                with_optimizer = optimizer\n",
        ("tests/test_trainer_step.py::test_a_checkpoint_saved_before_any_step_resumes",),
    ),
    Mutation(
        "dist_optimizer_shared_step",
        "a resumed distributed optimizer keeps megatron's one step tensor for every parameter: torch's Adam "
        "advances it once per parameter, the bias correction goes wrong and the run leaves the uninterrupted one",
        "stages/trainer/optimizer.py",
        '                state["step"] = state["step"].clone()\n',
        "                pass\n",
        ("tests/test_dist_optimizer_resume.py::test_dense_dp2_resumes_exactly",),
    ),
    Mutation(
        "grouped_offsets_not_cumulative",
        "the grouped experts take each expert's row count as its end row: rows go to the wrong experts",
        "stages/trainer/grouped_experts.py",
        "        offs = torch.cumsum(tokens_per_expert.to(hidden.device, non_blocking=True), 0).to(torch.int32)\n",
        "        offs = tokens_per_expert.to(hidden.device).to(torch.int32)\n",
        ("tests/test_moe_grouped.py",),
    ),
    Mutation(
        "local_dispatch_token_major",
        "the sync-free dispatch orders routed rows token-major: experts get other tokens' rows",
        "stages/trainer/local_dispatch.py",
        "    flat = routing_map.T.reshape(-1)  # [E * T], expert-major\n",
        "    flat = routing_map.reshape(-1)  # [E * T], expert-major\n",
        ("tests/test_moe_grouped.py",),
    ),
    Mutation(
        "grouped_load_fc2_untransposed",
        "HF expert down_proj weights loaded into the grouped layout without transposing: wrong experts' math",
        "stages/trainer/moe.py",
        '        out[p + "weight2"] = torch.stack([w.t() for w in fc2]).contiguous().view(-1, h)\n',
        '        out[p + "weight2"] = torch.stack(fc2).contiguous().view(-1, h)\n',
        ("tests/test_moe_grouped.py", "tests/test_moe.py::test_logits_match_hf"),
    ),
    Mutation(
        "glm_routed_scaling_dropped",
        "GLM-4.5's routed_scaling_factor is not applied: the trainer's expert outputs are 1/2.5 of the engine's",
        "stages/trainer/moe_config.py",
        "            moe_router_topk_scaling_factor=float(hc.routed_scaling_factor),\n",
        "            moe_router_topk_scaling_factor=None,\n",
        ("tests/test_moe_families.py",),
    ),
    # -- issue #36: exactly-once fetches, control validation, fetch leases, serve errors --------------
    Mutation(
        "fetch_resend_not_replayed",
        "a resend of a fetch the buffer served before it died gets other rows: the logged rows are lost",
        "buffer/fetch_room.py",
        "        if last is not None and last[0] == msg.req:  # its reply was lost (or crossed this resend)\n",
        "        if False:\n",
        (
            "tests/test_buffer_exactly_once.py::test_sigkill_between_served_fsync_and_send_resend_gets_the_same_rows",
        ),
    ),
    Mutation(
        "served_log_without_fetch_id",
        "the consumption log does not say which fetch its rows answered: a restarted buffer cannot replay",
        "buffer/storage.py",
        '            self._log.append("served", version, uids, consumer, req)\n',
        '            self._log.append("served", version, uids)\n',
        (
            "tests/test_buffer_exactly_once.py::test_sigkill_between_served_fsync_and_send_resend_gets_the_same_rows",
        ),
    ),
    Mutation(
        "fetch_before_segment_durable",
        "rows are served (and logged) before their segment write is durable: a crash loses the replay",
        "buffer/storage.py",
        "            if need > self._writer.durable:\n",
        "            if False:\n",
        ("tests/test_buffer_exactly_once.py::test_fetch_waits_for_its_rows_segment_write",),
    ),
    Mutation(
        "client_fetch_new_id_after_giving_up",
        "a fetch that gave up takes a new request id next time: rows served to the old one are lost",
        "buffer/client.py",
        "        if self._fetch_req is None:\n            self._fetch_req = next(self._req) + (1 << 40)\n",
        "        self._fetch_req = next(self._req) + (1 << 40)\n",
        ("tests/test_buffer_exactly_once.py::test_a_fetch_that_gave_up_keeps_its_request_id",),
    ),
    Mutation(
        "acknowledged_fetch_served_again",
        "a late resend of a fetch the consumer already acknowledged consumes new rows",
        "buffer/fetch_room.py",
        "        if key in self._served:\n            return\n",
        "",
        ("tests/test_buffer_exactly_once.py::test_resends_in_each_order_consume_one_group",),
    ),
    Mutation(
        "control_messages_unvalidated",
        "set_version(-7) / fetch at version -5 accepted: live rows evicted, absurd versions stored",
        "buffer/wire.py",
        "    check_request(msg)\n",
        "",
        ("tests/test_buffer_exactly_once.py",),
    ),
    Mutation(
        "reward_unbounded",
        "a reward of 2e6 (a sentinel or overflow) is stored and dominates its group's advantages",
        "buffer/values.py",
        "MAX_ABS_REWARD = 1e6\n",
        'MAX_ABS_REWARD = float("inf")\n',
        ("tests/test_buffer_exactly_once.py::test_samples_with_insane_rewards_or_timestamps_are_refused",),
    ),
    Mutation(
        "timestamps_unbounded",
        "created_at in milliseconds (or NaN) is stored as if it were unix seconds",
        "buffer/values.py",
        "MAX_TIMESTAMP = float(2**32)\n",
        'MAX_TIMESTAMP = float("inf")\n',
        ("tests/test_buffer_exactly_once.py::test_samples_with_insane_rewards_or_timestamps_are_refused",),
    ),
    Mutation(
        "fetch_lease_ignored",
        "a dead trainer's parked fetch takes the next groups, for nobody",
        "buffer/fetch_room.py",
        "        self._expire_leases(now)  # before anything is served: a requester that is gone gets nothing\n",
        "",
        ("tests/test_buffer_exactly_once.py::test_a_dead_consumers_parked_fetch_consumes_nothing",),
    ),
    Mutation(
        "serve_error_traceback",
        "python -m buffer serve prints a traceback for a bad argument",
        "buffer/__main__.py",
        "        except (ValueError, OSError, RuntimeError, TimeoutError, msgspec.ValidationError) as e:\n",
        "        except ZeroDivisionError as e:\n",
        ("tests/test_buffer_exactly_once.py::test_serve_bad_argument_is_one_line_without_traceback",),
    ),
    Mutation(
        "trainer_fetch_staleness_plus_one",
        "the trainer asks the buffer for one version more of staleness: samples past the bound are trained",
        "stages/trainer/feed.py",
        "        tc, staleness = self.tc, self.run.max_staleness\n",
        "        tc, staleness = self.tc, self.run.max_staleness + 1\n",
        (
            "tests/test_promises.py::test_a_sample_exactly_max_staleness_old_is_trained_and_an_older_one_never",
        ),
    ),
    Mutation(
        "trainer_fetch_version_ahead",
        "the trainer fetches as one version ahead: samples exactly at the staleness bound are evicted untrained",
        "stages/trainer/feed.py",
        "                return _delivered(self.source.fetch(tc.batch_groups, version, staleness, left))\n",
        "                return _delivered(self.source.fetch(tc.batch_groups, version + 1, staleness, left))\n",
        (
            "tests/test_promises.py::test_a_sample_exactly_max_staleness_old_is_trained_and_an_older_one_never",
        ),
    ),
    Mutation(
        "lr_schedule_restarts_on_resume",
        "a resumed trainer starts the learning-rate schedule (warmup, cosine) over",
        "stages/trainer/trainer.py",
        "        lr = lr_at(self.tc, self.version, self.run.steps)\n",
        "        lr = lr_at(self.tc, self.version - self.start_version, self.run.steps)\n",
        ("tests/test_promises.py::test_the_learning_rate_after_a_resume_is_the_uninterrupted_runs",),
    ),
    Mutation(
        "skipped_step_advances_version",
        "a step skipped as non-finite still advances the policy version",
        "stages/trainer/trainer.py",
        "        if self._applied:  # a skipped step leaves the policy, and so its version, as it was\n",
        "        if True:\n",
        ("tests/test_bad_values.py::test_a_nan_reward_changes_no_weight_and_the_next_step_trains",),
    ),
    Mutation(
        "heal_admits_a_fresh_window",
        "a healed generator's admission starts from zero: it over-generates and the surplus is evicted",
        "stages/rollout/position.py",
        "            self._admission.resume(len(live), version)\n",
        "            pass\n",
        ("tests/test_generator_resume.py",),
    ),
    Mutation(
        "heal_redraws_acked_prompts",
        "a healed generator draws again prompts whose groups its predecessor got acked",
        "stages/rollout/position.py",
        "            if pos in self.skip:  # settled by an earlier incarnation: never drawn twice\n",
        "            if False:\n",
        ("tests/test_generator_resume.py",),
    ),
    Mutation(
        "lora_tp_grads_not_summed",
        "LoRA under TP: the adapter gradients each rank holds a part of are never summed",
        "stages/trainer/lora.py",
        "                    torch.distributed.all_reduce(grad, group=group)\n",
        "                    pass\n",
        ("tests/test_lora.py::test_a_parallel_layout_trains_the_adapters_as_one_rank_does",),
    ),
    Mutation(
        "lora_base_trains",
        "LoRA: the base weights are not frozen (full fine-tuning with adapters on top)",
        "stages/trainer/lora.py",
        "    model.requires_grad_(False)\n",
        "",
        ("tests/test_lora.py::test_only_the_adapted_tensors_train",),
    ),
    Mutation(
        "lora_merge_unscaled",
        "LoRA: the merged push forgets alpha/r (the engine samples another policy than the trainer's)",
        "stages/trainer/lora.py",
        "        return (self.B.float() * self.mask) @ self.A.float() * self.scale\n",
        "        return (self.B.float() * self.mask) @ self.A.float()\n",
        (
            "tests/test_lora.py::test_a_merged_push_sends_the_adapted_tensors_and_the_engine_samples_the_trainers_policy",
            "tests/test_lora.py::test_the_peft_export_loads_in_peft_and_gives_the_trainers_logits",
        ),
    ),
    Mutation(
        "lora_reference_keeps_adapters",
        "LoRA: the KL reference runs with the adapters on (the KL to the base is always zero)",
        "stages/trainer/megatron_backend.py",
        "        with self.policy.lora.disabled() if base_only else contextlib.nullcontext():\n",
        "        with contextlib.nullcontext():\n",
        (
            "tests/test_lora.py::test_a_merged_push_sends_the_adapted_tensors_and_the_engine_samples_the_trainers_policy",
        ),
    ),
    Mutation(
        "lora_push_everything",
        "LoRA: a push sends every tensor of the model, not only those with adapters",
        "stages/trainer/export.py",
        "        return self.policy.lora is not None\n",
        "        return False\n",
        (
            "tests/test_lora.py::test_a_merged_push_sends_the_adapted_tensors_and_the_engine_samples_the_trainers_policy",
        ),
    ),
    Mutation(
        "lora_checkpoint_whole_model",
        "LoRA: checkpoints hold the whole frozen base beside the adapters",
        "stages/trainer/checkpoint.py",
        "            model_sd = {k: v for k, v in model_sd.items() if self.keep(k)}\n",
        "            pass\n",
        ("tests/test_lora.py::test_a_checkpoint_holds_the_adapters_only_and_resumes_exactly",),
    ),
    Mutation(
        "heal_misses_the_batch_in_training",
        "a generator healed while the trainer trains on a batch counts that batch as still in the buffer",
        "stages/rollout/position.py",
        "        version += 1\n",
        "        pass\n",
        ("tests/test_heal_evictions.py",),
    ),
    Mutation(
        "lora_modules_to_save_frozen",
        "LoRA: the modules named in modules_to_save stay frozen",
        "stages/trainer/lora.py",
        "        if key in whole:\n            p.requires_grad_(True)\n",
        "        if key in whole:\n            pass\n",
        ("tests/test_lora.py::test_modules_to_save_train_whole_and_under_tp_as_on_one_rank",),
    ),
    Mutation(
        "lora_recompute_trains_nothing",
        "LoRA with activation recompute: the frozen embedding's output needs no gradient, so none flows",
        "stages/trainer/lora.py",
        "        embedding.register_forward_hook(_needs_grad)\n",
        "        pass\n",
        ("tests/test_lora.py::test_activation_recompute_trains_the_adapters_as_without",),
    ),
    Mutation(
        "overlong_penalty_dropped",
        "DAPO's overlong penalty never reaches the rewards",
        "stages/trainer/shaping.py",
        '        changes["rewards"] = tb.rewards + overlong_penalty(\n',
        '        changes["rewards"] = tb.rewards + 0 * overlong_penalty(\n',
        ("tests/test_slime_knobs.py",),
    ),
    Mutation(
        "mask_truncated_ignored",
        "trainer.loss.mask_truncated trains the truncated samples' tokens all the same",
        "stages/trainer/shaping.py",
        '        changes["mask"] = tb.mask * (~tb.truncated)[tb.seq].float()\n',
        '        changes["mask"] = tb.mask\n',
        ("tests/test_slime_knobs.py",),
    ),
    Mutation(
        "ref_load_ignored",
        "trainer.ref_load is ignored: the KL is always to the initial weights",
        "stages/trainer/megatron_backend.py",
        "            self.ref = build_policy(tc.ref_load or model_path, **self.arch, ddp=False)\n",
        "            self.ref = build_policy(model_path, **self.arch, ddp=False)\n",
        ("tests/test_slime_knobs.py::test_ref_load_takes_the_kl_reference_from_another_model",),
    ),
    Mutation(
        "load_ignores_ckpt_step",
        "trainer.ckpt_step is ignored: a run always starts from trainer.load's latest checkpoint",
        "stages/trainer/checkpoint.py",
        '    if step:\n        path = os.path.join(root, f"step_{step:06d}")\n',
        '    if False:\n        path = os.path.join(root, f"step_{step:06d}")\n',
        (
            "tests/test_convert.py::test_a_run_starts_from_another_runs_checkpoint_at_its_version_or_fresh_with_finetune",
        ),
    ),
    Mutation(
        "trainer_hook_before_train_step_skipped",
        "trainer.hooks.before_train_step is never called",
        "stages/trainer/trainer.py",
        '        self.hooks.call("before_train_step", self._hook_context(), tb)\n',
        "",
        ("tests/test_trainer_hooks.py",),
    ),
    Mutation(
        "fsdp_positions_run_across_segments",
        "fsdp backend: packed sequences see each other (positions run on across the row's segments)",
        "stages/trainer/fsdp_model.py",
        "            input_ids=tokens, position_ids=segment_positions(segments), use_cache=False, **packed\n",
        "            input_ids=tokens, use_cache=False, **packed\n",
        (
            "tests/test_fsdp_backend.py::test_fsdp_trains_as_megatron",
            "tests/test_fsdp_backend.py::test_logprobs_equal_megatron_in_fp32",
        ),
    ),
    Mutation(
        "agent_turn_reencoded",
        "agent endpoint: a model turn is stored as other tokens than the engine sampled (here: reordered)",
        "stages/rollout/agent_session.py",
        "        ids = [int(t) for t in res.response_ids]\n",
        "        ids = [int(t) for t in reversed(res.response_ids)]\n",
        ("tests/test_agent_episodes.py",),
    ),
    Mutation(
        "agent_no_session_affinity",
        "engine pool: the calls of one agent episode go to whichever engine is least loaded",
        "stages/rollout/engine_pool.py",
        "        k = self._pinned.get(key) if key else None\n",
        "        k = None\n",
        ("tests/test_agent_endpoint.py",),
    ),
    Mutation(
        "topk_joint_filter_ignores_top_p",
        "top-k with top-p: the nucleus is not applied where top-k is on (SGLang filters jointly)",
        "stages/rollout/sampling.py",
        "        keep_sorted = (mass_before < top_p.to(logits.dtype)[:, None]) | ~needs_nucleus[:, None]\n",
        "        keep_sorted = (mass_before < top_p.to(logits.dtype)[:, None]) | ~needs_nucleus[:, None] | needs_top_k[:, None]\n",
        ("tests/test_rollout_sampling_knobs.py",),
    ),
    Mutation(
        "torch_engine_drops_top_k",
        "the torch engine samples without rollout.sampling.top_k",
        "stages/rollout/torch_engine.py",
        "        tokens, logps = sample(logits, temps, top_p, self._gen, top_k, seeds=seeds, positions=positions)\n",
        "        tokens, logps = sample(logits, temps, top_p, self._gen, seeds=seeds, positions=positions)\n",
        ("tests/test_rollout_engine.py",),
    ),
    Mutation(
        "torch_stop_string_ignored",
        "the torch engine never stops at a rollout.sampling.stop string",
        "stages/rollout/torch_engine.py",
        "            s.matched = s.stop_text.match(s.out)\n",
        "            s.matched = None\n",
        ("tests/test_rollout_sampling_knobs.py",),
    ),
    Mutation(
        "sglang_stop_keeps_chunk_rest",
        "SGLang: tokens streamed after the one that completed a stop string are kept",
        "stages/rollout/sglang_engine.py",
        "                        del ids[cut:], lps[cut:], vers[cut:]\n",
        "                        pass\n",
        ("tests/test_rollout_sampling_knobs.py",),
    ),
    Mutation(
        "sglang_owned_flag_passed_through",
        "rollout.sglang.extra_args may repeat a flag slipstream sets itself (silently overriding it)",
        "stages/rollout/sglang_args.py",
        "        if flag in OWNED:\n",
        "        if False:\n",
        ("tests/test_rollout_sampling_knobs.py",),
    ),
    Mutation(
        "multiturn_stop_string_glue",
        "multi-turn: a turn ended by a stop string loses its last text token as if it were the stop token",
        "stages/rollout/multiturn.py",
        "        self._last_stop = stop_token_of(res)  # None after a stop string: its last token is text\n",
        '        self._last_stop = res.response_ids[-1] if res.finish_reason == "stop" else None\n',
        ("tests/test_rollout_sampling_knobs.py",),
    ),
    Mutation(
        "offload_restore_zeroes",
        "a wake gives the memory back but not its bytes: weights come back as zeros",
        "stages/host_copy.py",
        "                    dst.copy_(p.host, non_blocking=cuda)\n",
        "                    dst.zero_()\n",
        (
            "tests/test_offload.py::test_trainer_state_round_trip_is_bit_identical_and_training_goes_on_as_without",
            "tests/test_offload.py::test_torch_engine_releases_holds_requests_and_wakes_bit_identical",
        ),
    ),
    Mutation(
        "offload_push_before_wake",
        "the hand-over pushes into engines whose weights are still released",
        "pipeline/orchestration/handover.py",
        '        woke = self._on_generators("resume_memory", [t for t in self.tags if t == WEIGHTS])\n'
        '        m = self.healer.on_ranks(step, "push_turn")\n',
        '        m = self.healer.on_ranks(step, "push_turn")\n'
        '        woke = self._on_generators("resume_memory", [t for t in self.tags if t == WEIGHTS])\n',
        ("tests/test_offload_pipeline.py::test_sync_run_with_offload_trains_as_the_run_without",),
    ),
    Mutation(
        "sglang_kv_wake_tags",
        "the KV wake leaves SGLang's CUDA graphs released",
        "stages/rollout/sglang_process.py",
        'SGLANG_TAGS = {WEIGHTS: ("weights",), KV_CACHE: ("kv_cache", "cuda_graph")}',
        'SGLANG_TAGS = {WEIGHTS: ("weights",), KV_CACHE: ("kv_cache",)}',
        ("tests/test_offload.py::test_sglang_release_and_wake_post_the_tags_and_hold_requests_between",),
    ),
    Mutation(
        "lora_expert_fc1_unmasked",
        "gate's and up's B share every fc1 adapter column: the expert adapters are no longer PEFT's pairs",
        "stages/trainer/lora_experts.py",
        "            return (self.A1, self.B1 * self.mask1) if self.fc1_parts else None\n",
        "            return (self.A1, self.B1) if self.fc1_parts else None\n",
        (
            "tests/test_lora_moe.py::test_the_peft_export_covers_the_experts_loads_in_peft_and_gives_the_trainers_logits",
            "tests/test_lora_moe.py::test_an_adapter_push_sends_the_adapters_only_and_the_engine_computes_the_merged_policy",
        ),
    ),
    Mutation(
        "lora_adapter_push_unscaled",
        "the adapter push drops alpha/r: the torch engine samples another policy than the trainer's",
        "stages/trainer/lora_peft.py",
        "            t = t * scale\n",
        "            pass\n",
        (
            "tests/test_adapter_push_fast.py",
            "tests/test_lora_moe.py::test_an_adapter_push_sends_the_adapters_only_and_the_engine_computes_the_merged_policy",
        ),
    ),
    Mutation(
        "distill_coef_dropped",
        "trainer.distill names the teacher but its coefficient never reaches the loss: nothing distils",
        "stages/trainer/distill.py",
        "    setattr(tc.loss, key, d.coef)\n",
        "",
        (
            "tests/test_slime_knobs.py::test_distill_points_the_kl_reference_at_the_teacher_and_reloads_as_it_was",
            "tests/test_slime_knobs.py::test_distill_moves_the_student_toward_the_teacher_in_either_mode",
        ),
    ),
    Mutation(
        "async_commit_after_failed_write",
        "a checkpoint whose shards failed to write on some rank is committed all the same",
        "stages/trainer/async_checkpoint.py",
        "    if rank == 0 and outcome is None:\n",
        "    if rank == 0:\n",
        ("tests/test_async_checkpoint.py::test_a_failed_write_leaves_the_previous_checkpoint_the_latest",),
    ),
    Mutation(
        "sampling_seed_per_incarnation",
        "a resumed generator's sampling seeds follow its incarnation: prompts drawn again are sampled anew",
        "stages/rollout/position.py",
        '        stream = self.id.split(".", 1)[0]\n',
        "        stream = self.id\n",
        (
            "tests/test_generator_resume.py::test_a_resumed_generator_samples_the_tokens_an_uninterrupted_one_samples",
        ),
    ),
    Mutation(
        "elastic_leaving_generator_still_watched",
        "a leaving generator's run() stays on the healing watch: its end during the drain stops the run",
        "pipeline/orchestration/supervisors.py",
        "        self.runs.pop(run, None)  # its run() ending is no longer a death to heal",
        "        self.runs.get(run, None)  # its run() ending is no longer a death to heal",
        ("tests/test_elastic.py::test_a_generator_added_and_one_removed_mid_run_loses_and_repeats_nothing",),
    ),
    Mutation(
        "elastic_rebase_ignores_the_buffer",
        "after a generator count change the admission window is not re-based on the buffer's tally",
        "stages/rollout/admission.py",
        "        self._kept_offset = live - running - buffered - trainer_version * batch_groups\n",
        "        self._kept_offset = 0\n",
        (
            "tests/test_elastic.py::test_a_rebase_counts_the_window_from_the_buffers_tally_whatever_share_was_taken_before",
        ),
    ),
    Mutation(
        "sft_tokens_left_in_rl_mask",
        "SFT rows' tokens also stay in the RL loss's mask: they get a policy gradient with a made-up advantage",
        "stages/trainer/sft.py",
        "        tb, mask=tb.mask * (1.0 - on), sft_mask=tb.mask * on,",
        "        tb, mask=tb.mask, sft_mask=tb.mask * on,",
        (
            "tests/test_sft.py::test_a_trainer_lowers_the_nll_of_its_sft_rows_and_reports_rl_metrics_of_the_rl_samples",
        ),
    ),
    Mutation(
        "sft_nll_sign_flipped",
        "the SFT term raises the NLL of the demonstrations instead of lowering it",
        "stages/trainer/losses.py",
        "        nll = -torch.where(sft_on, raw_logp, torch.zeros_like(raw_logp))",
        "        nll = torch.where(sft_on, raw_logp, torch.zeros_like(raw_logp))",
        (
            "tests/test_sft.py::test_the_sft_term_is_their_token_nll_in_one_mean_with_the_rl_tokens",
            "tests/test_sft.py::test_a_trainer_lowers_the_nll_of_its_sft_rows_and_reports_rl_metrics_of_the_rl_samples",
        ),
    ),
    Mutation(
        "sft_trains_every_turn",
        "step_loss_mask 0 is ignored: assistant turns the data marks as context are trained too",
        "stages/trainer/sft.py",
        '        if messages[i].get("step_loss_mask", 1):',
        "        if True:",
        (
            "tests/test_sft.py::test_a_conversation_trains_its_assistant_turns_and_their_end_of_turn_but_no_other_text",
        ),
    ),
    Mutation(
        "partial_rollout_trains_kept_tokens",
        "a recycled group's kept tokens, from past the staleness bound, are trained as if fresh",
        "stages/rollout/partial.py",
        "            loss_mask=[0] * kept + [1] * len(res.response_ids),",
        "            loss_mask=[1] * kept + [1] * len(res.response_ids),",
        (
            "tests/test_partial_rollout.py::test_continuing_keeps_every_token_once_and_a_finished_sample_untrained",
        ),
    ),
    Mutation(
        "partial_rollout_drops_kept_tokens",
        "a recycled sample keeps only its continuation: the tokens generated before the interrupt are lost",
        "stages/rollout/partial.py",
        '            response_ids=[*s.array("response_ids").tolist(), *res.response_ids],',
        "            response_ids=list(res.response_ids),",
        (
            "tests/test_partial_rollout.py::test_continuing_keeps_every_token_once_and_a_finished_sample_untrained",
        ),
    ),
    Mutation(
        "min_version_counts_untrained_tokens",
        "the buffer's staleness counts untrained tokens too: a recycled group is evicted for its context",
        "buffer/record.py",
        "    vals = np.where(trained, vals, _UNTRAINED)",
        "    vals = vals",
        (
            "tests/test_partial_rollout.py::test_continuing_keeps_every_token_once_and_a_finished_sample_untrained",
        ),
    ),
    Mutation(
        "torch_engine_ignores_interrupt",
        "the torch engine decodes an interrupted request to its end",
        "stages/rollout/torch_engine.py",
        '        if s.cancelled or interrupted(s.req):\n            return "abort"',
        '        if s.cancelled:\n            return "abort"',
        (
            "tests/test_partial_rollout.py::test_the_torch_engine_ends_an_interrupted_request_with_the_tokens_it_has",
        ),
    ),
    Mutation(
        "partial_rollout_cancels_stale_groups",
        "with partial_rollout on, a stale group is still cancelled and its tokens dropped",
        "stages/rollout/admission.py",
        "            if keep_partial:",
        "            if False:",
        (
            "tests/test_partial_rollout.py::test_a_stale_group_continues_from_its_tokens_which_stay_untrained_with_their_versions",
        ),
    ),
    Mutation(
        "evictions_do_not_recount_admission",
        "a generator told its groups were evicted keeps its admission count: a surplus lives on, one eviction after another",
        "stages/rollout/position.py",
        "                await self.recount_from_buffer(self.batch_groups)\n",
        "                pass\n",
        (
            "tests/test_elastic.py::test_a_generator_whose_groups_were_evicted_recounts_its_window_from_the_buffers_tally",
        ),
    ),
    Mutation(
        "prefix_cache_key_not_moved_at_update",
        "with the radix cache on, requests sent during and after a push keep the old weights' cache key",
        "stages/rollout/sglang_updates.py",
        "leaves an empty namespace: misses only)\n            self.cache_namespace = self._cache_key_for(version)\n",
        "leaves an empty namespace: misses only)\n",
        (
            "tests/test_prefix_cache.py::test_with_the_radix_cache_requests_are_keyed_by_the_weight_version_they_are_sent_for",
        ),
    ),
    Mutation(
        "engine_handle_without_affinity",
        "a group's (or an episode's) calls spread over the pool's engines, away from their cached prompt",
        "stages/rollout/hooks.py",
        '        self._affinity = rid_prefix if affinity else ""',
        '        self._affinity = ""',
        (
            "tests/test_prefix_cache.py::test_every_call_of_a_group_goes_to_one_engine_of_a_pool_and_groups_still_spread",
        ),
    ),
    Mutation(
        "sft_rows_all_in_last_update",
        "with trainer.mini_batches > 1 every SFT row lands in the last update",
        "stages/trainer/packing.py",
        "rows[k * len(rows) // m : (k + 1) * len(rows) // m]",
        "(rows if k == m - 1 else [])",
        ("tests/test_sft.py::test_each_update_of_a_batch_trains_its_share_of_the_sft_rows",),
    ),
    Mutation(
        "world_left_under_a_running_writer",
        "a rank leaves the world at once at its normal end, under a checkpoint writer still committing",
        "stages/trainer/world.py",
        "    atexit.register(leave_world)",
        "    leave_world()",
        ("tests/test_world.py",),
    ),
    Mutation(
        "sglang_lora_tokens_take_the_chunk_stamp",
        "under SGLang LoRA serving a request's tokens take the server's version stamp, not their adapter's",
        "stages/rollout/sglang_engine.py",
        "v = fixed if fixed is not None else stamp if stamp == prev else min(prev, stamp)",
        "v = stamp if stamp == prev else min(prev, stamp)",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "sglang_lora_unloads_an_adapter_in_use",
        "an SGLang adapter that requests in flight still use is unloaded at the next push",
        "stages/rollout/sglang_lora.py",
        "if n != current and not self._in_flight[n]]",
        "if n != current]",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "sglang_lora_relaunch_keeps_adapters",
        "a relaunched SGLang server is still sent requests under an adapter it no longer holds",
        "stages/rollout/sglang_engine.py",
        "                self.served.forget()",
        "                pass",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "sglang_lora_scales_twice",
        "the adapter is announced with an alpha that scales the already scaled B again",
        "stages/rollout/sglang_lora.py",
        '"lora_alpha": rank,',
        '"lora_alpha": 2 * rank,',
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "lora_init_from_not_pushed_at_start",
        "adapters started from a PEFT folder are not pushed before the first step: v0 samples come from the base",
        "stages/trainer/trainer.py",
        "self.engines_start_behind = bool(state) or bool(tc.lora.rank and tc.lora.init_from)",
        "self.engines_start_behind = bool(state)",
        (
            "tests/test_lora.py::test_adapters_from_a_peft_folder_make_the_launcher_push_before_the_first_step",
        ),
    ),
    Mutation(
        "teacher_logprobs_shifted_by_one",
        "a served teacher's answer is read from its first entry (the last prompt token's) on",
        "stages/rollout/teacher.py",
        "lps = np.asarray([e[0] for e in entries[1:]], dtype=np.float64)",
        "lps = np.asarray([e[0] or 0.0 for e in entries[:-1]], dtype=np.float64)",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "generator_never_asks_the_teacher",
        "the generator does not ask the served teacher to score its samples",
        "stages/rollout/generator.py",
        "            await self.teacher.annotate(samples)",
        "            pass",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "trainer_ignores_the_served_teacher",
        "with trainer.distill.server the trainer takes no reference logprobs from the samples",
        "stages/trainer/trainer.py",
        "        if self.tc.distill.server:",
        "        if False:",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "buffer_takes_misaligned_teacher_logprobs",
        "the buffer's columnar check lets teacher_logprobs of another length than the response through",
        "buffer/validate.py",
        "bad = (taught > 0) & (taught != np.diff(ref))",
        "bad = taught < 0",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "teacherless_batch_crashes",
        "a batch in which no sample carries teacher logprobs (all failed) crashes the trainer",
        "stages/trainer/distill.py",
        "    if tb.teacher_logprobs is None:  # nothing to score",
        "    if False:  # nothing to score",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "gone_adapter_unloaded_for_ever",
        "an adapter SGLang no longer has is asked to unload again at every push",
        "stages/rollout/sglang_updates.py",
        "                        self.served.unloaded(old)\n",
        "                        pass\n",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "served_teacher_url_unchecked",
        "a distill.server that is no URL reaches the generators, whose every sample then fails",
        "stages/rollout/run.py",
        '    if server and not server.startswith(("http://", "https://")):',
        "    if False:",
        ("tests/test_served_teacher.py",),
    ),
    Mutation(
        "finetune_start_not_awaited",
        "generators of a run started from trainer.load + finetune generate before the trainer's first push",
        "pipeline/config.py",
        "return bool((t.lora.rank and t.lora.init_from) or (t.load and t.finetune))",
        "return bool(t.lora.rank and t.lora.init_from)",
        (
            "tests/test_lora.py::test_generators_wait_for_the_first_push_when_version_0_is_not_the_model_folders",
        ),
    ),
    Mutation(
        "generator_never_connects_weights",
        "a generator started before the trainer's sender (SGLang, weights.transport cpu) never takes its pushes",
        "pipeline/orchestration/actors.py",
        "            self.receiver = WeightReceiver(address, self.engine, name=self.id, curve=self.curve)",
        "            pass",
        ("tests/test_generator_weights.py",),
    ),
    Mutation(
        "generator_does_not_wait_for_first_push",
        "with version 0 elsewhere (lora.init_from) a generator samples the model folder's weights as v0",
        "pipeline/orchestration/actors.py",
        "        await self._first_weights()\n",
        "",
        ("tests/test_generator_weights.py",),
    ),
    Mutation(
        "fsdp_varlen_one_sequence_per_row",
        "fsdp backend, trainer.attention=varlen: a packed row is attended as one sequence (no boundaries)",
        "stages/trainer/fsdp_backend.py",
        '        return {"cu_seqlens": mb.cu_seqlens.to(self.device), "max_segment_len": mb.max_segment_len}\n',
        '        return {"cu_seqlens": mb.cu_seqlens[[0, -1]].to(self.device), "max_segment_len": mb.tokens.numel()}\n',
        ("tests/test_fsdp_backend.py::test_packed_varlen_rows_give_the_same_logprobs",),
    ),
    Mutation(
        "save_at_end_ignored",
        "trainer.save_at_end=false still writes the final checkpoint (a 7B bench run writes ~100 GB at its end)",
        "stages/trainer/trainer.py",
        "        save = save and self.tc.save_at_end\n",
        "",
        ("tests/test_shutdown.py::test_save_at_end_off_leaves_no_final_checkpoint_and_on_saves_one",),
    ),
    Mutation(
        "ipc_server_device_ignored",
        "cuda_ipc: a server on another GPU is handed memory of the trainer's GPU (it died copying it, 2 H200s)",
        "stages/weights/cuda_ipc_sender.py",
        '        return torch.device("cuda", gpus[url]) if gpus[url] != default.index else default\n',
        "        return default\n",
        ("tests/test_cuda_ipc_devices.py",),
    ),
    Mutation(
        "lora_bf16_merge_unscaled",
        "LoRA: a bf16 merged push adds B.A without alpha/r",
        "stages/trainer/lora.py",
        "            return torch.addmm(weight, b, adapter.A.detach().to(weight.dtype), alpha=adapter.scale)\n",
        "            return torch.addmm(weight, b, adapter.A.detach().to(weight.dtype))\n",
        ("tests/test_lora.py::test_a_bf16_merge_is_the_fp32_merge_rounded_once",),
    ),
    Mutation(
        "release_without_waiting_for_idle",
        "offload: SGLang memory released while its scheduler may still be busy (the release kills the server)",
        "stages/rollout/sglang_process.py",
        "            self._wait_idle(deadline)\n",
        "            pass\n",
        ("tests/test_offload.py",),
    ),
    Mutation(
        "fsdp_compile_ignored",
        "trainer.fsdp_compile=true compiles nothing",
        "stages/trainer/fsdp_model.py",
        "            compile_layer(layer)\n",
        "            pass\n",
        ("tests/test_fsdp_backend.py::test_compiled_layers_give_the_same_logprobs",),
    ),
    Mutation(
        "healed_sglang_generator_keeps_old_servers",
        "a dead SGLang generator's servers are left running when its successor starts (GPU and ports held)",
        "pipeline/orchestration/supervisors.py",
        "            self._end_servers(i, ports)\n",
        "            pass\n",
        ("tests/test_sglang_heal.py",),
    ),
    Mutation(
        "healed_sglang_generator_new_ports",
        "a healed SGLang generator's servers start on new ports the trainer's sender does not know",
        "pipeline/orchestration/supervisors.py",
        "        self.actors[i] = self._launch(i, ports=ports or None)\n",
        "        self.actors[i] = self._launch(i)\n",
        ("tests/test_sglang_heal.py",),
    ),
    Mutation(
        "hung_pause_fails_the_push",
        "a server that does not answer a pause (hung in a dead trainer's broadcast) fails the new trainer's push",
        "stages/weights/sglang_transport.py",
        "                e.unreachable, e.url = True, url\n",
        "                pass\n",
        (
            "tests/test_weights_sglang_protocol.py::test_a_server_that_does_not_answer_the_pause_is_left_out_as_a_restarting_one",
        ),
    ),
    Mutation(
        "sglang_offload_run_healed",
        "a dead stage of an SGLang run with cluster.offload is restarted mid-turn beside the other side's state",
        "pipeline/orchestration/healing.py",
        '        if self.cfg.rollout.engine == "sglang" and self.cfg.cluster.offload.on:\n',
        "        if False:\n",
        ("tests/test_sglang_heal.py",),
    ),
    Mutation(
        "elastic_refuses_sglang_with_receivers",
        "SGLang generators that take pushes through receivers (weights.transport=cpu) cannot be scaled",
        "pipeline/orchestration/elastic.py",
        '        if cfg.rollout.engine == "sglang" and cfg.weights.transport != "cpu":\n',
        '        if cfg.rollout.engine == "sglang":\n',
        ("tests/test_elastic.py",),
    ),
    Mutation(
        "fsdp_one_rank_reshards_every_micro_batch",
        "the fsdp backend on one rank re-gathers and re-casts every layer for each micro-batch's forward and backward",
        "stages/trainer/fsdp_backend.py",
        "        return self.dp == 1 and not self.tc.fsdp_cpu_offload\n",
        "        return False\n",
        ("tests/test_fsdp_unshards.py",),
    ),
    Mutation(
        "fsdp_pass_leaves_layers_unsharded",
        "after a one-rank fsdp pass the layers keep their unsharded copies (the optimizer and exports see them)",
        "stages/trainer/fsdp_model.py",
        "            m.reshard()\n",
        "            pass\n",
        ("tests/test_fsdp_unshards.py",),
    ),
    Mutation(
        "adapter_folder_left_in_shm",
        "each adapter push to SGLang leaves its PEFT folder in /dev/shm (a run fills shared memory)",
        "stages/rollout/sglang_updates.py",
        "                shutil.rmtree(folder, ignore_errors=True)\n",
        "                pass\n",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "sglang_lora_offload_releases_weights",
        "colocated offload with LoRA releases SGLang's weights, which come back empty and are never all pushed again",
        "pipeline/orchestration/handover.py",
        '    if cfg.rollout.engine == "sglang" and cfg.trainer.lora.rank:\n',
        "    if False:\n",
        ("tests/test_handover_tags.py",),
    ),
    Mutation(
        "hung_server_relaunched_silently",
        "a hung SGLang server is relaunched without its stacks in its log (nothing says where it stopped)",
        "stages/rollout/sglang_engine.py",
        "                    dump_stacks(self._proc.pid, self.log_path)\n",
        "                    pass\n",
        ("tests/test_hung_server_stacks.py",),
    ),
    Mutation(
        "hung_server_dump_skips_children",
        "the stack dump of a hung server looks at no process of its group (SGLang's scheduler is a child)",
        "stages/rollout/sglang_process.py",
        "            pids.append(int(stat.parent.name))\n",
        "            pass\n",
        ("tests/test_hung_server_stacks.py", "tests/test_sglang_heal.py"),
    ),
    Mutation(
        "sync_save_writes_device_tensors",
        "a synchronous save hands megatron's writer the GPU tensors themselves, which it refuses: no GPU checkpoint",
        "stages/trainer/async_checkpoint.py",
        "    if all(t.is_cpu for _, t in tensor_items):\n",
        "    if True:\n",
        ("tests/test_async_checkpoint.py",),
    ),
    Mutation(
        "adapter_cast_whole_tensors",
        "each adapter is cast for its folder in one op, which starts a thread per core (3 s a push on a busy GPU host)",
        "stages/rollout/sglang_lora.py",
        "SERIAL_PIECE = 32767\n",
        "SERIAL_PIECE = 1 << 24\n",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "engine_version_never_goes_back",
        "a restarted trainer's older versions are never followed: admission counts from the dead trainer's version",
        "stages/rollout/sglang_version.py",
        "(v > self._version or (v < self._version and v == before))",
        "(v > self._version)",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "cache_epoch_kept_when_version_goes_back",
        "a resumed trainer's pushes reuse the first pass's cache keys: KV of other weights is matched",
        "stages/rollout/sglang_version.py",
        "            self.versions_went_back += 1\n",
        "            pass\n",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "adapter_push_waits_for_unloads",
        "an adapter push unloads the old adapters before it returns (10-13 ms more a push on an H200 server)",
        "stages/rollout/sglang_updates.py",
        "        self._unloads.start()\n",
        "        self._unloads.run()\n",
        ("tests/test_sglang_lora.py",),
    ),
    Mutation(
        "adapter_write_offsets_in_elements",
        "the adapter folder's safetensors header counts offsets in elements, not bytes: SGLang cannot load it",
        "stages/rollout/safetensors_write.py",
        "        begin, end = end, end + t.numel() * t.element_size()\n",
        "        begin, end = end, end + t.numel()\n",
        ("tests/test_adapter_push_fast.py",),
    ),
    Mutation(
        "adapter_push_cast_on_host",
        "the adapters leave the trainer's GPU in fp32 and are cast on the host (a host loop per tensor)",
        "stages/trainer/lora_peft.py",
        "        return n, (t if transform is None else transform(n, t)).cpu()\n",
        "        return n, (t.cpu() if transform is None else transform(n, t.cpu()))\n",
        ("tests/test_adapter_push_fast.py",),
    ),
    Mutation(
        "version_poll_takes_a_reading_from_before_a_push",
        "a version poll whose answer predates this client's own push sends the engine's version back",
        "stages/rollout/sglang_version.py",
        "                if self._version != asked_at:\n",
        "                if False:\n",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "fsdp_compile_recompiles_per_variant",
        "trainer.fsdp_compile compiles each layer as before the fix (static shapes, transformers' checkpoint, "
        "dynamo's limit of 8 and its silent eager fallback): new lengths recompile until the limit",
        "stages/trainer/fsdp_model.py",
        "            compile_layer(layer)\n",
        "            layer.compile()\n",
        ("tests/test_fsdp_compile.py",),
    ),
]


def copy_repo(dst: str) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
            shutil.copy2(src, os.path.join(dst, f))


def apply(copy: str, m: Mutation) -> None:
    path = os.path.join(copy, m.path)
    with open(path) as f:
        text = f.read()
    if text.count(m.old) != 1:
        raise SystemExit(
            f"mutation {m.name}: the snippet occurs {text.count(m.old)} times in {m.path} (expected once); "
            "update bench/mutations.py to the code as it is now"
        )
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def run_tests(copy: str, tests: tuple[str, ...], timeout_s: float) -> tuple[int, float, str]:
    env = dict(os.environ, PYTHONPATH=copy)
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, [f"timed out after {timeout_s:.0f}s"]
    return rc, time.monotonic() - t0, tail[0] if tail else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of mutation names")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per mutation")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "mutations.jsonl"))
    a = ap.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only.split(",")]
    t0 = time.monotonic()
    rows = []
    base = tempfile.mkdtemp(prefix="slipstream-mutations-")
    try:
        for m in chosen:
            copy = os.path.join(base, m.name)
            copy_repo(copy)
            apply(copy, m)
            rc, secs, tail = run_tests(copy, m.tests, a.timeout_s)
            # 1: tests failed (caught). 0: all passed (missed). Anything else: the run itself broke.
            verdict = {0: "MISSED", 1: "caught"}.get(rc, f"error rc={rc}")
            rows.append(
                {"name": m.name, "verdict": verdict, "seconds": round(secs, 1), "why": m.why, "tail": tail}
            )
            print(f"{m.name:28s} {verdict:8s} {secs:6.1f}s  {m.why}", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    missed = [r["name"] for r in rows if r["verdict"] != "caught"]
    out = {
        "caught": len(rows) - len(missed),
        "total": len(rows),
        "missed": missed,
        "seconds": round(time.monotonic() - t0, 1),
        "rows": rows,
    }
    record(out, a.results)


if __name__ == "__main__":
    main()
