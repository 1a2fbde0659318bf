"""Typed run configuration: one YAML file plus `a.b=c` overrides, validated at load time.

The file and its overrides are read by stages/config_loader.py (the loader the stages' own command lines
use too). Each stage owns its sub-config (buffer/config.py, stages/rollout/config.py,
stages/trainer/config.py, stages/weights/config.py); this module composes them into `RunConfig`. Unknown keys are rejected with
the full dotted key and the valid alternatives named. The resolved config is written into the run
directory so that every run can be reproduced from its own folder.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec
import yaml

from buffer.config import BufferConfig
from stages.config_loader import ConfigError, error_at, load_tree
from stages.models import ModelConfig
from stages.rollout.config import RolloutConfig
from stages.rollout.run import RolloutRun, check_served_teacher, lora_serving
from stages.rollout.sglang_args import flag_value
from stages.trainer.config import TrainerConfig, TrainerRun
from stages.weights.config import DIRECT_NEEDS_ONE_STAGE, WeightsConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


class Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunSection(Base):
    name: str = "default"
    root: str = "runs"  # run directories are created under here: {root}/{name}-{timestamp}
    dir: str = ""  # explicit run directory (overrides root/name)
    seed: int = 0
    steps: int = 60  # optimizer steps to train (the run ends after this many)
    time_limit_s: float = 0.0  # also end the run cleanly after this many seconds of training (0 = no limit)
    mode: Literal["async", "sync"] = "async"
    max_staleness: int = 2  # max (trainer version - oldest token version) a trained sample may have
    timeout_s: float = 600.0  # a stage that makes no progress for this long fails the run
    # a generator that dies is restarted (a new incarnation, re-synced to the current weights) up to
    # max_restarts times within restart_window_s; one more death stops the run with its name and error
    max_restarts: int = 3
    restart_window_s: float = 600.0


class OffloadConfig(Base):
    """cluster.offload (slime's --offload-train / --offload-rollout; --offload is both): the trainer and
    the engines take turns on the same GPUs in run.mode=sync, each handing its memory back while the
    other works (docs/offload.md). Off by default: a static split of each GPU
    (rollout.sglang.mem_fraction_static beside the trainer) needs no hand-over."""

    # the trainer's weights, gradients and optimizer state leave the GPU while the engines generate
    train: bool = False
    # the engines' weights and KV cache (SGLang: --enable-memory-saver) leave it while the trainer steps
    rollout: bool = False
    # a release waits this long for the requests in flight (an evaluation) to finish, and a wake for
    # its memory; past it the run stops naming what held it
    timeout_s: float = 300.0

    @property
    def on(self) -> bool:
        return self.train or self.rollout


class ClusterConfig(Base):
    address: str = "local"  # "local": Ray in-process on this machine; "auto" or host:port joins a cluster
    num_cpus: int = 0  # 0 = let Ray detect
    num_gpus: int = 0
    # GPU layout, as slime's --actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-gpus and
    # --colocate (--rollout-num-gpus-per-engine is rollout.sglang.tp_size). Ray picks the GPUs.
    # trainer_gpus_per_node > 0: the trainer has trainer_num_nodes x trainer_gpus_per_node GPUs, and
    # trainer.dp, when not given, is derived from them (dp = GPUs / (tp * pp * cp)).
    trainer_num_nodes: int = 1
    trainer_gpus_per_node: int = 0
    # all engines' GPUs; 0 = whatever rollout.num_generators x engines_per_generator x sglang.tp_size need
    rollout_num_gpus: int = 0
    colocate: bool = False  # the engines share the trainer's GPUs (weights.transport=cuda_ipc)
    offload: OffloadConfig = msgspec.field(default_factory=OffloadConfig)  # taking turns on them
    # custom Ray resources added to each trainer rank's bundle (the buffer's too) and to each generator's
    # (and eval's), to pin them to nodes started with `ray start --resources '{"trainer_node": 8}'`
    trainer_resources: dict[str, float] = msgspec.field(default_factory=dict)
    rollout_resources: dict[str, float] = msgspec.field(default_factory=dict)


class EvalDataset(Base):
    """One held-out evaluation set (eval.datasets). Empty fields take the training run's value."""

    name: str = ""  # metrics are eval/<name>/...; "" = eval/... (the progress line and report show those)
    source: str = ""  # rollout.data.source form; "" = the training source with another seed
    task_kwargs: dict[str, Any] | None = None  # None = rollout.data.task_kwargs
    reward: str = ""  # reward function (rollout.reward.fn form); "" = rollout.reward.fn
    reward_kwargs: dict[str, Any] | None = None  # None = rollout.reward.kwargs
    num_prompts: int = 32
    samples_per_prompt: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 0  # 0 = rollout.sampling.max_new_tokens
    pass_k: list[int] = []  # pass@k reported for each k (unbiased estimator); [] = [samples_per_prompt]
    correct_threshold: float = 1.0  # a sample counts as correct when its reward is at least this

    def __post_init__(self):
        where = f"eval dataset {self.name or self.source or '(training source)'}"
        if self.num_prompts < 1 or self.samples_per_prompt < 1:
            raise ValueError(f"{where}: num_prompts and samples_per_prompt must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"{where}: temperature must be > 0 (the engines sample; greedy has no logprobs)")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(
                f"{where}: pass_k {bad} outside [1, samples_per_prompt={self.samples_per_prompt}]; pass@k "
                "needs at least k samples per prompt"
            )


class EvalConfig(Base):
    every_steps: int = 0  # 0 disables evaluation
    # held-out sets, each evaluated every every_steps by generator 0's engine (the training engines, with
    # the run's generate_fn, so multi-turn environments are evaluated as they are trained); [] = one set
    # from the fields below
    datasets: list[EvalDataset] = []
    source: str = ""  # held-out prompts; empty = the training source with another seed
    correct_threshold: float = 1.0  # a sample counts as correct when its reward is at least this
    num_prompts: int = 32
    samples_per_prompt: int = 4  # pass@k uses k = samples_per_prompt
    temperature: float = 1.0

    def sets(self) -> list[EvalDataset]:
        """eval.datasets, or the one set the single-set fields describe."""
        if self.datasets:
            return list(self.datasets)
        return [
            EvalDataset(
                source=self.source,
                num_prompts=self.num_prompts,
                samples_per_prompt=self.samples_per_prompt,
                temperature=self.temperature,
                correct_threshold=self.correct_threshold,
            )
        ]


class MetricsConfig(Base):
    tensorboard: bool = True
    wandb_project: str = ""  # empty: W&B off
    wandb_entity: str = ""  # W&B team or user (empty: wandb's default)
    wandb_group: str = ""  # groups runs in the W&B UI (e.g. one sweep)
    wandb_mode: Literal["online", "offline"] = "online"  # offline: logs under the run directory, sync later
    progress: bool = True  # live progress line in the terminal


class RunConfig(Base):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)

    def __post_init__(self):
        # across sections, at load: a direct push would otherwise fail at the first push, mid-run
        if self.weights.snapshot == "direct" and self.trainer.pp > 1:
            raise ValueError(DIRECT_NEEDS_ONE_STAGE)


# ---------------------------------------------------------------------------------------------------
def _check_keys(tree: Any, cls: type, prefix: str, where: str) -> None:
    """Reject unknown keys with the dotted name and close matches (msgspec names only the parent)."""
    if not isinstance(tree, dict) or not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    for k, v in tree.items():
        if k not in fields:
            near = difflib.get_close_matches(str(k), fields, n=3)
            hint = f"; did you mean {', '.join(prefix + n for n in near)}?" if near else ""
            raise ConfigError(
                f"{where}: unknown key {prefix}{k}{hint} (valid keys under "
                f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(fields))})"
            )
        t = fields[k].type
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            _check_keys(v, t, f"{prefix}{k}.", where)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (default: configs/default.yaml), apply overrides, validate."""
    tree, where = load_tree(path, overrides)
    return from_dict(tree, where=where)


def load_config_or_exit(path: str | Path | None, overrides: list[str] | None, prog: str) -> RunConfig:
    """load_config for command lines: a bad config prints the reason and exits with status 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def from_dict(tree: dict, where: str = "config") -> RunConfig:
    _check_keys(tree, RunConfig, "", where)
    try:
        cfg = msgspec.convert(tree, RunConfig, strict=False)  # lets "1e-2" (a YAML string) be a float
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {_dotted(str(e))}") from None
    cfg = _derive_dp(cfg, dp_given="dp" in (tree.get("trainer") or {}))
    validate(cfg)
    return cfg


def _derive_dp(cfg: RunConfig, dp_given: bool) -> RunConfig:
    """trainer.dp from the trainer's GPUs (cluster.trainer_num_nodes x trainer_gpus_per_node), as slime
    derives it; a dp that was given must agree with them."""
    c, t = cfg.cluster, cfg.trainer
    if c.trainer_gpus_per_node < 0 or c.trainer_num_nodes < 1 or c.rollout_num_gpus < 0:
        raise ConfigError(
            "cluster.trainer_num_nodes must be >= 1, trainer_gpus_per_node and rollout_num_gpus >= 0"
        )
    if not c.trainer_gpus_per_node:
        return cfg
    gpus = c.trainer_num_nodes * c.trainer_gpus_per_node
    model_parallel = t.tp * t.pp * t.cp
    if gpus % model_parallel or (dp_given and gpus != model_parallel * t.dp):
        raise ConfigError(
            f"cluster.trainer_num_nodes x trainer_gpus_per_node = {gpus} trainer GPUs, which is not "
            f"trainer.tp*pp*cp{'*dp' if dp_given else ' times a whole dp'} = {t.tp}*{t.pp}*{t.cp}"
            f"{f'*{t.dp}' if dp_given else ''}; change the GPUs or the parallel sizes"
            f"{' (or leave trainer.dp out: it is derived)' if dp_given else ''}"
        )
    if c.trainer_num_nodes > 1 and c.trainer_gpus_per_node % t.tp:
        raise ConfigError(
            f"trainer.tp={t.tp} does not divide cluster.trainer_gpus_per_node={c.trainer_gpus_per_node}: a "
            "TP group would span two nodes (TP all-reduces every layer); choose a tp that divides it"
        )
    dp = gpus // model_parallel
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(t, dp=dp))


def _dotted(msg: str) -> str:
    """msgspec says '... - at `$.trainer.lr`'; say 'trainer.lr: ...' instead, with the values a field of
    fixed choices takes when the value was not one of them."""
    at = error_at(msg)
    if at is None:
        return msg
    key, reason = at
    choices = _choices(key)
    if reason.startswith("Invalid enum value") and choices:
        reason += f"; choose one of {', '.join(map(str, choices))}"
    return f"{key}: {reason}"


def _choices(key: str) -> tuple:
    """The values of the Literal field at dotted `key` of RunConfig, () for any other."""
    kind = RunConfig
    for part in key.split("."):
        kind = {f.name: f.type for f in msgspec.structs.fields(kind)}.get(part)
        if kind is None:
            return ()
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            break
    return get_args(kind) if get_origin(kind) is Literal else ()


# -- what each stage takes of the run ---------------------------------------------------------------
# A stage takes its own section(s) and a small typed object of the run-wide values it needs (seeds,
# steps, the staleness bound), never the whole RunConfig: stages/ sits below pipeline/. The functions
# below are the one place those objects are filled from a RunConfig. Sync mode is one of those values,
# not a rewrite of the config: the run directory's config.yaml says run.mode=sync with the
# run.max_staleness the user gave, and the stages are told the bound they run with.


def sync_mode(cfg: RunConfig) -> bool:
    """run.mode=sync: generate a batch, train on it, push, and wait for the push to land (the trainer
    waits for each push; the staleness bound is 0)."""
    return cfg.run.mode == "sync"


def effective_staleness(cfg: RunConfig) -> int:
    """The staleness bound the stages run with: sync mode is async with a bound of 0."""
    return 0 if sync_mode(cfg) else cfg.run.max_staleness


def weights_start_elsewhere(cfg: RunConfig) -> bool:
    """Whether the run's version 0 is other weights than the model folder's, which the engines start from
    (LoRA adapters from a PEFT folder; trainer.load with finetune): the trainer pushes them before its
    first step (Trainer.engines_start_behind), and generators wait for that push before generating."""
    t = cfg.trainer
    return bool((t.lora.rank and t.lora.init_from) or (t.load and t.finetune))


def rollout_run(cfg: RunConfig) -> RolloutRun:
    """The run-wide values of the rollout stage (generators and their engines)."""
    lora = cfg.trainer.lora
    serving = lora_serving(
        lora.rank, lora.push, lora.target_modules, cfg.rollout.engine, effective_staleness(cfg)
    )
    return RolloutRun(
        seed=cfg.run.seed,
        max_staleness=effective_staleness(cfg),
        routing_replay=cfg.trainer.routing_replay,
        lora_serving=serving,
        teacher_url=cfg.trainer.distill.server,
    )


def trainer_run(cfg: RunConfig, run_dir: str) -> TrainerRun:
    """The run-wide values of the trainer. Its fetches ask the buffer for the bound the stages run with
    (0 in sync mode), as they always have."""
    return TrainerRun(
        run_dir=run_dir,
        seed=cfg.run.seed,
        steps=cfg.run.steps,
        max_staleness=effective_staleness(cfg),
        temperature=cfg.rollout.sampling.temperature,
        fp32_lm_head=cfg.model.fp32_lm_head,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
    )


def _check_sglang_adapter_pushes(cfg: RunConfig) -> None:
    """trainer.lora.push=adapter on SGLang: the generator loads each push into its servers as a LoRA
    adapter (stages/rollout/sglang_lora.py), so the push must reach the generator, and carry adapters only."""
    if cfg.weights.transport != "cpu":
        raise ConfigError(
            f"trainer.lora.push=adapter with rollout.engine=sglang and weights.transport="
            f"{cfg.weights.transport}: the adapters are loaded into the servers by their generator (SGLang's "
            "LoRA serving), so pushes go through it: set weights.transport=cpu (or trainer.lora.push=merge)"
        )
    spec = flag_value(cfg.rollout.sglang.extra_args, "--speculative-algorithm")
    if spec is not None and spec.upper() != "NGRAM":
        raise ConfigError(
            f"trainer.lora.push=adapter with rollout.sglang.extra_args --speculative-algorithm {spec}: SGLang "
            "0.5.17 serves LoRA adapters with NGRAM speculative decoding only; use NGRAM, or "
            "trainer.lora.push=merge"
        )
    if cfg.trainer.lora.modules_to_save:
        raise ConfigError(
            f"trainer.lora.push=adapter with rollout.engine=sglang and trainer.lora.modules_to_save="
            f"{cfg.trainer.lora.modules_to_save}: SGLang's LoRA serving applies adapters over a base it keeps, "
            "and a module trained whole would change that base; train the adapters alone or use "
            "trainer.lora.push=merge"
        )


def validate(cfg: RunConfig) -> None:
    """Cross-section checks that no single sub-config can make on its own."""
    if cfg.run.steps < 1:
        raise ConfigError("run.steps must be >= 1")
    if cfg.run.max_staleness < 0:
        raise ConfigError("run.max_staleness must be >= 0 (0 = fully on-policy)")
    staleness = effective_staleness(cfg)
    if not 1 <= cfg.weights.push_every <= staleness + 1:
        raise ConfigError(
            f"weights.push_every={cfg.weights.push_every} with run.max_staleness={staleness}"
            f"{' (sync mode)' if sync_mode(cfg) else ''}: generators only start groups their engine's "
            "weights can still be trained on, so the engines must get new weights at least every "
            "max_staleness + 1 steps; set weights.push_every between 1 and that"
        )
    if cfg.rollout.num_generators > cfg.trainer.batch_groups:
        raise ConfigError(
            f"rollout.num_generators={cfg.rollout.num_generators} > trainer.batch_groups="
            f"{cfg.trainer.batch_groups}: each generator needs at least one group of every batch"
        )
    r, c = cfg.rollout, cfg.cluster
    if r.engine == "sglang" and r.sglang.radix_cache and cfg.weights.transport in ("nccl", "cuda_ipc"):
        raise ConfigError(
            f"rollout.sglang.radix_cache with weights.transport={cfg.weights.transport}: the trainer pushes "
            "into the servers itself, so the generator learns of new weights only after they are in use, "
            "and requests sent meanwhile could reuse prefixes cached under the old ones; use "
            "weights.transport=cpu (pushes through the generator, which keys the cache before each "
            "update), or leave the radix cache off"
        )
    try:
        check_served_teacher(cfg.trainer.distill.server, r.sampling.temperature)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.trainer.lora.rank and cfg.trainer.lora.push == "adapter" and r.engine == "sglang":
        _check_sglang_adapter_pushes(cfg)
    if c.rollout_num_gpus and not c.colocate and r.engine == "sglang":
        need = r.num_generators * r.engines_per_generator * r.sglang.tp_size
        if c.rollout_num_gpus != need:
            raise ConfigError(
                f"cluster.rollout_num_gpus={c.rollout_num_gpus}, but rollout.num_generators x "
                f"engines_per_generator x sglang.tp_size = {r.num_generators} x {r.engines_per_generator} x "
                f"{r.sglang.tp_size} = {need} GPUs; make them agree (e.g. rollout.engines_per_generator="
                f"{max(1, c.rollout_num_gpus // max(1, r.num_generators * r.sglang.tp_size))})"
            )
    if cfg.weights.transport in ("cuda_ipc", "nccl") and (cfg.weights.transport == "cuda_ipc") != c.colocate:
        raise ConfigError(
            "weights.transport=cuda_ipc pushes to engines on the trainer's own GPUs, which is "
            "cluster.colocate=true; set both, or neither (weights.transport=nccl for engines on GPUs of "
            f"their own); got transport={cfg.weights.transport}, colocate={c.colocate}"
        )
    if c.colocate and r.engine == "sglang" and (r.sglang.tp_size != 1 or r.engines_per_generator != 1):
        raise ConfigError(
            "cluster.colocate=true puts one engine on each trainer GPU: it needs rollout.sglang.tp_size=1 "
            "and rollout.engines_per_generator=1"
        )
    _check_offload(cfg)
    names = [d.name for d in cfg.eval.sets()]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"eval.datasets: names {names} repeat; give each set its own name (metrics eval/<name>/...)"
        )


def _check_offload(cfg: RunConfig) -> None:
    """cluster.offload takes turns: nothing overlaps, which is what run.mode=async is for. Without
    cluster.colocate it is allowed (the turns run, and their results are a run without offload's):
    that is how the CPU runs it, where trainer and engines share the host's memory; a trainer on GPUs
    of its own is refused at placement (placement.check_offload), where the device is known."""
    o = cfg.cluster.offload
    if not o.on:
        return
    keys = "/".join(k for k in ("train", "rollout") if getattr(o, k))
    if cfg.run.mode != "sync":
        raise ConfigError(
            f"cluster.offload.{keys}=true needs run.mode=sync: with offload the trainer and the engines take "
            "turns on the same GPUs, so generation cannot overlap training. Set run.mode=sync, or for "
            "async overlap give the engines GPUs of their own (cluster.colocate=false and cluster.offload "
            "off, as configs/gpu-2x-disaggregated.yaml)"
        )
    if o.timeout_s <= 0:
        raise ConfigError(
            f"cluster.offload.timeout_s={o.timeout_s:g}: must be > 0 (seconds a hand-over may wait)"
        )


def to_dict(cfg: RunConfig) -> dict:
    return msgspec.to_builtins(cfg)


def write_resolved(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write the fully resolved config as YAML into the run directory; returns its path."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return out
