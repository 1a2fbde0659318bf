"""All of a layer's local experts in two `torch._grouped_mm` calls, without transformer-engine.

megatron-core's local spec runs experts as SequentialMLP, a Python loop over them: at Qwen3-30B-A3B's
layer shape (128 experts, top-8, hidden 2048, expert ffn 768) that loop ran at 11 TFLOP/s on an H200
against 322 for one grouped GEMM per projection (shared/notes/moe-grouped-gemm.md). megatron's own
GroupedMLP has the right layout but calls `grouped_gemm.ops.gmm`, a package without a wheel, and its
TE variant needs transformer-engine (no wheel either). torch >= 2.9 ships `torch._grouped_mm` (bf16 on
Hopper GPUs, any float dtype on CPU), so this module keeps GroupedMLP's parameters, initialisation,
expert-tensor-parallel split and checkpoint layout, and replaces only its forward.

Parameters (GroupedMLP's): `weight1` [h, E_local * 2F/etp], read as [E_local, h, 2F/etp] where expert
e's block is its linear_fc1 transposed, cat(gate, up) along the output; `weight2` [E_local * F/etp, h],
read as [E_local, F/etp, h] = each expert's linear_fc2 transposed. `moe.py` maps them to and from the
per-expert HF tensors.

LoRA on the experts (stages/trainer/lora_experts.py) adds its low-rank outputs to each projection through
`lora_delta`, inside the forward: fc1's before the activation.
"""

from __future__ import annotations

import contextlib
import types

import torch
from megatron.core.transformer.moe import grouped_gemm_util
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `_grouped_mm`'s backward refuses
    gradients with zero or odd strides (an expanded `sum()` gradient, a transposed view)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for these inputs here: CPU (any float dtype; a reference
    implementation, fine for tests), CUDA in bf16 on compute capability 9.0+ (CUTLASS kernels) or 8.x
    (torch's fallback)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


@contextlib.contextmanager
def _grouped_gemm_present():
    """GroupedMLP.__init__ asserts that the `grouped_gemm` package imported; this forward does not use
    it, so the check is answered for the constructor's duration only."""
    saved = grouped_gemm_util.grouped_gemm
    if saved is None:
        grouped_gemm_util.grouped_gemm = types.SimpleNamespace(ops=None)
    try:
        yield
    finally:
        grouped_gemm_util.grouped_gemm = saved


class GroupedExperts(GroupedMLP):
    """megatron's GroupedMLP with its grouped GEMMs done by `torch._grouped_mm`."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None):
        if config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input is not supported by the grouped experts")
        with _grouped_gemm_present():
            super().__init__(num_local_experts, config, pg_collection=pg_collection)
        # trainer.lora: (projection "fc1" / "fc2", rows, offsets or None for no rows) -> the adapters'
        # output to add, or None. A plain function, not a child module: the adapters belong to the
        # decoder layer (they checkpoint apart from GroupedMLP's sharded weights)
        self.lora_delta = None

    def _project(self, which: str, x: torch.Tensor, w: torch.Tensor, offs) -> torch.Tensor:
        out = torch._grouped_mm(x, w, offs=offs) if offs is not None else x @ w[0]
        extra = self.lora_delta(which, x, offs) if self.lora_delta is not None else None
        return out if extra is None else out + extra

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """hidden [rows, h]: the dispatcher's tokens sorted by local expert, `tokens_per_expert[e]` rows
        each; probs [rows]: each row's routing weight, applied after the activation (as GroupedMLP
        does). Returns (out [rows, h], None)."""
        n, h = self.num_local_experts, self.config.hidden_size
        w1, w2 = self.weight1.view(n, h, -1), self.weight2.view(n, -1, h)
        if hidden.shape[0] == 0:
            # no token for these experts: a product that is empty but touches both weights (offs None),
            # so that every expert parameter still gets a (zero) gradient, as GroupedMLP does
            inter = self.activation_func_with_probs(
                self._project("fc1", hidden, w1, None), probs.unsqueeze(-1)
            )
            return self._project("fc2", inter, w2, None), None
        # offsets: the end row of each expert's block, int32 on the GPU (the dispatcher counts on CPU)
        offs = torch.cumsum(tokens_per_expert.to(hidden.device, non_blocking=True), 0).to(torch.int32)
        fc1 = self._project("fc1", hidden, w1, offs)
        if self.activation_recompute:
            self.activation_checkpoint = _recompute_checkpoint()
            inter = self.activation_checkpoint.checkpoint(
                self.activation_func_with_probs, fc1, probs.unsqueeze(-1)
            )
            # registered on the sum with any LoRA output, whose backward reads `inter` too: the
            # recompute then refills it before either branch's backward runs
            out = self._project("fc2", inter, w2, offs)
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        else:
            inter = self.activation_func_with_probs(fc1, probs.unsqueeze(-1))
            out = self._project("fc2", inter, w2, offs)
        return _ContiguousGrad.apply(out), None


def _recompute_checkpoint():
    from megatron.core import tensor_parallel

    return tensor_parallel.CheckpointWithoutOutput()
