"""The policy's LoRA adapters as PEFT has them (trainer.lora, issue #37): gathered from every rank under
PEFT's names, written as a PEFT folder (adapter_config.json + adapter_model.safetensors) that
`peft.PeftModel.from_pretrained` loads, read back from one (trainer.lora.init_from), and sent to the
engines as they are (trainer.lora.push=adapter).

Imports nothing of lora.py at module level (lora.py re-exports these functions for its callers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<HF module>.lora_A.weight
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_config(lora) -> dict:
    c = lora.cfg
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": c.rank,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "target_modules": sorted({p for m in lora.modules for p in m.targeted}),
        "modules_to_save": sorted(c.modules_to_save) or None,
        # a tied model trains one matrix for embed_tokens and lm_head: peft must keep them one
        "ensure_weight_tying": bool(lora.hc.tie_word_embeddings and "embed_tokens" in c.modules_to_save),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def gather_peft_state(
    lora, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """Every adapter of the policy under PEFT's names, full, fp32 and on the CPU, on global rank 0; None
    elsewhere. Collective: every rank calls it. The dense adapters' TP shards are gathered inside DP
    replica 0's TP groups, the experts' ETP shards inside every expert-TP group (they span data-parallel
    ranks: each EP rank holds other experts); each part then goes to rank 0 from one rank that has it.
    `transform(name, t)`, if given, makes each full tensor what is kept (another dtype, a scale) before
    it leaves the device it was gathered on: there an elementwise op is one kernel, where on the host it
    costs the push (a 135M rank-64 adapter set cast on the engine's host: 29 ms of an 86 ms push)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def host(n: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        return n, (t if transform is None else transform(n, t)).cpu()

    local: dict[str, torch.Tensor] = {}
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()

        def tp_shards(t: torch.Tensor) -> list[torch.Tensor]:
            if tp == 1:
                return [t]
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=group)
            return shards

        for site in lora.sites.values():
            local.update(host(n, t) for n, t in site.peft_state(PEFT_PREFIX, tp_shards))
        if ps.get_tensor_model_parallel_rank() != 0:
            local = {}
    experts: dict[str, torch.Tensor] = {}
    for ex in lora.experts:  # every rank: the expert-TP gathers
        experts.update(host(n, t) for n, t in ex.peft_state(PEFT_PREFIX))
    if ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0:
        local.update(experts)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    return {n: t for part in parts for n, t in part.items()}


def adapter_push_state(lora, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """What trainer.lora.push=adapter sends besides the modules trained whole: each adapter's A and B
    under the adapted HF module's name (`<module>.lora_A.weight`, `<module>.lora_B.weight`), B scaled by
    alpha/r, so that the engine adds x A^T B^T to the module's output with no config of its own; in
    `dtype` (default fp32), both made on the device the adapters live on (gather_peft_state's transform):
    the engine then writes the tensors as they come. On rank 0; None elsewhere. Collective."""
    scale = lora.cfg.alpha / lora.cfg.rank

    def push_form(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith(".lora_B.weight"):  # scaled in fp32, then rounded once to `dtype`
            t = t * scale
        return t if dtype is None else t.to(dtype)

    state = gather_peft_state(lora, push_form)
    if state is None:
        return None
    return {n[len(PEFT_PREFIX) :]: t for n, t in state.items()}


def save_peft(lora, out_dir: str, base_model: str, hf_state: dict | None = None) -> str | None:
    """Write the adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors) on global
    rank 0; returns its path there, None elsewhere. Collective: every rank calls it. The modules trained
    whole (modules_to_save) are taken from `hf_state`, the full HF state on rank 0."""
    from safetensors.torch import save_file

    tensors = gather_peft_state(lora)
    if tensors is None:
        return None
    whole = set(lora.cfg.modules_to_save)
    for name, t in (hf_state or {}).items():  # PEFT saves a module_to_save under its own name
        if any(name.rsplit(".", 1)[0].endswith(m) for m in whole):  # peft's rule: a suffix of the module
            tensors[PEFT_PREFIX + name] = t.contiguous()
            if name == "model.embed_tokens.weight" and lora.hc.tie_word_embeddings:
                tensors[PEFT_PREFIX + "lm_head.weight"] = t.clone()  # peft ties it back (one matrix)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(
        json.dumps(dict(peft_config(lora), base_model_name_or_path=base_model), indent=2)
    )
    return str(path)


def read_peft(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter folder's config and tensors; a clear error for what is not one."""
    from safetensors.torch import load_file

    path = Path(folder)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"trainer.lora.init_from={folder!r} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} "
            f"and {ADAPTER_WEIGHTS} (what peft's save_pretrained writes)"
        )
    return json.loads((path / ADAPTER_CONFIG).read_text()), load_file(str(path / ADAPTER_WEIGHTS))


def load_peft_into(lora, folder: str) -> None:
    """Start the adapters from a PEFT folder of the same rank and target modules (refused otherwise).
    Experts are read in the per-expert form this trainer writes (lora_experts.py)."""
    cfg, tensors = read_peft(folder)
    if int(cfg.get("r", -1)) != lora.cfg.rank or float(cfg.get("lora_alpha", -1)) != lora.cfg.alpha:
        raise ValueError(
            f"trainer.lora.init_from={folder!r} has r={cfg.get('r')} lora_alpha={cfg.get('lora_alpha')}; "
            f"set trainer.lora.rank and trainer.lora.alpha to match"
        )

    def get(module: str) -> tuple[torch.Tensor, torch.Tensor]:
        base = PEFT_PREFIX + module
        try:
            return tensors[f"{base}.lora_A.weight"], tensors[f"{base}.lora_B.weight"]
        except KeyError:
            fused = cfg.get("target_parameters") and ".experts." in module
            raise ValueError(
                f"trainer.lora.init_from={folder!r} has no adapter for {module}; "
                + (
                    "it targets the fused experts (target_parameters), which this trainer does not read: "
                    "start from a folder with per-expert adapters (target_modules gate_proj, up_proj, "
                    "down_proj), or drop those from trainer.lora.target_modules"
                    if fused
                    else "its target_modules must include trainer.lora.target_modules"
                )
            ) from None

    for site in lora.sites.values():
        site.load_peft({p: get(site.hf_name(p)) for p in site.targeted})
    for ex in lora.experts:
        ex.load_peft(get)
