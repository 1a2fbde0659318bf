"""Trainer sub-config (`trainer:` section): parallelism, optimizer, loss and off-policy correction."""

from __future__ import annotations

import dataclasses
from typing import Literal

import msgspec

from stages.trainer.distill import DistillConfig, apply_distill
from stages.trainer.sft_config import SftConfig, check_sft
from stages.user_code import is_hook_spec


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class LossConfig(_Base):
    """Conventions that differ between frameworks are keys here whose defaults are slime's; the values
    that reproduce this project before issue #16 are named in the comments (docs/algorithms.md)."""

    # ppo: GAE against a critic (a value model trained beside the policy: stages/trainer/critic.py)
    advantage: Literal["grpo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "ppo"] = "grpo"
    grpo_std_norm: bool = True  # divide group-centred rewards by the group std
    # group std of grpo / gspo: unbiased = Bessel-corrected torch.std (slime, verl); population = before #16
    grpo_std: Literal["population", "unbiased"] = "unbiased"
    # REINFORCE++ whitening: token = over all trained tokens, Bessel-corrected (slime, verl, OpenRLHF);
    # sample = over samples, population std (before #16)
    reinforce_pp_whiten: Literal["token", "sample"] = "token"
    # discount of the per-token returns (reinforce_pp) and of GAE (ppo); 1 = slime's default
    gamma: float = 1.0
    lambd: float = 1.0  # GAE's lambda (ppo only); slime's --lambd, default 1
    # k1 KL to the reference per token, times this, subtracted from the reward (the REINFORCE++ paper's and
    # slime's --kl-coef; reinforce_pp, reinforce_pp_baseline, ppo). 0 = off (slime's default)
    kl_in_reward_coef: float = 0.0
    value_clip: float = 0.2  # ppo: the critic's value may move this far from its old value (slime's 0.2)
    # ppo advantages: none (slime's default, --normalize-advantages off) or token = whitened over the batch's
    # trained tokens (verl, OpenRLHF, slime --normalize-advantages)
    ppo_whiten: Literal["none", "token"] = "none"
    dual_clip: float = 0.0  # dual-clip PPO's c (> 1; verl uses 3): caps the loss of A < 0 tokens at -c A
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28  # asymmetric upper clip (DAPO clip-higher); = eps_clip for symmetric
    # token-mean over the batch, or mean of sample means; auto = sample for gspo (paper, verl, slime),
    # token for the others (verl's default; slime's own default is sample for every estimator)
    aggregation: Literal["auto", "token", "sample"] = "auto"
    # the sample-mean's count: all = every sample of the step, fully masked ones too (slime);
    # unmasked = samples with a trained token (verl's seq-mean-token-mean; before #16)
    sample_mean_denominator: Literal["all", "unmasked"] = "all"
    kl_coef: float = 0.0  # KL to the reference policy (the initial weights); 0 = off, no reference kept
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = 0.0
    # off-policy correction between the rollout policy and the trainer's old policy:
    # tis = token truncated IS, mis = token masked IS (IcePop), seq_tis / seq_mis = sequence-level,
    # decoupled = AReaL's decoupled PPO (behaviour weight on top of the proximal-policy clip)
    correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis", "decoupled"] = "tis"
    tis_cap: float = 2.0  # C in w = min(exp(logp_old - logp_rollout), C)
    tis_low: float = 0.0  # optional lower clip on w
    mis_low: float = 0.5  # masked IS: weights outside [mis_low, mis_high] are zeroed
    mis_high: float = 2.0
    # DAPO's soft overlong punishment (0 = off): a response longer than overlong_max_len -
    # overlong_buffer_len tokens loses overlong_penalty x (its excess / overlong_buffer_len) of reward, the
    # whole overlong_penalty at overlong_max_len (0 = rollout.sampling.max_new_tokens) and beyond
    overlong_buffer_len: int = 0
    overlong_max_len: int = 0
    overlong_penalty: float = 1.0
    # DAPO's overlong filtering: truncated samples (they hit max_new_tokens) get no loss; their rewards
    # still count in their group's statistics
    mask_truncated: bool = False
    # weight of the token NLL of the SFT rows each step adds (trainer.sft; stages/trainer/sft.py); 0 = off
    sft_coef: float = 0.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Also called by the Trainer: tests and tools set fields after construction."""
        if not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            raise ValueError("trainer.loss.gamma and trainer.loss.lambd must be in [0, 1] (1 and 1: slime's)")
        if self.kl_in_reward_coef < 0 or self.value_clip <= 0:
            raise ValueError("trainer.loss.kl_in_reward_coef must be >= 0 and trainer.loss.value_clip > 0")
        returns = self.advantage in ("reinforce_pp", "ppo")  # estimators with per-token returns
        if self.gamma != 1 and not returns:
            raise ValueError(
                f"trainer.loss.gamma={self.gamma} discounts returns of advantage reinforce_pp or ppo only; "
                f"advantage={self.advantage} has no per-token return: set gamma=1"
            )
        if self.lambd != 1 and self.advantage != "ppo":
            raise ValueError(f"trainer.loss.lambd is GAE's (advantage=ppo); set lambd=1 for {self.advantage}")
        if self.kl_in_reward_coef and self.advantage in ("grpo", "gspo"):
            raise ValueError(
                f"trainer.loss.kl_in_reward_coef puts the KL into per-token rewards (reinforce_pp, "
                f"reinforce_pp_baseline, ppo); for advantage={self.advantage} use kl_coef (the KL in the loss)"
            )
        if (self.kl_in_reward_coef or self.gamma != 1) and self.advantage.startswith("reinforce_pp"):
            if self.reinforce_pp_whiten != "token":
                raise ValueError(
                    "trainer.loss.kl_in_reward_coef and gamma make per-token returns, which "
                    "reinforce_pp_whiten=sample cannot whiten per sample: set reinforce_pp_whiten=token"
                )
        if not 0 <= self.eps_clip < 1 or self.eps_clip_high < 0:
            raise ValueError("trainer.loss.eps_clip must be in [0, 1) and eps_clip_high >= 0")
        if self.tis_cap <= 0 or not 0 <= self.tis_low <= self.tis_cap:
            raise ValueError("trainer.loss needs tis_cap > 0 and 0 <= tis_low <= tis_cap")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError("trainer.loss needs 0 <= mis_low < mis_high (tokens outside are masked)")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError("trainer.loss.dual_clip must be 0 (off) or > 1 (verl's default is 3)")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("trainer.loss.kl_coef and entropy_coef must be >= 0")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# modules trained whole beside the adapters, by PEFT's names (its `modules_to_save`)
# ("model.norm": the final norm; peft matches these as suffixes of module names, so a bare "norm" would
# be every norm of the model)
LORA_FULL_MODULES = ("embed_tokens", "lm_head", "model.norm", "input_layernorm", "post_attention_layernorm")


class LoraConfig(_Base):
    """trainer.lora: low-rank adapters on the policy's linear layers (stages/trainer/lora.py), an MoE
    layer's experts included (lora_experts.py). The base weights stay frozen (no gradient, no optimizer
    state, no fp32 master copy); only the adapters train."""

    rank: int = 0  # 0: off (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank, as PEFT does
    dropout: float = 0.0  # on the adapter's input only
    # HF module names as PEFT spells them (GLM-4's fused MLP: gate_up_proj). On an MoE layer gate_proj,
    # up_proj and down_proj name every routed expert's projections (one adapter per expert) and a shared
    # expert's, as PEFT's per-expert target_modules do (docs/lora.md, "MoE experts")
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from; "" = PEFT's
    # initialisation (A kaiming-uniform, B zero: the policy starts as the base model)
    init_from: str = ""
    # modules trained in full beside the adapters (PEFT's modules_to_save): some of LORA_FULL_MODULES.
    # A small model's output sharpness lives in its embeddings and norms (the CPU default learns with
    # embed_tokens trained, not without: bench/RESULTS.md, "LoRA")
    modules_to_save: list[str] = msgspec.field(default_factory=list)
    # how the engines get the trained policy: "merge" sends base + (alpha/rank) B.A for the tensors that
    # have adapters (the rest never change), so the engine needs no LoRA support; "adapter" sends the
    # adapters alone (and the modules trained whole), which the engine applies over the base it keeps:
    # the torch engine, or SGLang's LoRA serving (weights.transport cpu, no modules_to_save)
    push: Literal["merge", "adapter"] = "merge"

    def __post_init__(self):
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError("trainer.lora: rank must be >= 0 (0: off), alpha > 0 and 0 <= dropout < 1")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS) - {"gate_up_proj"})
        whole = sorted(set(self.modules_to_save) - set(LORA_FULL_MODULES))
        if whole:
            raise ValueError(
                f"trainer.lora.modules_to_save {whole}: name some of {', '.join(LORA_FULL_MODULES)} (PEFT's names)"
            )
        if self.init_from and self.modules_to_save:
            raise ValueError(
                "trainer.lora.init_from with trainer.lora.modules_to_save: starting the whole modules from a PEFT "
                "folder is not supported; start from the adapters alone (modules_to_save: [])"
            )
        if unknown or (self.rank and not self.target_modules):
            raise ValueError(
                f"trainer.lora.target_modules {unknown or '[]'}: name some of {', '.join(LORA_TARGETS)} "
                "(PEFT's names; gate_up_proj for GLM-4's fused MLP)"
            )


class TrainerHooksConfig(_Base):
    """trainer.hooks: user functions called inside the trainer (stages/trainer/hooks.py), "" = none."""

    init: str = ""  # slime's --custom-megatron-init-path
    before_log_prob: str = ""  # slime's --custom-megatron-before-log-prob-hook-path
    before_train_step: str = ""  # slime's --custom-megatron-before-train-step-hook-path

    def __post_init__(self):
        for name in ("init", "before_log_prob", "before_train_step"):
            spec = getattr(self, name)
            if spec and not is_hook_spec(spec):
                raise ValueError(
                    f"trainer.hooks.{name}={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'"
                )


class TrainerConfig(_Base):
    """Megatron trainer. Parallel sizes (tp x pp x cp x dp) multiply to the number of processes."""

    # megatron: megatron-core (TP/PP/CP/EP, the families of hf_mapping.py); fsdp: any transformers causal LM
    # through AutoModelForCausalLM, sharded over the ranks with torch's FSDP2 (data parallel only;
    # stages/trainer/fsdp_backend.py). `check_fsdp` lists what fsdp refuses
    backend: Literal["megatron", "fsdp"] = "megatron"
    # fsdp backend: FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state in host memory,
    # the optimizer step on the CPU); less GPU memory, slower steps
    fsdp_cpu_offload: bool = False
    # fsdp backend: torch.compile each decoder layer (torchtitan's per-block compile, before sharding):
    # fuses the HF model's norms, rotary and activation kernels; the first steps pay the compilation
    fsdp_compile: bool = False
    batch_groups: int = 8  # groups per optimizer step
    micro_batch_tokens: int = 4096  # token budget per packed micro-batch
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: lr -> min_lr over run.steps
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    tp: int = 1
    pp: int = 1
    # context parallel: each sequence split over cp ranks (long sequences; stages/trainer/context_parallel.py)
    cp: int = 1
    dp: int = 1
    # with tp > 1: activations outside attention and the MLP split over the TP ranks along the sequence
    # (megatron's --sequence-parallel; less activation memory, the same numbers)
    sequence_parallel: bool = False
    # MoE models (stages/trainer/moe.py): experts split over `ep` ranks (expert parallel; out of the
    # tp*cp*dp ranks of a pipeline stage, so no extra processes) and each expert over `etp` ranks
    # (expert tensor parallel; 0 = tp, megatron's default)
    ep: int = 1
    etp: int = 0
    # the routers' load-balancing auxiliary loss (megatron's aux_loss); 0 = off: RL keeps the router
    # where the engine's is
    moe_aux_loss_coef: float = 0.0
    # how MoE layers run their experts: "grouped" (all local experts in one torch._grouped_mm per
    # projection: CPU, or CUDA in bf16; 2.4-29x the loop's speed at real shapes), "sequential" (megatron's
    # SequentialMLP, a loop over experts), auto: transformer-engine's grouped MLP with the TE spec, else
    # grouped where it runs, else sequential (stages/trainer/model.resolve_moe_experts)
    moe_experts: Literal["auto", "grouped", "sequential"] = "auto"
    # routing replay ("R3"): the engines record the experts they routed each token to (Sample.routed_experts)
    # and the policy's forwards (logp_old and the loss) use those instead of routing themselves, so the
    # trainer computes logprobs of the experts that produced the tokens (stages/trainer/routing_replay.py)
    routing_replay: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    fetch_timeout_s: float = 300.0  # no batch within this long fails the trainer with a message
    checkpoint_every: int = 0  # steps; 0 = only at the end of the run
    # also checkpoint when this long has passed since the last one (0 = off): what a trainer that dies
    # mid-run loses (the run restarts it from its newest checkpoint, or from the base model)
    checkpoint_every_s: float = 600.0
    # write checkpoints in the background (megatron's --async-save): the step only copies the state into
    # shared memory (a device-to-host copy on GPUs: host memory for one more copy of this rank's weights
    # and optimizer state) and a writer process writes and commits it while training goes on; at most
    # one save is in flight, the next one waits for it (docs/checkpoints.md)
    async_save: bool = False
    threads: int = 0  # torch CPU threads; 0 = torch default
    layer_spec: Literal["auto", "local", "te"] = "auto"  # auto: transformer-engine spec when TE + CUDA exist
    # core attention of the local spec. auto: varlen on CUDA + bf16 (packed rows, FlashAttention over
    # cu_seqlens, no s x s mask), else sdpa (block-diagonal mask; scores in fp32 like SGLang's kernels);
    # "unfused" is megatron's DotProductAttention, which rounds every score to bf16 in a bf16 run
    attention: Literal["auto", "varlen", "sdpa", "unfused"] = "auto"
    # response positions per chunk of the fused LM head + logprob + entropy: peak memory of the head is
    # a few chunk x vocab fp32 buffers (2048 x 152k: 1.2 GB each), whatever the micro-batch size
    logits_chunk_tokens: int = 2048
    # logp_old (the PPO / TIS anchor: the weights before this update). With one optimizer step per batch
    # the training forward computes exactly it, so it is taken from there; "separate_pass" runs a no-grad
    # forward over the batch first (twice the forward work; the same numbers up to kernel rounding)
    old_logprobs: Literal["from_train_forward", "separate_pass"] = "from_train_forward"
    # a step whose loss or gradient is NaN/inf: "skip" leaves the weights and the policy version as they
    # were (counted in the optimizer/skipped metrics; nothing is pushed or checkpointed for it), "stop"
    # fails the trainer with an error naming the version
    on_nonfinite: Literal["skip", "stop"] = "skip"
    # several optimizer updates per fetched batch (PPO epochs x mini-batches, as slime's / verl's): each
    # epoch splits this rank's samples into `mini_batches` parts, one update each. logp_old is then
    # computed once, by a no-grad pass before the first update (the ratio starts away from 1 only from
    # the second update on). The policy version still advances once per batch.
    ppo_epochs: int = 1
    mini_batches: int = 1
    # learning rate of the critic (trainer.loss.advantage=ppo); None = trainer.lr (slime's --critic-lr). It
    # follows the policy's schedule (warmup, cosine), scaled by critic_lr / lr
    critic_lr: float | None = None
    recompute: bool = False  # activation recompute (saves memory, costs a second forward)
    # what is recomputed (slime's --recompute-granularity / -method / -num-layers): full = whole layers,
    # `recompute_num_layers` at a time (uniform) or the first that many of each stage (block); selective =
    # the core attention only (cheap to recompute, the largest activations at long sequences)
    recompute_granularity: Literal["full", "selective"] = "full"
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    # the KL reference (slime's --ref-load): an HF folder of the same architecture; "" = the initial
    # weights (with LoRA: the base, adapters off)
    ref_load: str = ""
    # the card's bf16 peak in TFLOP/s for the perf/mfu metric (0: not logged); an H100 SXM measured ~800
    # on an 8192^3 matmul (bench/trainer_gpu.py prints the peak it measures)
    peak_tflops: float = 0.0
    # shard Adam state over DP (dp > 1; experts' over expert-DP): megatron's DistributedOptimizer. Resumes
    # exactly, and at another dp (megatron reshards it); its checkpoints and those of a run without it
    # do not load into each other (refused)
    distributed_optimizer: bool = False
    resume: bool = True  # continue from <run dir>/checkpoints/latest when it exists
    # a run with no checkpoint of its own starts from this one (slime's --load): a run dir, its checkpoints/
    # folder or a step_N folder (python -m stages.trainer.convert makes one from an HF model); the weights,
    # the optimizer state and the version (the LR schedule goes on from it)
    load: str = ""
    ckpt_step: int = 0  # slime's --ckpt-step: step_N of trainer.load; 0 = its latest
    finetune: bool = False  # slime's --finetune: take only the weights of trainer.load; start at version 0
    keep_checkpoints: int = 2  # older megatron checkpoints are deleted; 0 keeps all
    save_hf_every: int = 0  # also export a save_pretrained folder every N steps; 0 = only at the end
    # the final checkpoint and HF export when the run ends; false skips both (benchmarks, throwaway runs:
    # a 7B model's final save writes ~100 GB), and a resume then starts from the newest periodic checkpoint
    save_at_end: bool = True
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    hooks: TrainerHooksConfig = msgspec.field(default_factory=TrainerHooksConfig)
    # on-policy distillation: {teacher, coef, mode}; the teacher becomes the KL's reference (distill.py)
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    # SFT rows in every step: {source, messages_key, samples_per_step, ...}, weighted by loss.sft_coef
    sft: SftConfig = msgspec.field(default_factory=SftConfig)

    def megatron_recompute(self) -> dict:
        """megatron TransformerConfig keys of trainer.recompute* ({} = no recompute)."""
        if not self.recompute:
            return {}
        if self.recompute_granularity == "selective":
            return {"recompute_granularity": "selective"}
        return {
            "recompute_granularity": "full",
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }

    @property
    def ranks(self) -> int:
        """Trainer processes (one GPU each on CUDA): tp x pp x cp x dp."""
        return self.tp * self.pp * self.cp * self.dp

    def __post_init__(self):
        apply_distill(self)  # first: it sets ref_load and a KL coefficient that the checks below read
        check_critic_layout(self)
        check_fsdp(self)
        check_sft(self.sft, self.loss.sft_coef)
        if self.critic_lr is not None and self.critic_lr < 0:
            raise ValueError("trainer.critic_lr must be >= 0, or null for trainer.lr")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError("trainer.ppo_epochs and trainer.mini_batches must be >= 1 (1 and 1: one update)")
        if self.peak_tflops < 0:
            raise ValueError("trainer.peak_tflops must be >= 0 (0: no perf/mfu metric)")
        if self.batch_groups < 1:
            raise ValueError("trainer.batch_groups must be >= 1")
        if self.micro_batch_tokens < 8:
            raise ValueError(
                "trainer.micro_batch_tokens must be >= 8 (a packed row is a multiple of 8 tokens)"
            )
        if min(self.tp, self.pp, self.cp, self.dp) < 1:
            raise ValueError("trainer.tp, trainer.pp, trainer.cp and trainer.dp must be >= 1")
        if self.ep < 1 or self.etp < 0 or self.moe_aux_loss_coef < 0:
            raise ValueError(
                "trainer.ep must be >= 1, trainer.etp >= 0 (0: = tp), trainer.moe_aux_loss_coef >= 0"
            )
        if (self.tp * self.cp * self.dp) % (self.ep * (self.etp or self.tp)):
            raise ValueError(
                f"trainer.ep * trainer.etp = {self.ep}*{self.etp or self.tp} must divide tp*cp*dp = "
                f"{self.tp * self.cp * self.dp}: experts are split over the ranks of a pipeline stage"
            )
        if self.routing_replay and self.recompute and self.pp > 1:
            raise ValueError(
                "trainer.routing_replay with trainer.recompute and pp > 1: a recomputed forward would replay "
                "the routing of another micro-batch (1F1B interleaves them); turn one of them off"
            )
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                "trainer.sequence_parallel splits activations over TP ranks: it needs trainer.tp >= 2"
            )
        if self.lr < 0 or self.min_lr < 0 or self.fetch_timeout_s <= 0:
            raise ValueError(
                "trainer.lr and trainer.min_lr must be >= 0 (0 freezes the weights) and "
                "trainer.fetch_timeout_s > 0"
            )
        if self.logits_chunk_tokens < 1:
            raise ValueError("trainer.logits_chunk_tokens must be >= 1 (try 2048)")
        if self.ref_load and not (self.loss.kl_coef or self.loss.kl_in_reward_coef):
            raise ValueError(
                f"trainer.ref_load={self.ref_load!r} but no KL uses a reference: set trainer.loss.kl_coef "
                "(or kl_in_reward_coef) > 0, or drop trainer.ref_load"
            )
        if (self.ckpt_step or self.finetune) and not self.load:
            raise ValueError(
                "trainer.ckpt_step and trainer.finetune pick what trainer.load loads: set trainer.load"
            )
        if self.recompute_num_layers < 1:
            raise ValueError("trainer.recompute_num_layers must be >= 1 (layers per recomputed chunk)")
        lc = self.loss
        if lc.overlong_buffer_len < 0 or lc.overlong_max_len < 0 or lc.overlong_penalty < 0:
            raise ValueError(
                "trainer.loss.overlong_buffer_len, overlong_max_len and overlong_penalty must be >= 0"
            )
        if lc.overlong_buffer_len and lc.overlong_max_len and lc.overlong_buffer_len > lc.overlong_max_len:
            raise ValueError(
                f"trainer.loss.overlong_buffer_len={lc.overlong_buffer_len} > overlong_max_len="
                f"{lc.overlong_max_len}: the penalty starts at max_len - buffer_len tokens"
            )
        if self.lora.rank and self.loss.advantage == "ppo":
            raise ValueError(
                "trainer.lora with trainer.loss.advantage=ppo: the critic has no adapters; use an estimator "
                "without a critic (grpo, gspo, reinforce_pp) or full fine-tuning (trainer.lora.rank=0)"
            )
        if self.lora.rank and self.layer_spec == "te":
            raise ValueError(
                "trainer.lora adapts the local layer spec's linear layers (transformer-engine fuses the "
                "norm into them); set trainer.layer_spec=local"
            )


def check_fsdp(tc: TrainerConfig) -> None:
    """Refuse, by key, what trainer.backend=fsdp does not implement (it would otherwise be ignored)."""
    if tc.backend != "fsdp":
        for key in ("fsdp_cpu_offload", "fsdp_compile"):
            if getattr(tc, key):
                raise ValueError(f"trainer.{key} is the fsdp backend's: set trainer.backend=fsdp")
        return
    fixes = (
        ("trainer.tp=1", tc.tp > 1),
        ("trainer.pp=1", tc.pp > 1),
        ("trainer.cp=1", tc.cp > 1),
        ("trainer.ep=1", tc.ep > 1),
        ("trainer.etp=0", tc.etp > 1),
        ("trainer.sequence_parallel=false", tc.sequence_parallel),
        ("trainer.lora.rank=0", tc.lora.rank > 0),
        ("trainer.routing_replay=false", tc.routing_replay),
        (
            "trainer.distributed_optimizer=false (FSDP shards the optimizer state already)",
            tc.distributed_optimizer,
        ),
        ("trainer.layer_spec=auto", tc.layer_spec == "te"),
        ("trainer.moe_aux_loss_coef=0", tc.moe_aux_loss_coef > 0),
        (
            "trainer.recompute_granularity=full (whole decoder layers are checkpointed)",
            tc.recompute and tc.recompute_granularity != "full",
        ),
        ("trainer.loss.advantage other than ppo (no critic on this backend)", tc.loss.advantage == "ppo"),
    )
    bad = [fix for fix, on in fixes if on]
    if bad:
        raise ValueError(
            f"trainer.backend=fsdp is data parallel over FSDP2 shards and does not support these settings; "
            f"set {', '.join(bad)}, or use trainer.backend=megatron"
        )


def check_critic_layout(tc: TrainerConfig) -> None:
    """The critic (advantage=ppo) is built and tested for TP and DP; refuse the layouts it does not support
    rather than train a wrong value model."""
    if tc.loss.advantage != "ppo":
        return
    fixes = (
        ("trainer.pp=1", tc.pp > 1),
        ("trainer.cp=1", tc.cp > 1),
        ("trainer.sequence_parallel=false", tc.sequence_parallel),
    )
    bad = [fix for fix, on in fixes if on]
    if bad:
        raise ValueError(
            f"trainer.loss.advantage=ppo trains a critic, which supports trainer.tp and trainer.dp only; "
            f"set {', '.join(bad)}, or use an estimator without a critic (grpo, gspo, reinforce_pp)"
        )


@dataclasses.dataclass(frozen=True)
class TrainerRun:
    """What the trainer needs of the run beyond its own `trainer:` section, as plain values: the launcher
    (pipeline/) fills it from run.*, rollout.* and model.*, so no stage depends on the whole RunConfig
    (stages/ sits below pipeline/)."""

    run_dir: str  # checkpoints, HF exports and trainer_metrics.jsonl go under here
    seed: int = 0  # run.seed: megatron's model-parallel RNG
    steps: int = 60  # run.steps: the cosine schedule decays over this many steps
    # the staleness bound each fetch asks the buffer for: the one the stages run with (run.max_staleness;
    # 0 in sync mode)
    max_staleness: int = 2
    temperature: float = 1.0  # rollout.sampling.temperature: logprobs are of the sampling distribution
    fp32_lm_head: bool = True  # model.fp32_lm_head: logits in fp32 whatever the precision
    max_new_tokens: int = 0  # rollout.sampling.max_new_tokens: DAPO's overlong length by default
