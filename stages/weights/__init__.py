"""Weight push from the trainer to the inference engines.

The package's layers, bottom up: base.py (the WeightSender / PushHandle interface every transport
implements) and buckets.py (how a push is cut into buckets); config.py (the `weights:` section);
sglang_protocol.py (the HTTP routes and bodies an SGLang server's weight update takes, shared with
stages/rollout/sglang_engine.py); the transports, each importing base.py and never this module:
zmq_transport.py (cpu: torch engines over ZeroMQ), sglang_transport.py (the push sequence into SGLang
servers) with nccl_sender.py and cuda_ipc_sender.py. `make_sender` (here) picks one for a config; it
imports the transports when called, so that reading a config never imports torch or ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.weights.config import WeightsConfig

if TYPE_CHECKING:
    from buffer.curve import CurveKeys
    from stages.weights.base import WeightSender

__all__ = ["make_sender"]


def make_sender(
    cfg: WeightsConfig,
    *,
    engine_urls: list[str] | None = None,
    min_engines: int = 0,
    bind: str | None = None,
    engine_tp_sizes: list[int] | None = None,
    pause_mode: str = "in_place",
    master_address: str = "127.0.0.1",
    curve: CurveKeys | None = None,
    restart_grace_s: float = 0.0,
) -> WeightSender:
    """WeightSender for `weights.transport` (cfg: WeightsConfig).

    cpu: a ZmqWeightSender bound at `bind or cfg.bind`; torch engines connect WeightReceivers to its
    `.address`, and each push waits (within timeout_s) until `min_engines` have connected.
    nccl / cuda_ipc: pushes straight into the SGLang servers at `engine_urls` (TP size per server in
    `engine_tp_sizes`, default 1; `pause_mode` as rollout.sglang.pause_mode; NCCL's rendezvous at
    `master_address`, this process's host as the servers reach it; `restart_grace_s`: how long a
    push may leave out a server that cannot be reached while it restarts). `curve`: the run's CurveKeys
    (buffer/curve.py) for the cpu transport's socket, None for none.
    auto: cpu without engine_urls, else nccl when this process sees 2+ GPUs and cuda_ipc otherwise;
    inside a Ray actor that was given one GPU this always says cuda_ipc, so GPU configs name the
    transport explicitly.
    """
    import torch

    kind = cfg.transport
    if kind == "auto":
        kind = "cpu"
        if engine_urls:
            kind = "nccl" if torch.cuda.device_count() > 1 else "cuda_ipc"
    if kind == "cpu":
        import zmq

        if cfg.snapshot == "direct":  # before any process starts pushing: a clear error at start-up
            raise ValueError(
                "weights.snapshot=direct pushes from the trainer's GPUs into SGLang servers (weights.transport "
                "nccl or cuda_ipc); the cpu transport keeps each push for engines that join later: use "
                "weights.snapshot=auto"
            )

        from stages.weights.zmq_transport import ZmqWeightSender

        try:
            return ZmqWeightSender(
                bind or cfg.bind,
                bucket_mb=cfg.bucket_mb_for("cpu"),
                timeout_s=cfg.timeout_s,
                min_engines=min_engines,
                curve=curve,
            )
        except zmq.ZMQError as e:
            raise ValueError(
                f"weights.bind={bind or cfg.bind}: cannot bind ({e}); pick a free port, or port 0 for any"
            ) from None
    if kind in ("nccl", "cuda_ipc"):
        if not engine_urls:
            raise ValueError(f"weights.transport={kind} needs the SGLang server URLs (engine_urls)")
        common = dict(
            bucket_mb=cfg.bucket_mb_for(kind),
            timeout_s=cfg.timeout_s,
            engine_tp_sizes=engine_tp_sizes,
            pause_mode=pause_mode,
            restart_grace_s=restart_grace_s,
        )
        if kind == "nccl":
            from stages.weights.nccl_sender import NcclSGLangSender

            return NcclSGLangSender(
                engine_urls,
                master_address=master_address,
                receive=cfg.nccl_receive,
                **common,
            )
        from stages.weights.cuda_ipc_sender import CudaIpcSGLangSender

        return CudaIpcSGLangSender(engine_urls, **common)
    raise ValueError(f"weights.transport={kind!r} has no sender yet (cpu, nccl, cuda_ipc)")
