"""Export the megatron policy as full HF-named tensors on global rank 0 (for weight pushes and HF
checkpoints), and write a save_pretrained-compatible folder.

Collective: every rank must call `export_hf_state` together. TP shards are gathered inside each TP
group of data-parallel replica 0; pipeline stages > 0 then send their HF tensors to rank 0 (the
stage leaders tp=0/dp=0 are exactly the members of rank 0's pipeline group). MoE experts are gathered
over their expert-TP and expert-parallel groups, which span data-parallel ranks, so every rank takes
part in those (stages/trainer/moe.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist

from stages.trainer import hf_mapping, moe
from stages.trainer.model import Policy, unwrap
from stages.weights.config import DIRECT_NEEDS_ONE_STAGE

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "added_tokens.json",
)


def _local_hf(
    policy: Policy, dense: bool = True, adapted_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters, TP-merged and renamed to HF (on every rank of DP replica 0), one
    parameter at a time: only one gathered tensor exists at once, never a whole-model copy (an expert
    parameter: one per EP rank). Every rank must consume it to the end (each parameter's gather is a
    collective); `dense=False` (ranks outside DP replica 0) takes part in the expert gathers only.
    With LoRA (policy.lora) the adapted weights come merged (base + scale B.A) and the adapters
    themselves not at all; `adapted_only` keeps just the HF tensors that have adapters (the others
    never change: what a push sends)."""
    from megatron.core import parallel_state as ps

    m = unwrap(policy.model)
    hc = policy.hf_config
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    lora = policy.lora
    for key, p in m.named_parameters():
        if lora is not None and lora.is_adapter_param(key):
            continue
        adapter = lora.adapter_for(key) if lora is not None else None
        if adapted_only and not lora.changes(key):  # decided by the key: alike on every rank of a collective
            continue
        layer = None
        if key.startswith("decoder.layers."):
            layer = m.decoder.layers[int(key.split(".")[2])].layer_number - 1
        if moe.is_expert_param(key):  # every EP rank holds its own experts (and their adapters)
            t = p.detach() if adapter is None else lora.merged(key, p.detach())
            for global_key, full in moe.gather_experts(key, t, hc, hf_mapping.merge_tp):
                if dense:
                    pairs = hf_mapping.mcore_to_hf(global_key, full, hc, layer, policy.te)
                    yield from _targeted(pairs, adapter if adapted_only else None)
            continue
        if not dense:
            continue
        t = p.detach() if adapter is None else lora.merged(key, p.detach())
        layout = hf_mapping.tp_layout(key) if tp > 1 else "replicated"
        if layout in ("col", "qkv"):
            # the shards' rows concatenate (merge_tp): gathered straight into the full tensor, without
            # shard copies beside it (at 7B the embedding's are another 1 GiB)
            full = t.new_empty((tp * t.shape[0], *t.shape[1:]))
            dist.all_gather_into_tensor(full, t.contiguous(), group=group)
        elif layout != "replicated":
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=group)
            full = hf_mapping.merge_tp(key, shards, hc)
            del shards
        else:
            full = t
        pairs = hf_mapping.mcore_to_hf(key, full, hc, layer, policy.te)
        yield from _targeted(pairs, adapter if adapted_only else None)
        del full  # before the next parameter's gather: one gathered tensor at a time


def _targeted(pairs: list, adapter) -> list:
    """Of a fused weight's HF tensors (q/k/v, gate/up, an expert's gate/up), those of the modules
    `adapter` adapts; all without one."""
    if adapter is None:
        return pairs
    return [(n, w) for n, w in pairs if n.rsplit(".", 2)[-2] in adapter.targeted]


class HostSnapshot:
    """Pinned host buffers for the weights, reused from push to push. A GPU-to-host copy into pinned
    memory runs at full PCIe speed and can be queued without a sync per tensor; pinning is slow, so it
    is done once. Reuse is safe because the trainer waits for the previous push before the next
    snapshot."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


def iter_hf_state(policy: Policy, adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of export_hf_state, lazily and without copies: each full HF tensor on global rank 0
    where it was gathered (the trainer's GPU), one at a time, possibly a view of a live parameter;
    nothing on the other ranks. Collective: every rank consumes it to the end, in step, before any other
    collective. For weights.snapshot=direct, which pushes while training waits, so that no rank holds a
    copy of the model. Pipeline stages send rank 0 their tensors ahead of a push (export_hf_state), so
    this takes one stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(DIRECT_NEEDS_ONE_STAGE)
    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:  # the expert gathers only
        for _ in _local_hf(policy, dense=False, adapted_only=adapted_only):
            pass
        return
    rank0 = dist.get_rank() == 0
    for name, t in _local_hf(policy, adapted_only=adapted_only):
        if rank0:
            yield name, t
        del t  # let it go before the next gather (the consumer packs it and drops its own reference)


def export_hf_state(
    policy: Policy,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    host: HostSnapshot | None = None,
    adapted_only: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Full HF state dict on global rank 0 (fresh copies on `device`, or in `host`'s pinned buffers);
    None on other ranks.

    The copies are what makes a background push safe: training may update the parameters right after.
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:  # CP ranks hold the same weights
        for _ in _local_hf(policy, dense=False, adapted_only=adapted_only):  # but other experts (EP)
            pass
        return None
    local = _local_hf(policy, adapted_only=adapted_only)
    pp = ps.get_pipeline_model_parallel_world_size()
    leader = ps.get_tensor_model_parallel_rank() == 0
    rank = dist.get_rank()

    def fix(name, t):
        t = t.to(dtype or t.dtype)
        if host is not None:
            return host.copy(name, t.contiguous())
        return t.to(device, copy=True).contiguous()

    def done(state):
        if host is not None and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies were queued without waiting
        return state

    if pp == 1 or not leader:
        if rank != 0:
            for _ in local:  # take part in every gather
                pass
            return None
        return done({n: fix(n, t) for n, t in local})
    local = list(local)  # pipeline stages: the names and shapes go to rank 0 ahead of the tensors
    stage_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    if rank != 0:  # a stage leader: metadata first, then the tensors in that order
        dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in local]], dst=0)
        for _, t in local:
            dist.send(t.contiguous(), dst=0)
        return None
    state = {n: fix(n, t) for n, t in local}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for src in stage_ranks[1:]:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        for name, shape, dt in meta[0]:
            buf = torch.empty(shape, dtype=dt, device=dev)
            dist.recv(buf, src=src)
            state[name] = fix(name, buf)
    return done(state)


def save_hf(state: dict[str, torch.Tensor], source_path: str, out_dir: str, dtype: str | None = None) -> str:
    """Write config.json + model.safetensors + tokenizer files copied from the source folder."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(source_path, "config.json")) as f:
        config = json.load(f)
    if dtype:
        config["torch_dtype"] = config["dtype"] = dtype
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    # tied embeddings: HF expects only model.embed_tokens.weight (lm_head is re-tied at load)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        src = os.path.join(source_path, name)
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(out_dir, name))
    return out_dir


class PolicyExport:
    """The policy's weights as the weight publisher takes them (stages/weights/publisher.WeightExport):
    a snapshot of fresh copies, a lazy stream for direct pushes, and the model's size."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def snapshot(
        self, *, device: str = "cpu", host: HostSnapshot | None = None
    ) -> dict[str, torch.Tensor] | None:
        state = export_hf_state(self.policy, device=device, host=host, adapted_only=self._adapted_only)
        if self.pushes_adapters:  # collective: the adapters themselves, beside the modules trained whole
            from stages.trainer.lora_peft import adapter_push_state

            adapters = adapter_push_state(self.policy.lora, dtype=self.weights_dtype)
            if state is not None:
                state.update((n, t.to(device)) for n, t in adapters.items())
        return state

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.pushes_adapters:  # the publisher refuses this pairing when the sender is attached
            raise ValueError("trainer.lora.push=adapter takes weights.snapshot=auto (no direct pushes)")
        return iter_hf_state(self.policy, adapted_only=self._adapted_only)

    @property
    def pushes_adapters(self) -> bool:
        """trainer.lora.push=adapter: a push sends the adapters (and the modules trained whole), which
        the engine applies over the base it keeps (only the torch engine takes them)."""
        return self.policy.lora is not None and self.policy.lora.cfg.push == "adapter"

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype a push carries the policy's weights in: export_hf_state keeps each parameter's, bf16
        under megatron's Float16Module (trainer.precision=bf16), else fp32. The adapters of an adapter
        push go in it too, cast on the trainer's GPU: an SGLang server serving bf16 then writes them
        as they come, where a cast on its host cost 29 ms of an 86 ms push (135M, rank 64, H200)."""
        return torch.bfloat16 if getattr(self.policy.config, "bf16", False) else torch.float32

    @property
    def _adapted_only(self) -> bool:
        """With LoRA a push sends only what training changes (Lora.changes: the modules trained whole,
        and with push=merge the merged tensors that have adapters): the engines hold the same frozen
        base for the rest (they start from the model folder the trainer started from)."""
        return self.policy.lora is not None

    def host_buffers(self) -> HostSnapshot:
        return HostSnapshot()

    def model_bytes(self) -> int:
        """The whole model's bytes, about what a push sends (at most: megatron pads the vocabulary):
        this rank's share times the ranks that hold the others (TP and PP; for expert parameters EP,
        expert-TP and PP)."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        dense = ps.get_tensor_model_parallel_world_size() * pp
        experts = ps.get_expert_model_parallel_world_size() * ps.get_expert_tensor_parallel_world_size() * pp
        lora = self.policy.lora
        return sum(
            p.numel() * p.element_size() * (experts if moe.is_expert_param(key) else dense)
            for key, p in unwrap(self.policy.model).named_parameters()
            if lora is None or lora.changes(key)
        )
