"""Trainer throughput: trained tokens/s and the share of step time spent waiting for data.

Synthetic complete groups go through a real in-process buffer (buffer.inproc.InProcBuffer) into the
megatron trainer; by default the buffer is filled ahead (pure trainer speed, wait share ~0); with
--produce-groups-per-s a producer thread feeds it at that rate instead, so the wait share shows how
much a slower generator starves the trainer.

  python bench/trainer_step.py                                   # CPU, tiny-qwen2
  python bench/trainer_step.py --device cuda --model smollm2-135m --precision bf16 --response-len 512

Prints one JSON line last: {"tokens_per_s", "data_wait_share", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2, smollm2-135m or an HF folder")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps not counted")
    ap.add_argument("--groups", type=int, default=8, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--produce-groups-per-s", type=float, default=0.0, help="0: buffer filled ahead")
    ap.add_argument("--threads", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    a = parse()
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from buffer.config import BufferConfig
    from buffer.inproc import InProcBuffer
    from pipeline.config import ModelConfig, RunConfig, trainer_run
    from stages.models import resolve_model
    from stages.trainer.testing import make_samples
    from stages.trainer.trainer import Trainer

    model_path = str(resolve_model(ModelConfig(name=a.model)))
    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    cfg = RunConfig()
    tc = cfg.trainer
    tc.batch_groups, tc.micro_batch_tokens, tc.precision, tc.threads = (
        a.groups,
        a.micro_batch_tokens,
        a.precision,
        a.threads,
    )
    tc.fetch_timeout_s, tc.resume = 600.0, False
    cfg.run.max_staleness, cfg.run.steps = 10**6, a.steps + a.warmup
    total = a.steps + a.warmup
    plen = (a.prompt_len // 2, a.prompt_len + 1)
    rlen = (a.response_len // 2, a.response_len + 1)

    def groups(i: int, n: int):
        return make_samples(
            n, a.group_size, vocab=vocab, seed=i, prompt_len=plen, response_len=rlen, prefix=f"b{i}-"
        )

    tmp = tempfile.mkdtemp(prefix="bench-trainer-")
    buf = InProcBuffer(
        cfg=BufferConfig(policy="fifo", durable=False, capacity_samples=10**6), directory=f"{tmp}/buf"
    )
    if a.produce_groups_per_s <= 0:
        for i in range(total):
            buf.put(groups(i, a.groups))
    else:

        def produce():
            for i in range(total * a.groups):
                buf.put(groups(i, 1))
                time.sleep(1.0 / a.produce_groups_per_s)

        threading.Thread(target=produce, daemon=True).start()
    trainer = Trainer(cfg.trainer, trainer_run(cfg, f"{tmp}/run"), buf, model_path, weights=cfg.weights)
    tokens = wait = step_s = 0.0
    for s in range(total):
        m = trainer.step()
        if s >= a.warmup:
            tokens += m["tokens/total"]
            wait += m["time/data_wait_s"]
            step_s += m["time/step_s"]
        print(
            f"step {m['version']}: {m['tokens/total']:.0f} tokens in {m['time/step_s']:.3f}s "
            f"(wait {m['time/data_wait_s']:.3f}s) loss {m['loss']:.4f}",
            flush=True,
        )
    import torch

    dev = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(
        json.dumps(
            {
                "tokens_per_s": round(tokens / step_s, 1),
                "data_wait_share": round(wait / step_s, 4),
                "step_s": round(step_s / a.steps, 4),
                "tokens_per_step": tokens / a.steps,
                "model": a.model,
                "device": dev,
                "precision": a.precision,
                "groups": a.groups,
                "group_size": a.group_size,
                "micro_batch_tokens": a.micro_batch_tokens,
                "produce_groups_per_s": a.produce_groups_per_s,
            }
        )
    )


if __name__ == "__main__":
    main()
