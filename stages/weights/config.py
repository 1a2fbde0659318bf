"""Weight-push sub-config (`weights:` section)."""

from __future__ import annotations

from typing import Literal

import msgspec


class WeightsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    push_every: int = 1  # push after every K optimizer steps
    # auto: cpu for the torch engine, nccl for disaggregated SGLang, cuda_ipc for colocated SGLang
    transport: Literal["auto", "cpu", "nccl", "cuda_ipc"] = "auto"
    # tensors are sent in buckets of about this size; 0 = by transport (BUCKET_MB). An SGLang bucket costs
    # ~4 ms beyond its bytes (an HTTP round trip into the server's scheduler and its load): at 7B in 512
    # MB buckets that was 2/3 of an NCCL push (bench/RESULTS.md), so the SGLang transports use large ones
    bucket_mb: int = 0
    timeout_s: float = 120.0  # a push not applied by every engine within this long raises in the trainer
    bind: str = "tcp://127.0.0.1:0"  # cpu transport: the trainer binds here (port 0 = free); engines connect
    # where the trainer keeps the copy of the weights a push sends while training goes on. gpu: on
    # trainer rank 0's GPU (fastest; costs the model's bf16 size there, 15 GB at 7B); cpu: pinned host
    # memory, filled one gathered tensor at a time, so no GPU ever holds a whole-model copy. direct (the
    # SGLang transports, trainer.pp 1): no copy; rank 0 pushes each bucket as the ranks gather it from
    # the live weights and training waits for the push. auto: gpu for the SGLang transports unless the
    # model is over 10 % of the GPU's memory, then direct (cpu with pipeline stages). At 7B on H100s the
    # cpu copy took ~0.34 s of each step and was copied back to the GPU while the engines stood paused
    # (~0.35 s a push); direct took ~0.16 s of both (bench/RESULTS.md, 2026-11-27)
    snapshot: Literal["auto", "gpu", "cpu", "direct"] = "auto"
    # how an SGLang server receives an NCCL push. per_tensor: one broadcast per tensor, each received
    # into a tensor of its own and loaded, sent from the trainer's tensors as they lie; flat: one
    # broadcast per bucket, which SGLang 0.5.17 receives into a buffer it first fills by copying
    # freshly allocated tensors (the server holds the bucket twice), and the trainer packs into one.
    # A 7B push (45 MB a tensor on average) into a generating server took 1.79x a raw broadcast
    # per_tensor, 2.14x flat, in 4 GB buckets (bench/RESULTS.md, 2026-11-27, 2x H200); at 135M (1 MB a
    # tensor) a per-tensor broadcast alone is 11 ms against 0.8 ms flat, more than flat's copies.
    # auto: per_tensor for a bucket whose tensors average PER_TENSOR_MIN_MEAN_MB or more, else flat
    nccl_receive: Literal["auto", "flat", "per_tensor"] = "auto"

    def __post_init__(self):
        if self.push_every < 0 or self.bucket_mb < 0 or self.timeout_s <= 0:
            raise ValueError(
                "weights needs push_every >= 0 (0 = never), bucket_mb >= 0 (0 = by transport) and timeout_s > 0"
            )

    def bucket_mb_for(self, transport: str) -> int:
        """The bucket size a transport uses: bucket_mb, or the transport's own default when it is 0."""
        return self.bucket_mb or BUCKET_MB[transport]


# a direct push reads the weights as each rank gathers them; pipeline stages send rank 0 theirs ahead
DIRECT_NEEDS_ONE_STAGE = (
    "weights.snapshot=direct needs trainer.pp=1 (pipeline stages send rank 0 their weights ahead of a push): "
    "use weights.snapshot=auto"
)

# weights.nccl_receive=auto's crossover, from the raw figures on H200s (bench/RESULTS.md): one more NCCL
# call costs ~37 us where its bytes do not hide it (370 GB/s), flat's two extra copies ~1.2 ms a GB;
# they break even near 10 MB a tensor (measured on either side: 1 MB flat faster, 45 MB per_tensor)
PER_TENSOR_MIN_MEAN_MB = 10

# 0 = by transport. cpu: buckets stream over ZeroMQ while the next is packed; cuda_ipc: the flat copy
# sits on the GPU that trainer and engine share; nccl: every TP rank of a server receives a whole bucket
# before it loads it, needing its size outside its static memory (mem_fraction_static; twice that with
# weights.nccl_receive=flat)
BUCKET_MB = {"cpu": 64, "cuda_ipc": 1024, "nccl": 4096}
