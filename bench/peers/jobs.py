"""The jobs of the peer comparison (issue #43) and the command-line overrides that run one job in each
framework with matched settings: verl 0.9.1's GRPO (`python -m verl.trainer.main_ppo`, hydra overrides)
and slipstream's (`python -m pipeline --config ...`, key=value overrides).

Matched in both: the model folder, the prompts (bench/data/basic_arithmetic.jsonl; verl reads the parquet
copy that bench/peers/to_parquet.py writes), the `math` reward (verl: bench/peers/verl_reward.py), group
size, prompts per step, one optimizer step per batch, max new tokens, sampling (temperature 1, top-p 1),
learning rate (constant, no warm-up, no weight decay), gradient clip 1.0, clip range 0.2 / 0.28, no KL,
no entropy bonus, token-mean loss, unbiased group-std GRPO advantages, token-level truncated importance
weights capped at 2 (slipstream's `tis`, verl's rollout_correction rollout_is=token), staleness bound 8
in the asynchronous modes, and the number of steps (so of samples).
Left at each framework's own choice: micro-batching, memory fractions, CUDA graphs, prefix caching.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_JSONL = REPO / "bench" / "data" / "basic_arithmetic.jsonl"
REWARD_FILE = REPO / "bench" / "peers" / "verl_reward.py"
VERL_VERSION = "0.9.1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One workload, run the same way by every framework and mode."""

    name: str  # learn | speed
    steps: int  # optimizer steps (each of `groups` x `group_size` samples)
    groups: int = 16  # prompts per step
    group_size: int = 8  # samples per prompt (GRPO group; verl's rollout.n)
    max_new_tokens: int = 128
    max_prompt_tokens: int = 128  # verl's data.max_prompt_length (the longest prompt here is 69 tokens)
    lr: float = 1e-5
    staleness: int = 8  # async modes: versions a sample may lag (slipstream run.max_staleness, verl sampler)
    reward_threshold: float = 0.10  # time to reward: first step whose moving average reaches this
    reward_window: int = 10  # steps in that moving average
    # training time of one run: slipstream's run.time_limit_s; the driver ends any run (verl's too) at
    # this + 300 s from its launch (start-up included)
    time_limit_s: int = 600

    @property
    def samples_per_step(self) -> int:
        return self.groups * self.group_size

    @property
    def samples(self) -> int:
        return self.steps * self.samples_per_step


JOBS = {
    # SmolLM2-135M-Instruct: slipstream's GPU learning runs went from ~0.03 to ~0.13-0.15 mean reward in
    # 100 steps at lr 1e-5 (bench/results/gpu_learning.jsonl); the threshold sits inside that climb
    "learn": Job(name="learn", steps=100, lr=1e-5, reward_threshold=0.10),
    # a random Qwen2.5-1.5B shape (bench/random_model.py): throughput only, its rewards mean nothing
    "speed": Job(name="speed", steps=12, lr=1e-6, max_new_tokens=512, reward_threshold=1.0, time_limit_s=480),
}

VERL_MODES = ("sync", "colocate_async", "separate_async")
SLIPSTREAM_MODES = ("async", "sync")


def parse_mode(spec: str) -> tuple[str, str]:
    """'verl:sync' -> ('verl', 'sync'); refuses names the driver cannot run."""
    framework, _, mode = spec.partition(":")
    known = {"verl": VERL_MODES, "slipstream": SLIPSTREAM_MODES}
    if framework not in known or mode not in known[framework]:
        modes = ", ".join(f"{f}:{m}" for f, ms in known.items() for m in ms)
        raise ValueError(f"unknown mode {spec!r}; one of {modes}")
    return framework, mode


def verl_gpus(mode: str) -> dict[str, int]:
    """How verl's modes use the 2 GPUs: sync and colocate_async put FSDP and an SGLang replica on each
    GPU (the hybrid engine, weights handed over by CUDA IPC between sleep and wake); separate_async
    trains on one GPU and serves from an SGLang server on the other (NCCL weight sync), as slipstream's
    2-GPU disaggregated config does."""
    if mode == "separate_async":
        return {"trainer": 1, "rollout": 1}
    return {"trainer": 2, "rollout": 0}


def verl_overrides(
    job: Job, mode: str, *, model: str, train: str, val: str, name: str, ckpt_dir: str
) -> list[str]:
    """Hydra overrides of `python -m verl.trainer.main_ppo` (verl 0.9.1, V1 trainer) for `job`."""
    gpus = verl_gpus(mode)
    tokens = job.max_prompt_tokens + job.max_new_tokens
    args = [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=True",
        "algorithm.use_kl_in_reward=False",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.prompt_key=prompt",
        f"data.max_prompt_length={job.max_prompt_tokens}",
        f"data.max_response_length={job.max_new_tokens}",
        f"data.train_batch_size={job.groups}",
        "data.truncation=error",
        "data.dataloader_num_workers=2",
        f"actor_rollout_ref.model.path={model}",
        # no flash-attn wheel exists for torch 2.11 on PyPI (verl pins flash-attn 2.8.3 from its own
        # wheelhouse): SDPA, and no padding removal (its packed path relies on FlashAttention varlen)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={job.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.grad_clip=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={job.groups}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max(16384, 4 * tokens)}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={job.group_size}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max(16384, 4 * tokens)}",
        f"reward.custom_reward_function.path={REWARD_FILE}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=True",
        f"trainer.v1.trainer_mode={mode}",
        "trainer.logger=[console,file]",
        "trainer.project_name=peers",
        f"trainer.experiment_name={name}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={ckpt_dir}",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={gpus['trainer']}",
        "trainer.total_epochs=100",
        f"trainer.total_training_steps={job.steps}",
    ]
    return args + _verl_mode_overrides(job, mode, gpus)


def _verl_mode_overrides(job: Job, mode: str, gpus: dict[str, int]) -> list[str]:
    if mode == "sync":
        return []
    common = [
        f"trainer.v1.sampler.max_off_policy_threshold={job.staleness}",
        "trainer.v1.sampler.max_off_policy_strategy=drop",
    ]
    if mode == "colocate_async":
        return common + ["trainer.v1.colocate_async.num_warmup_batches=1"]
    # one optimizer step and one weight sync per batch, as slipstream's push_every=1: the V1 invariant
    # is train_batch_size = parameter_sync_step x ppo_mini_batch_size
    return common + [
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.separate_async.num_warmup_batches=1",
        "actor_rollout_ref.hybrid_engine=False",  # no rollout replica on the training GPU
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={gpus['rollout']}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
    ]


def slipstream_overrides(job: Job, mode: str, *, model: str) -> tuple[str, list[str]]:
    """(config, overrides) of slipstream's pipeline for `job` on 2 GPUs (bench/gpu_pipeline.sh adds the
    data source, the math reward, the run directory and the time limit)."""
    args = [
        f"model.name={model}",
        f"run.steps={job.steps}",
        f"run.mode={mode}",
        f"run.max_staleness={job.staleness}",
        f"rollout.group_size={job.group_size}",
        f"trainer.batch_groups={job.groups}",
        f"rollout.sampling.max_new_tokens={job.max_new_tokens}",
        "rollout.sampling.temperature=1.0",
        f"trainer.lr={job.lr}",
        "trainer.loss.correction=tis",
        "trainer.loss.kl_coef=0.0",
    ]
    return "configs/gpu-2x-disaggregated.yaml", args


def describe(job: Job) -> str:
    return json.dumps(dataclasses.asdict(job) | {"samples": job.samples}, sort_keys=True)
