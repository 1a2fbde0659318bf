"""A slime command line -> slipstream config overrides (docs/slime.md is the table for people; this is
the same table for programs):

    python -m pipeline.slime_args --hf-checkpoint /m --n-samples-per-prompt 8 --lr 1e-6 ...
    bin/run-pipeline $(python -m pipeline.slime_args <slime arguments>)

prints `a.b=c` overrides, one per line. A slime argument with no equivalent is refused by name (with
docs/slime.md's reason where there is one); megatron's model-architecture arguments (--num-layers,
--hidden-size, ...) are dropped: slipstream reads the architecture from the HF config.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

# slime flag -> (slipstream key, value converter or a fixed value for flags without one)
_Conv = Callable[[str], object]
VALUED: dict[str, tuple[str, _Conv]] = {
    "--hf-checkpoint": ("model.name", str),
    "--load": ("trainer.load", str),
    "--ckpt-step": ("trainer.ckpt_step", int),
    "--ref-load": ("trainer.ref_load", str),
    "--save-interval": ("trainer.checkpoint_every", int),
    "--tensor-model-parallel-size": ("trainer.tp", int),
    "--pipeline-model-parallel-size": ("trainer.pp", int),
    "--context-parallel-size": ("trainer.cp", int),
    "--expert-model-parallel-size": ("trainer.ep", int),
    "--expert-tensor-parallel-size": ("trainer.etp", int),
    "--recompute-method": ("trainer.recompute_method", str),
    "--recompute-num-layers": ("trainer.recompute_num_layers", int),
    "--max-tokens-per-gpu": ("trainer.micro_batch_tokens", int),
    "--actor-num-nodes": ("cluster.trainer_num_nodes", int),
    "--actor-num-gpus-per-node": ("cluster.trainer_gpus_per_node", int),
    "--rollout-num-gpus": ("cluster.rollout_num_gpus", int),
    "--rollout-num-gpus-per-engine": ("rollout.sglang.tp_size", int),
    "--sglang-mem-fraction-static": ("rollout.sglang.mem_fraction_static", float),
    "--prompt-data": ("rollout.data.source", str),
    "--input-key": ("rollout.data.prompt_key", str),
    "--label-key": ("rollout.data.label_key", str),
    "--n-samples-per-prompt": ("rollout.group_size", int),
    "--rollout-batch-size": ("trainer.batch_groups", int),
    "--num-steps-per-rollout": ("trainer.mini_batches", int),
    "--rollout-max-response-len": ("rollout.sampling.max_new_tokens", int),
    "--rollout-max-prompt-len": ("rollout.data.max_prompt_tokens", int),
    "--rollout-temperature": ("rollout.sampling.temperature", float),
    "--rollout-top-p": ("rollout.sampling.top_p", float),
    "--rollout-top-k": ("rollout.sampling.top_k", int),
    "--custom-generate-function-path": ("rollout.generate_fn", str),
    "--rollout-function-path": ("rollout.rollout_fn", str),
    "--custom-rm-path": ("rollout.reward.fn", str),
    "--rm-type": ("rollout.reward.fn", str),
    "--dynamic-sampling-filter-path": ("rollout.filter", str),
    "--eval-interval": ("eval.every_steps", int),
    "--num-rollout": ("run.steps", int),
    "--seed": ("run.seed", int),
    "--kl-loss-coef": ("trainer.loss.kl_coef", float),
    "--kl-loss-type": ("trainer.loss.kl_type", str),
    "--kl-coef": ("trainer.loss.kl_in_reward_coef", float),
    "--eps-clip": ("trainer.loss.eps_clip", float),
    "--eps-clip-high": ("trainer.loss.eps_clip_high", float),
    "--tis-clip": ("trainer.loss.tis_cap", float),
    "--entropy-coef": ("trainer.loss.entropy_coef", float),
    "--lr": ("trainer.lr", float),
    "--min-lr": ("trainer.min_lr", float),
    "--lr-decay-style": ("trainer.lr_schedule", str),
    "--lr-warmup-iters": ("trainer.warmup_steps", int),
    "--weight-decay": ("trainer.weight_decay", float),
    "--adam-beta1": ("trainer.adam_beta1", float),
    "--adam-beta2": ("trainer.adam_beta2", float),
    "--clip-grad": ("trainer.grad_clip", float),
}
FLAGS: dict[str, dict[str, object]] = {  # slime flags without a value
    "--finetune": {"trainer.finetune": True},
    "--no-load-optim": {"trainer.finetune": True},
    "--sequence-parallel": {"trainer.sequence_parallel": True},
    "--use-distributed-optimizer": {"trainer.distributed_optimizer": True},
    "--async-save": {"trainer.async_save": True},
    "--bf16": {"trainer.precision": "bf16"},
    "--colocate": {"cluster.colocate": True},  # and offload, as slime's (see OFFLOAD_KEYS)
    "--offload": {"cluster.offload.train": True, "cluster.offload.rollout": True},
    "--offload-train": {"cluster.offload.train": True},
    "--offload-rollout": {"cluster.offload.rollout": True},
    "--no-offload-train": {"cluster.offload.train": False},
    "--no-offload-rollout": {"cluster.offload.rollout": False},
    "--apply-chat-template": {"rollout.data.apply_chat_template": True},
    "--rollout-shuffle": {"rollout.data.shuffle": True},
    "--use-routing-replay": {"trainer.routing_replay": True},
    "--use-tis": {"trainer.loss.correction": "tis"},
    "--normalize-advantages": {"trainer.loss.ppo_whiten": "token"},
    "--calculate-per-token-loss": {"trainer.loss.aggregation": "token"},
    "--use-kl-loss": {},  # the KL is on when trainer.loss.kl_coef > 0 (--kl-loss-coef)
    "--partial-rollout": {"rollout.partial_rollout": True},
    # the recycled tokens are past run.max_staleness, so they are always context only (rollout.partial_rollout)
    "--mask-offpolicy-in-partial-rollout": {},
    "--use-dynamic-batch-size": {},  # micro-batches are always packed by tokens (trainer.micro_batch_tokens)
}
ESTIMATORS = {"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
# megatron model arguments of slime's scripts/models/*.sh: the HF config (model.name) says all of these
ARCHITECTURE = {
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--group-query-attention",
    "--num-query-groups",
    "--normalization",
    "--swiglu",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--use-rotary-position-embeddings",
    "--rotary-base",
    "--vocab-size",
    "--untie-embeddings-and-output-weights",
    "--norm-epsilon",
    "--kv-channels",
    "--qk-layernorm",
    "--max-position-embeddings",
    "--seq-length",
    "--position-embedding-type",
    "--moe-ffn-hidden-size",
    "--num-experts",
    "--moe-router-topk",
    "--moe-shared-expert-intermediate-size",
    "--moe-layer-freq",
    "--use-flash-attn",
    "--attention-dropout",
    "--hidden-dropout",
    "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32",
}
ARCHITECTURE_VALUELESS = {
    "--group-query-attention",
    "--swiglu",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--use-flash-attn",
    "--use-rotary-position-embeddings",
    "--untie-embeddings-and-output-weights",
    "--qk-layernorm",
    "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32",
}
OFFLOAD_KEYS = ("cluster.offload.train", "cluster.offload.rollout")


class SlimeArgsError(ValueError):
    """A slime argument this converter cannot translate."""


def to_overrides(argv: list[str]) -> list[str]:
    """slime's argument list -> `key=value` overrides for bin/run-pipeline / load_config."""
    out: dict[str, object] = {}
    unknown: list[str] = []
    global_batch = rollout_batch = samples = None
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        i += 1
        if flag in FLAGS:
            out.update(FLAGS[flag])
        elif flag in ARCHITECTURE:
            i += 0 if flag in ARCHITECTURE_VALUELESS or value is None else 1
        elif flag.startswith("--sglang-") and flag not in VALUED:  # other SGLang server arguments as they are
            extra = out.setdefault("rollout.sglang.extra_args", [])
            extra.append("--" + flag[len("--sglang-") :])
            if value is not None:
                extra.append(value)
                i += 1
        elif flag in (
            "--advantage-estimator",
            "--recompute-granularity",
            "--global-batch-size",
            "--rollout-stop-token-ids",
            "--rollout-stop",
        ):
            if value is None:
                raise SlimeArgsError(f"{flag} needs a value")
            i += 1
            if flag == "--advantage-estimator":
                out["trainer.loss.advantage"] = ESTIMATORS.get(value, value)
            elif flag == "--recompute-granularity":
                out.update({"trainer.recompute": True, "trainer.recompute_granularity": value})
            elif flag == "--global-batch-size":
                global_batch = int(value)
            else:  # slime takes both lists space-separated
                items = [value]
                while i < len(argv) and not argv[i].startswith("--"):
                    items.append(argv[i])
                    i += 1
                if flag == "--rollout-stop":
                    out["rollout.sampling.stop"] = items
                else:
                    try:
                        out["rollout.sampling.stop_token_ids"] = [int(v) for v in items]
                    except ValueError:
                        raise SlimeArgsError(f"{flag} {' '.join(items)}: token ids are integers") from None
        elif flag in VALUED:
            if value is None:
                raise SlimeArgsError(f"{flag} needs a value")
            key, conv = VALUED[flag]
            try:
                out[key] = conv(value)
            except ValueError:
                raise SlimeArgsError(f"{flag} {value!r}: not a {conv.__name__}") from None
            i += 1
            rollout_batch = out[key] if flag == "--rollout-batch-size" else rollout_batch
            samples = out[key] if flag == "--n-samples-per-prompt" else samples
        else:
            unknown.append(flag)
            if value is not None:
                i += 1
    if unknown:
        raise SlimeArgsError(
            f"no slipstream equivalent known for {', '.join(unknown)}: see docs/slime.md for the keys, or set "
            "the key directly"
        )
    if out.get("cluster.colocate"):  # slime: "always true on offload for colocate", unless told otherwise
        for key in OFFLOAD_KEYS:
            out.setdefault(key, True)
    if any(out.get(key) for key in OFFLOAD_KEYS):  # slime offloads in train.py's loop, which is sync
        out["run.mode"] = "sync"
    if global_batch is not None:  # slime: one rollout of rollout_batch x n samples, global_batch per update
        per_rollout = (rollout_batch or 1) * (samples or 1)
        if per_rollout % global_batch:
            raise SlimeArgsError(
                f"--global-batch-size {global_batch} does not divide --rollout-batch-size x --n-samples-per-"
                f"prompt = {per_rollout}: trainer.mini_batches must be a whole number"
            )
        out["trainer.mini_batches"] = per_rollout // global_batch
    return [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) else v}" for k, v in out.items()]


def main(argv: list[str] | None = None) -> None:
    try:
        print("\n".join(to_overrides(sys.argv[1:] if argv is None else argv)))
    except SlimeArgsError as e:
        raise SystemExit(f"slime_args: {e}") from None


if __name__ == "__main__":
    main()
