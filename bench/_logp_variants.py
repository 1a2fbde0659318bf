"""Scorers for bench/logp_precision.py that need the trainer's packed path or an SGLang server.

- `TrainerScorer`: the megatron policy exactly as the trainer builds and runs it (trainer.precision
  bf16, layer_spec / attention "auto", output_hidden + lm_head.head_logprobs with fp32 logits, sequences
  packed by stages/trainer/packing.pack: on CUDA one packed row per micro-batch through FlashAttention's
  varlen kernel, on CPU block-mask rows through SDPA).
- `SGLangScorer`: one SGLang server through the repo's wrapper (stages/rollout/sglang_engine.py, bf16,
  `--enable-fp32-lm-head`, as the GPU configs run it), started in a thread so the caller can work
  meanwhile. `sample` generates responses (the engine's own sampling-time logprobs, as the pipeline
  records them); `teacher_forced` scores given response tokens with one prefill each (/generate with
  input_ids = prompt + response, return_logprob, logprob_start_len = prompt_len - 1, max_new_tokens 1;
  SGLang then returns, for every input position from logprob_start_len on, log p(token | tokens before)
  of the raw distribution (temperature 1), the first entry without a value).

Imports of torch, megatron and SGLang happen inside the functions (the module imports anywhere).
"""

from __future__ import annotations

import asyncio
import threading
import time

TRAINER_MICRO_BATCH_TOKENS = 4096  # trainer.micro_batch_tokens default (the GPU configs keep it)


class TrainerScorer:
    """The megatron policy built as the trainer builds it (trainer.precision bf16; fp32 with bf16=False, a
    check); calling it with sequences and prompt lengths returns the logprobs [T] (CPU fp32, the response
    tokens of every sequence in order) that the trainer computes as logp_old. `layout`: varlen / te /
    sdpa."""

    def __init__(self, path: str, bf16: bool = True):
        import torch

        from stages.trainer.model import build_policy

        self.bf16 = bf16
        self.policy = build_policy(
            path, bf16=bf16, layer_spec="auto", attention="auto", output_hidden=True, ddp=False
        )
        self.model = self.policy.model.eval()
        self.layout = self.policy.layout
        self.dev = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def __call__(self, seqs: list, plens: list[int]):
        import numpy as np
        import torch

        from buffer.record import Sample, samples_to_batch
        from stages.trainer.lm_head import head_logprobs
        from stages.trainer.model import causal_block_mask, head_weight, packed_row_params
        from stages.trainer.packing import pack, to_token_batch

        samples = []
        for i, (s, pl) in enumerate(zip(seqs, plens)):
            ids = [int(x) for x in s]
            n = len(ids) - pl
            samples.append(
                Sample.build(
                    uid=f"s{i}",
                    group_id=f"g{i}",
                    prompt_ids=ids[:pl],
                    response_ids=ids[pl:],
                    rollout_logprobs=np.zeros(n, np.float32),
                    versions=np.zeros(n, np.int32),
                )
            )
        tb = to_token_batch(samples_to_batch(samples))
        layout, dev, model = self.layout, self.dev, self.model
        mbs = pack(tb, list(range(tb.n)), TRAINER_MICRO_BATCH_TOKENS, packed_row=layout in ("varlen", "te"))
        out = torch.zeros(len(tb.rollout_logprobs), dtype=torch.float32)
        kw = {"fp32_output": False} if self.bf16 else {}  # as the trainer: bf16 hidden states stay bf16
        with torch.no_grad():
            for mb in mbs:
                tokens = mb.tokens.to(dev)
                pos = torch.arange(tokens.shape[1], device=dev)[None].expand_as(tokens)
                if layout in ("varlen", "te"):  # one packed row, sequence boundaries as cu_seqlens
                    params = packed_row_params(mb, layout, dev)
                    hidden = model(tokens, pos, None, packed_seq_params=params, **kw)
                else:  # block-diagonal causal mask
                    hidden = model(tokens, pos, causal_block_mask(mb.segments.to(dev)), **kw)
                pick = mb.resp_pos.to(dev)
                lp, _ = head_logprobs(
                    hidden.reshape(-1, hidden.shape[-1])[pick],
                    head_weight(model),
                    mb.targets.reshape(-1).to(dev)[pick],
                    temperature=1.0,
                    fp32_logits=True,  # model.fp32_lm_head: true in every config
                    vocab_size=self.policy.hf_config.vocab_size,
                )
                out[mb.tok_index] = lp.float().cpu()
        return out


class SGLangScorer:
    """One SGLang server (bf16, fp32 LM head, no CUDA graphs, no radix cache) on GPU 0, started in a
    background thread by the constructor; `wait()` blocks until it answers. Always `close()` it."""

    def __init__(self, path: str, mem_fraction: float = 0.3, log_dir: str = ""):
        from stages.rollout.config import SGLangConfig
        from stages.rollout.sglang_engine import SGLangEngine

        cfg = SGLangConfig(
            mem_fraction_static=mem_fraction,
            disable_cuda_graph=True,  # a faster start; the kernels (and their numbers) are the same
            keep_weights_copy=False,
            radix_cache=False,  # every request prefills all of its tokens
            startup_timeout_s=300.0,
            log_dir=log_dir,
        )
        self.engine = SGLangEngine(
            path, cfg, dtype="bfloat16", gpu_id=0, name="logp-sglang", fp32_lm_head=True, start=False
        )
        self.start_s: float | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="sglang-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.start()
            self.start_s = time.perf_counter() - t0
        except BaseException as e:  # re-raised in the caller's thread by wait()
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._thread.join()  # a start under way finishes (or fails) first, so no server outlives this
        self.engine.close()

    @property
    def log_path(self) -> str:
        return str(self.engine.log_path)

    def sample(self, prompts: list[list[int]], max_new_tokens: int, stop_ids) -> tuple[list, list]:
        """Responses at temperature 1 (top_p 1), all requests at once as the generators send them; returns
        (responses, logprobs) per prompt: eos kept as the last token when it stopped, and SGLang's
        sampling-time log p of each token (the rollout_logprobs the pipeline records)."""
        from stages.rollout.engine import GenRequest, SamplingParams

        params = SamplingParams(
            temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(sorted(stop_ids))
        )
        reqs = [GenRequest(prompt_ids=list(p), params=params, rid=str(i)) for i, p in enumerate(prompts)]
        res = asyncio.run(self.engine.generate(reqs))
        for r in res:
            if r.finish_reason == "abort" or not r.response_ids or len(r.logprobs) != len(r.response_ids):
                raise RuntimeError(
                    f"SGLang request {r.rid}: finish {r.finish_reason}, {len(r.response_ids)} tokens, "
                    f"{len(r.logprobs)} logprobs; server log: {self.log_path}"
                )
        return [list(r.response_ids) for r in res], [list(r.logprobs) for r in res]

    def teacher_forced(self, seq: list[int], plen: int) -> list[float]:
        """log p of seq[plen:] given everything before it, from one SGLang prefill of the whole sequence."""
        body = {
            "input_ids": list(seq),
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0},
            "return_logprob": True,
            "logprob_start_len": plen - 1,  # the first position whose logits predict a response token
        }
        out = self.engine._post("/generate", body)
        if isinstance(out, list):
            out = out[0]
        rows = (out.get("meta_info") or {}).get("input_token_logprobs")
        resp = list(seq[plen:])
        if not rows or len(rows) < len(resp):
            raise RuntimeError(
                f"SGLang /generate returned {len(rows or [])} input_token_logprobs for {len(resp)} response "
                f"tokens (logprob_start_len {plen - 1}, {len(seq)} input ids); meta_info keys: "
                f"{sorted((out.get('meta_info') or {}).keys())}"
            )
        # one row per input position from logprob_start_len on: [logprob, token id, text]; the first has
        # no logprob (its logits were not computed), the last len(resp) are the response tokens
        rows = rows[len(rows) - len(resp) :]
        ids = [int(r[1]) for r in rows]
        if ids != resp or any(r[0] is None for r in rows):
            raise RuntimeError(
                f"SGLang input_token_logprobs do not line up with the response: ids {ids[:8]}... vs "
                f"{resp[:8]}..., values {[r[0] for r in rows[:4]]}..."
            )
        return [float(r[0]) for r in rows]
