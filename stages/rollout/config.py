"""Rollout sub-config (`rollout:` section): data source, sampling, groups, rewards, engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from stages.reward.config import RewardConfig
from stages.rollout.sglang_args import check_extra_args
from stages.user_code import is_hook_spec


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


BUILTIN_FILTERS = ("none", "nonzero_std")  # rollout.filter names besides "module:function"


def absolute_spec(spec: str) -> str:
    """A "file.py:fn" spec with the file made absolute: the stages may run in another directory."""
    path, _, attr = spec.rpartition(":")
    if path.endswith(".py") and not Path(path).expanduser().is_absolute():
        return f"{Path(path).expanduser().resolve()}:{attr}"
    return spec


class DataConfig(_Base):
    # "digit_repeat" (built-in procedural task), "reasoning_gym:<task>" (e.g. reasoning_gym:basic_arithmetic),
    # or a path to a .jsonl / .parquet file in slime's schema, optionally a row slice of it: data.jsonl@[0:1000]
    source: str = "digit_repeat"
    prompt_key: str = "prompt"  # text, or a list of chat messages
    label_key: str = "label"
    metadata_key: str = "metadata"
    apply_chat_template: bool = True
    system_prompt: str = ""
    shuffle: bool = True
    seed: int = 0
    num_examples: int = 10000  # procedural tasks: examples per epoch
    task_kwargs: dict[str, Any] = {}  # passed to the procedural task / reasoning-gym dataset
    max_prompt_tokens: int = 512
    overlong: Literal["truncate", "skip"] = "skip"  # what to do with a longer prompt (counted either way)
    on_bad_line: Literal["error", "skip"] = "error"  # a malformed dataset line: fail naming it, or skip+count


class SamplingConfig(_Base):
    temperature: float = 1.0
    top_p: float = 1.0
    # sample among the k most likely tokens only; -1 or 0 = off (SGLang's -1). With top_p too, a token
    # is kept when it is in the top k and the tokens ranked above it hold less than top_p of the mass
    # (SGLang's joint filter); the engines' logprobs are then of the truncated distribution, the
    # trainer's are not (docs/rollouts.md, "Sampling"): TIS corrects the difference
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: list[int] = []  # empty = the tokenizer's eos
    # strings that end a response: it stops at the token whose text completes one of them (that token
    # kept, finish "stop"); in addition to stop_token_ids / eos
    stop: list[str] = []

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.sampling.temperature={self.temperature}: must be > 0; greedy decoding has no "
                "sampling distribution, so its logprobs cannot drive importance-sampling corrections"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(
                f"rollout.sampling.top_k={self.top_k}: must be >= 1, or -1 / 0 for no top-k truncation"
            )
        if self.max_new_tokens < 1:
            raise ValueError("rollout.sampling.max_new_tokens must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError(
                f"rollout.sampling.stop={self.stop!r}: an empty string would stop every response at its "
                "first token; remove it"
            )


class SGLangConfig(_Base):
    tp_size: int = 1
    mem_fraction_static: float = 0.5
    base_gpu_id: int = 0  # standalone engines; in a pipeline run the GPUs Ray gave the generator replace it
    pause_mode: Literal["in_place", "retract"] = "in_place"
    startup_timeout_s: float = 300.0
    disable_cuda_graph: bool = False
    # appended to `python -m sglang.launch_server ...` as given; numbers are fine ([--context-length, 8192]).
    # Each --flag is checked against SGLang's server arguments (stages/rollout/sglang_args.py) when the
    # config loads: a typo is named there, not by the server's start
    extra_args: list[str | int | float] = []
    host: str = "127.0.0.1"  # the server binds here (loopback: the engine is reached only from this host)
    port: int = 0  # first engine's HTTP port (engine i uses port + 10 i); 0 = a free port per engine
    # tokens per streamed chunk; a chunk that straddles a weight update is tagged with the older version,
    # so a larger interval means fewer HTTP chunks but more tokens counted one version staler than they are
    stream_interval: int = 4
    request_timeout_s: float = 3600.0  # one generate request that takes longer than this fails
    control_timeout_s: float = 300.0  # pause / weight load / version / NCCL group calls
    health_timeout_s: float = 5.0  # check_health(): /health must answer within this
    # while generating, check every server this often and restart a dead one, or a live one whose /health
    # missed two checks in a row (0 = never): stages/rollout/engine_watch.py
    health_check_s: float = 30.0
    # keep a host copy of the last weights pushed from tensors, so that restart() can bring a relaunched
    # server back to the current version by itself (costs the model's size in host memory)
    keep_weights_copy: bool = True
    log_dir: str = ""  # server logs and re-sync checkpoints; empty = a fresh temporary folder
    # SGLang's prefix (radix) cache across requests: a group's members and an episode's later turns reuse
    # the prompt's KV. A cached prefix keeps the KV of the weights it was computed with, so requests are
    # keyed by the weight version they are sent for (SGLang's extra_key, moved on before each update's
    # pause): none reuses KV of other weights, except as any request in flight at a push continues over
    # the new weights. Off by default until measured on GPUs (issue #40: with the cache on and no key,
    # logp/abs_diff_same_version was 0.58 against 0.006 off)
    radix_cache: bool = False
    # once a server answers /health (and after each relaunch), move its processes' start-up objects out of
    # Python's garbage collector (SGLang's /freeze_gc). Without it, on an H100 the HTTP process ran a full
    # collection over ~0.9M objects every ~6 s that took 0.5-0.67 s, during which it answered nothing:
    # a weight push whose pause met one stalled generation that long (bench/RESULTS.md, GPU session of
    # 2026-11-27). Frozen, a server under 256 streams logged no collection over 50 ms in 30 s, against
    # six of ~0.5 s unfrozen (bench/sglang_gc.py): most of what they walked was there from start-up
    freeze_gc: bool = True

    def __post_init__(self):
        check_extra_args(self.extra_args)


class AgentConfig(_Base):
    """`rollout.agent`: the OpenAI-compatible endpoint an agent_fn runs against, and an episode's budgets
    (stages/rollout/agent_run.py; docs/rollouts.md, "Agents")."""

    host: str = "127.0.0.1"  # the endpoint binds here (loopback: agents run in the generator's process)
    port: int = 0  # 0 = a free port per generator; a fixed port serves one generator only
    # an episode (one agent_fn call) running longer is cancelled and ends `truncated` with what it made
    timeout_s: float = 600.0
    # model calls per episode; a call past it is refused (HTTP 400) and the episode ends `truncated`
    max_turns: int = 32
    model_name: str = "policy"  # what /v1/models lists; requests may name any model (there is one)

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"rollout.agent.timeout_s={self.timeout_s}: must be > 0 (seconds per episode)")
        if self.max_turns < 1:
            raise ValueError(
                f"rollout.agent.max_turns={self.max_turns}: must be >= 1 (model calls per episode)"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"rollout.agent.port={self.port}: a TCP port (0 = a free one)")


class RolloutConfig(_Base):
    num_generators: int = 1
    engine: Literal["torch", "sglang"] = "torch"
    device: str = "cpu"  # torch engine: "cpu" or "cuda[:N]"
    engines_per_generator: int = 1
    group_size: int = 8  # samples per prompt (GRPO group)
    max_inflight_groups: int = 8  # groups being generated at once per generator
    # requests (sequences) in flight per generator, over its engines; 0 = no cap but the groups'. With a
    # long length tail most of a group's life is its last few sequences, so a group cap leaves the
    # engine half empty; a request cap (like slime's sglang_server_concurrency) starts new groups as
    # sequences finish, up to max_inflight_groups and the staleness bound
    max_inflight_requests: int = 0
    # cancel a group still generating once it can no longer be trained within run.max_staleness (the
    # buffer would evict it on arrival): the engine decodes something else instead
    abort_stale_groups: bool = True
    max_batch_size: int = 64  # sequences decoded together by the torch engine
    chunk_tokens: int = 8  # torch engine: decode steps between checks for a weight update
    # which groups reach the buffer: "none", "nonzero_std" (dynamic sampling: drop groups whose rewards
    # are all equal) or "module:function" / "file.py:function" taking the scored group -> True to keep it
    filter: str = "none"
    # custom rollouts (docs/rollouts.md), each "package.module:function" or "path/to/file.py:function":
    # generate_fn makes one group (or one sample) from a prompt; "" = the built-in single-turn generator
    generate_fn: str = ""
    generate_per_sample: bool = False  # call generate_fn once per sample instead of once per group
    generate_kwargs: dict[str, Any] = {}  # handed to generate_fn / rollout_fn as ctx.kwargs
    # rollout_fn replaces the generation loop: an async iterator of groups streamed to the buffer under
    # the same admission control (stages/rollout/custom_loop.py); it excludes generate_fn
    rollout_fn: str = ""
    # agent_fn runs each episode as an agent against an OpenAI-compatible endpoint the generator serves:
    # `async def fn(base_url, api_key, record, session_id, **generate_kwargs) -> float | None`
    # (stages/rollout/agent_run.py); it replaces generate_fn, and rollout.agent holds its endpoint and budgets
    agent_fn: str = ""
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    engine_retries: int = 1  # an engine error fails the group; retry it this many times
    delay_model: str = ""  # bench only: "longtail:<mean_s>" adds a per-sequence engine delay
    # a group past the staleness bound continues from its tokens so far instead of being dropped; those
    # tokens are kept untrained (loss_mask 0), as context (slime's --partial-rollout with
    # --mask-offpolicy-in-partial-rollout; stages/rollout/partial.py). The built-in single-turn generation only
    partial_rollout: bool = False
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)

    def __post_init__(self):
        for key in ("generate_fn", "rollout_fn", "agent_fn", "filter"):
            spec = getattr(self, key)
            if key == "filter" and spec in BUILTIN_FILTERS:
                continue
            if spec and not is_hook_spec(spec):
                raise ValueError(
                    f"rollout.{key}={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'"
                    + (f" or one of {', '.join(BUILTIN_FILTERS)}" if key == "filter" else "")
                )
            setattr(self, key, absolute_spec(spec))  # the stages may run in another directory
        if self.max_inflight_requests and self.max_inflight_requests < self.group_size:
            raise ValueError(
                f"rollout.max_inflight_requests={self.max_inflight_requests} is below rollout.group_size="
                f"{self.group_size}: no group could start; set it to 0 (no request cap) or >= group_size"
            )
        if self.agent_fn and (self.generate_fn or self.rollout_fn or self.generate_per_sample):
            raise ValueError(
                "rollout.agent_fn runs each episode itself, through the generator's OpenAI-compatible "
                "endpoint: leave rollout.generate_fn, rollout.rollout_fn and rollout.generate_per_sample unset"
            )
        self.delay_mean_s()  # a malformed delay_model fails here, at load
        if self.partial_rollout and (
            self.generate_fn or self.rollout_fn or self.agent_fn or self.generate_per_sample
        ):
            raise ValueError(
                "rollout.partial_rollout continues the built-in single-turn generation from its tokens; a "
                "custom rollout.generate_fn / rollout_fn / agent_fn / generate_per_sample keeps state of its "
                "own between engine calls: turn partial_rollout off, or recycle in your own function"
            )
        if self.partial_rollout and not self.abort_stale_groups:
            raise ValueError(
                "rollout.partial_rollout recycles the groups abort_stale_groups would drop: it needs "
                "rollout.abort_stale_groups=true"
            )
        if self.generate_fn and self.rollout_fn:
            raise ValueError(
                "rollout.rollout_fn replaces the generation loop, generate_fn included: set one of them "
                "(a rollout_fn can call its own per-group function)"
            )

    def delay_mean_s(self) -> float:
        """rollout.delay_model's mean seconds per group (0: none)."""
        if not self.delay_model:
            return 0.0
        kind, _, mean = self.delay_model.partition(":")
        if kind != "longtail" or not mean:
            raise ValueError(
                f"rollout.delay_model={self.delay_model!r}: expected '' or 'longtail:<mean seconds>'"
            )
        return float(mean)
