"""The SGLang server arguments `rollout.sglang.extra_args` may pass on, checked when the config loads: a
misspelt flag is named there, with its near matches, instead of failing the server's start minutes later
(or, for a flag that slipstream itself sets, silently replacing slipstream's value).

Where the list comes from: SGLang 0.5.17's `python/sglang/srt/server_args.py` (the version pyproject.toml
pins for `.[gpu]`), read by `flags_of_server_args` below: every `ServerArgs` field annotated
`A[T, "help"]` / `A[T, Arg(...)]` as SGLang's `add_cli_args_from_dataclass` registers it (`--field-name`,
or `cli_name`, plus `aliases`; `no_cli` fields skipped), and every `parser.add_argument("--...")` of
`ServerArgs.add_cli_args`. To refresh it for another SGLang version (no GPU or SGLang import needed):

    pip download sglang==<version> --no-deps -d /tmp/sgl && cd /tmp/sgl && unzip -o sglang-*.whl \
        sglang/srt/server_args.py
    python -m stages.rollout.sglang_args /tmp/sgl/sglang/srt/server_args.py   # prints the new block

and paste what it prints over `_LISTED` (and bump the version in `SGLANG_VERSION`). SGLang's argparse
also takes unambiguous abbreviations of a flag; slipstream wants the full name.
"""

from __future__ import annotations

import ast
import difflib
import sys
import textwrap

SGLANG_VERSION = "0.5.17"

_LISTED = """
    --abort-on-priority-when-disabled --admin-api-key --allow-auto-truncate --api-key --asr-max-buffer-seconds
    --asr-max-concurrent-sessions --attention-backend --attention-context-parallel-size --attn-cp-size
    --base-gpu-id --batch-notify-size --bf16-gemm-backend --bucket-e2e-request-latency
    --bucket-inter-token-latency --bucket-time-to-first-token --chat-template
    --checkpoint-engine-wait-weights-before-ready --chunked-prefill-size --collect-tokens-histogram
    --completion-template --config --constrained-json-disable-any-whitespace
    --constrained-json-whitespace-pattern --context-length --cp-strategy --cpu-offload-gb --crash-dump-folder
    --cuda-graph-backend-decode --cuda-graph-backend-prefill --cuda-graph-bs --cuda-graph-bs-decode
    --cuda-graph-bs-prefill --cuda-graph-config --cuda-graph-max-bs --cuda-graph-max-bs-decode
    --cuda-graph-max-bs-prefill --cuda-graph-tc-compiler --custom-weight-loader --data-parallel-size
    --dcp-comm-backend --dcp-replicate-q-proj --dcp-size --debug-cuda-graph --debug-tensor-dump-input-file
    --debug-tensor-dump-layers --debug-tensor-dump-output-folder --decode-attention-backend
    --decode-context-parallel-size --decode-log-interval --decoupled-spec-bind-endpoint
    --decoupled-spec-connect-endpoints --decoupled-spec-rank --decoupled-spec-role --decrypted-config-file
    --decrypted-draft-config-file --deepep-config --deepep-dispatcher-output-dtype --deepep-mode
    --default-chat-template-kwargs --default-priority-value --delete-ckpt-after-loading
    --detokenizer-worker-num --device --disable-attn-tp-gather --disable-chunked-prefix-cache
    --disable-cuda-graph --disable-cuda-graph-padding --disable-custom-all-reduce --disable-decode-cuda-graph
    --disable-fast-image-processor --disable-flashinfer-autotune
    --disable-flashinfer-cutlass-moe-fp4-allgather --disable-hybrid-swa-memory --disable-outlines-disk-cache
    --disable-overlap-schedule --disable-piecewise-cuda-graph --disable-prefill-cuda-graph
    --disable-priority-preemption --disable-radix-cache --disable-shared-experts-fusion
    --disable-tokenizer-batch-decode --disaggregation-bootstrap-port
    --disaggregation-decode-enable-offload-kvcache --disaggregation-decode-enable-radix-cache
    --disaggregation-decode-extra-slots --disaggregation-decode-polling-interval --disaggregation-ib-device
    --disaggregation-mode --disaggregation-transfer-backend --dist-init-addr --dist-timeout --dllm-algorithm
    --dllm-algorithm-config --dllm-fdfo --download-dir --dp-size --dsa-decode-backend
    --dsa-paged-mqa-logits-backend --dsa-prefill-backend --dsa-prefill-cp-mode --dsa-topk-backend --dtype
    --dwdp-size --dynamic-batch-tokenizer-batch-size --dynamic-batch-tokenizer-batch-timeout
    --elastic-ep-backend --elastic-ep-initial-size --elastic-ep-join-mode --elastic-ep-join-rank-offset
    --elastic-ep-rejoin --elastic-ep-scale-timeout --enable-adaptive-dispatch-to-encoder
    --enable-aiter-allreduce-fusion --enable-attn-tp-input-scattered --enable-breakable-cuda-graph
    --enable-broadcast-mm-inputs-process --enable-cache-report --enable-cp-decode-attn-tp
    --enable-cudagraph-gc --enable-custom-logit-processor --enable-deepseek-v4-fp4-indexer
    --enable-deterministic-inference --enable-dp-attention --enable-dp-attention-local-control-broadcast
    --enable-dp-lm-head --enable-draft-weights-cpu-backup --enable-dsa-cache-layer-split
    --enable-dsa-prefill-context-parallel --enable-dynamic-batch-tokenizer --enable-dynamic-chunking
    --enable-elastic-expert-backup --enable-eplb --enable-expert-distribution-metrics
    --enable-flashinfer-allreduce-fusion --enable-flexkv --enable-forward-pass-metrics --enable-fp32-lm-head
    --enable-fused-moe-sum-all-reduce --enable-fused-qk-norm-rope --enable-gdn-replayssm-spec
    --enable-hierarchical-cache --enable-hisparse --enable-http2 --enable-int8-mamba-checkpoint
    --enable-layerwise-nvtx-marker --enable-linear-replayssm --enable-linear-replayssm-spec --enable-lmcache
    --enable-lora --enable-lora-overlap-loading --enable-mamba-cache-stochastic-rounding --enable-memory-saver
    --enable-metrics --enable-metrics-for-all-schedulers --enable-mfu-metrics --enable-mis
    --enable-mixed-chunk --enable-mm-global-cache --enable-mscclpp --enable-multi-layer-eagle
    --enable-multimodal --enable-nccl-nvls --enable-nsa-prefill-context-parallel --enable-p2p-check
    --enable-page-major-kv-layout --enable-pdmux --enable-precise-embedding-interpolation
    --enable-prefill-context-parallel --enable-prefill-cp --enable-prefill-delayer --enable-prefix-mm-cache
    --enable-priority-scheduling --enable-profile-cuda-graph --enable-quant-communications
    --enable-request-time-stats-logging --enable-return-hidden-states --enable-return-indexer-topk
    --enable-return-routed-experts --enable-scattered-sconv --enable-session-radix-cache
    --enable-single-batch-overlap --enable-ssl-refresh --enable-streaming-session --enable-strict-thinking
    --enable-symm-mem --enable-tf32-matmul --enable-tokenizer-batch-encode --enable-torch-compile
    --enable-torch-compile-debug-mode --enable-torch-symm-mem --enable-trace --enable-two-batch-overlap
    --enable-unified-memory --enable-waterfill --enable-weights-cpu-backup --encoder-bootstrap-port
    --encoder-only --encoder-register-urls --encoder-transfer-backend --encoder-urls
    --enforce-disable-flashinfer-allreduce-fusion --enforce-piecewise-cuda-graph
    --enforce-shared-experts-fusion --engine-info-bootstrap-port --ep --ep-dispatch-algorithm
    --ep-num-redundant-experts --ep-size --eplb-algorithm --eplb-min-rebalancing-utilization-threshold
    --eplb-rebalance-layers-per-chunk --eplb-rebalance-num-iterations
    --expert-distribution-recorder-buffer-size --expert-distribution-recorder-mode --expert-parallel-size
    --experts-shared-outer-loras --export-metrics-to-file --export-metrics-to-file-dir --extra-metric-labels
    --fastapi-root-path --file-storage-path --flashinfer-allreduce-fusion-backend
    --flashinfer-autotune-skip-ops --flashinfer-mla-disable-ragged --flashinfer-mxfp4-moe-precision
    --flexkv-config-file --forward-hooks --forward-pass-metrics-ipc-name --forward-pass-metrics-worker-id
    --fp4-gemm-backend --fp8-gemm-backend --fuseep-mode --gc-threshold --gc-warning-threshold-secs
    --generation-tokens-buckets --gpu-id-step --grammar-backend --grpc-http-sidecar-port --grpc-mode
    --grpc-port --hf-chat-template-name --hicache-io-backend --hicache-mem-layout --hicache-ratio
    --hicache-size --hicache-storage-backend --hicache-storage-backend-extra-config
    --hicache-storage-prefetch-policy --hicache-write-policy --hierarchical-sparse-attention-extra-config
    --hisparse-config --host --incremental-streaming-output --init-expert-location --int8-mamba-ckpt-size
    --is-embedding --json-model-override-args --keep-mm-feature-on-device --kt-cpuinfer
    --kt-max-deferred-experts-per-token --kt-method --kt-num-gpu-experts --kt-threadpool-count
    --kt-weight-path --kv-cache-dtype --kv-canary --kv-canary-real-data --kv-canary-sweep-interval
    --kv-events-config --language-only --limit-mm-data-per-request --linear-attn-backend
    --linear-attn-decode-backend --linear-attn-prefill-backend --linear-attn-verify-backend
    --linear-replayssm-cache-len --lmcache-config-file --load-balance-method --load-format
    --load-snapshot-publish-interval --log-level --log-level-http --log-requests --log-requests-format
    --log-requests-level --log-requests-target --lora-backend --lora-drain-wait-threshold
    --lora-eviction-policy --lora-paths --lora-strict-loading --lora-target-modules --lora-use-virtual-experts
    --mamba-backend --mamba-cache-philox-rounds --mamba-full-memory-ratio --mamba-max-states-per-path
    --mamba-radix-cache-strategy --mamba-scheduler-strategy --mamba-ssm-dtype --mamba-track-interval
    --max-ep-size --max-loaded-loras --max-lora-chunk-size --max-lora-rank --max-loras-per-batch
    --max-mamba-cache-size --max-prefill-tokens --max-queued-requests --max-running-requests
    --max-total-tokens --mem-fraction-static --min-free-slots-delay --mm-attention-backend
    --mm-enable-dp-encoder --mm-feature-transport --mm-io-worker-num --mm-process-config
    --mm-processor-worker-num --model --model-checksum --model-config-parser --model-impl
    --model-loader-extra-config --model-path --modelexpress-config --modelopt-checkpoint-restore-path
    --modelopt-checkpoint-save-path --modelopt-export-path --modelopt-quant --moe-a2a-backend
    --moe-data-parallel-size --moe-dense-tp-size --moe-dp-size --moe-runner-backend --mooncake-ib-device
    --msprobe-dump-config --nccl-init-addr --nccl-port --nnodes --node-rank --nsa-decode-backend
    --nsa-prefill-backend --nsa-prefill-cp-mode --num-continuous-decode-steps --num-reserved-decode-tokens
    --numa-node --offload-group-size --offload-mode --offload-num-in-group --offload-prefetch-step
    --optimistic-prefill-attempts --otlp-traces-endpoint --page-size --pdmux-config-path
    --piecewise-cuda-graph-compiler --piecewise-cuda-graph-max-tokens --piecewise-cuda-graph-tokens
    --pipeline-parallel-size --port --pp-async-batch-depth --pp-max-micro-batch-size --pp-size --pre-warm-nccl
    --preferred-sampling-params --prefill-attention-backend --prefill-cp-mode
    --prefill-delayer-forward-passes-buckets --prefill-delayer-max-delay-ms --prefill-delayer-max-delay-passes
    --prefill-delayer-queue-min-ratio --prefill-delayer-token-usage-low-watermark
    --prefill-delayer-wait-seconds-buckets --prefill-max-requests --prefill-only-disable-kv-cache
    --prefill-round-robin-balance --priority-scheduling-preemption-threshold --prompt-tokens-buckets
    --quantization --quantization-param-path --quantize-and-serve --radix-cache-backend
    --radix-eviction-policy --random-seed --reasoning-parser --remote-instance-weight-loader-backend
    --remote-instance-weight-loader-seed-instance-ip
    --remote-instance-weight-loader-seed-instance-service-port
    --remote-instance-weight-loader-send-weights-group-ports
    --remote-instance-weight-loader-start-seed-via-transfer-engine --retraction-policy
    --return-hidden-states-mode --revision --rl-on-policy-target --rl-quant-profile --sampling-backend
    --sampling-defaults --schedule-conservativeness --schedule-low-priority-values-first --schedule-policy
    --scheduler-recv-interval --served-model-name --show-time-cost --sidecar --sidecar-args
    --skip-server-warmup --skip-tokenizer-init --sleep-on-idle --sm-group-num --smg-grpc-mode
    --smg-http-sidecar-port --soft-watchdog-timeout --spec-trace-dir --speculative-accept-threshold-acc
    --speculative-accept-threshold-single --speculative-adaptive --speculative-adaptive-config
    --speculative-algorithm --speculative-attention-mode --speculative-dflash-block-size
    --speculative-dflash-draft-window-size --speculative-draft-attention-backend
    --speculative-draft-load-format --speculative-draft-model --speculative-draft-model-path
    --speculative-draft-model-quantization --speculative-draft-model-revision --speculative-draft-window-size
    --speculative-dspark-align-verify-tokens-to-graph-tier --speculative-dspark-block-size
    --speculative-dspark-confidence-sts-path --speculative-dspark-sps-table-path --speculative-eagle-topk
    --speculative-moe-a2a-backend --speculative-moe-runner-backend --speculative-ngram-capacity
    --speculative-ngram-external-corpus-max-tokens --speculative-ngram-external-corpus-path
    --speculative-ngram-external-sam-budget --speculative-ngram-match-type --speculative-ngram-max-bfs-breadth
    --speculative-ngram-max-trie-depth --speculative-ngram-min-bfs-breadth --speculative-num-draft-tokens
    --speculative-num-steps --speculative-skip-dp-mlp-sync --speculative-token-map
    --speculative-use-rejection-sampling --ssl-ca-certs --ssl-certfile --ssl-keyfile --ssl-keyfile-password
    --stream-interval --stream-output --stream-response-default-include-usage --strip-thinking-cache
    --swa-full-tokens-ratio --tbo-token-distribution-threshold --tensor-parallel-size --tokenizer-backend
    --tokenizer-metrics-allowed-custom-labels --tokenizer-metrics-custom-labels-header --tokenizer-mode
    --tokenizer-path --tokenizer-worker-num --tool-call-parser --tool-server --torch-compile-max-bs
    --torchao-config --tp-size --trace-modules --triton-attention-num-kv-splits
    --triton-attention-reduce-in-fp32 --triton-attention-split-tile-size --trust-remote-code --use-ray
    --uvicorn-access-log-exclude-prefixes --warmups --watchdog-timeout --weight-cache-mode
    --weight-cache-socket --weight-cache-timeout --weight-loader-disable-mmap
    --weight-loader-drop-cache-after-load --weight-loader-prefetch-checkpoints
    --weight-loader-prefetch-num-threads --weight-version
"""
SERVER_ARGS: frozenset[str] = frozenset(_LISTED.split())

# flags SGLangEngine._command sets itself from slipstream's keys: given again in extra_args, argparse
# would keep the later one and the engine would run against a server it did not configure (another
# port, another GPU count); each names the key that sets it
OWNED: dict[str, str] = {
    "--model-path": "model.name",
    "--model": "model.name",
    "--host": "rollout.sglang.host",
    "--port": "rollout.sglang.port",
    "--tp-size": "rollout.sglang.tp_size",
    "--tensor-parallel-size": "rollout.sglang.tp_size",
    "--mem-fraction-static": "rollout.sglang.mem_fraction_static",
    "--base-gpu-id": "rollout.sglang.base_gpu_id (Ray's GPUs in a pipeline run)",
    "--dtype": "model.dtype",
    "--skip-tokenizer-init": "nothing: always on (token ids in and out)",
    "--weight-version": "nothing: the engine stamps the policy version itself",
    "--incremental-streaming-output": "nothing: always on",
    "--stream-interval": "rollout.sglang.stream_interval",
    "--disable-cuda-graph": "rollout.sglang.disable_cuda_graph",
    "--disable-radix-cache": "rollout.sglang.radix_cache",
    "--enable-fp32-lm-head": "model.fp32_lm_head",
    "--enable-return-routed-experts": "trainer.routing_replay",
    # LoRA serving: set from trainer.lora when its pushes are adapters (stages/rollout/sglang_lora.py)
    "--enable-lora": "trainer.lora.push=adapter",
    "--max-lora-rank": "trainer.lora.rank (with trainer.lora.push=adapter)",
    "--lora-target-modules": "trainer.lora.target_modules (with trainer.lora.push=adapter)",
    "--max-loras-per-batch": "nothing: run.max_staleness + 2 (with trainer.lora.push=adapter)",
}


def check_extra_args(extra_args: list) -> None:
    """Raise ValueError naming each flag of `extra_args` that SGLang does not take (with its near
    matches) or that slipstream sets itself (with the key to use). Values are passed as they are; a
    `--flag=value` item is checked by its flag."""
    problems: list[str] = []
    unknown = False
    for i, item in enumerate(extra_args):
        if not isinstance(item, str) or not item.startswith("-") or _is_number(item):
            if i == 0:
                problems.append(f"{item!r} comes before any flag (start with the --flag it is the value of)")
            continue
        flag = item.split("=", 1)[0]
        if flag in OWNED:
            problems.append(f"{flag} is set by slipstream: use {OWNED[flag]}")
        elif flag not in SERVER_ARGS:
            near = difflib.get_close_matches(flag, SERVER_ARGS, n=3, cutoff=0.75)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            problems.append(f"{flag} is not an SGLang {SGLANG_VERSION} server argument{hint}")
            unknown = True
    if problems:
        newer = (
            "; if this is an argument of a newer SGLang, add it to stages/rollout/sglang_args.py (its "
            "docstring says how to refresh the list)"
            if unknown
            else ""
        )
        raise ValueError("rollout.sglang.extra_args: " + "; ".join(problems) + newer)


def flag_value(extra_args: list, flag: str) -> str | None:
    """The value `extra_args` gives `flag` (`--flag value` or `--flag=value`; "" for a bare flag), or
    None when it does not name it."""
    items = [str(a) for a in extra_args]
    for i, item in enumerate(items):
        name, eq, value = item.partition("=")
        if name != flag:
            continue
        if eq:
            return value
        following = items[i + 1] if i + 1 < len(items) else "--"
        return "" if following.startswith("--") else following
    return None


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def flags_of_server_args(source: str) -> set[str]:
    """The command-line flags SGLang's `ServerArgs` registers, read from server_args.py's source."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    flags: set[str] = set()
    for node in cls.body:  # the fields add_cli_args_from_dataclass turns into flags
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        ann = node.annotation
        if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "A"):
            continue
        parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        meta = next((p for p in parts[1:] if _is_help(p) or _is_arg_call(p)), None)
        if meta is None:  # no Arg and no help: registered by hand, or not on the command line
            continue
        name = "--" + node.target.id.replace("_", "-")
        if _is_arg_call(meta):
            kw = {k.arg: k.value for k in meta.keywords}
            if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                continue
            name = ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else name
            flags.update(ast.literal_eval(kw["aliases"]) if "aliases" in kw else ())
        flags.add(name)
    for fn in cls.body:  # the flags add_cli_args registers by hand (dynamic choices, deprecated ones)
        if isinstance(fn, ast.FunctionDef) and fn.name == "add_cli_args":
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
                    flags.update(
                        a.value
                        for a in call.args
                        if isinstance(a, ast.Constant)
                        and isinstance(a.value, str)
                        and a.value.startswith("-")
                    )
    return flags


def _is_help(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(
        node, ast.JoinedStr | ast.BinOp
    )


def _is_arg_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Arg"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m stages.rollout.sglang_args path/to/sglang/srt/server_args.py")
    with open(argv[0]) as f:
        flags = flags_of_server_args(f.read())
    lines = textwrap.wrap(" ".join(sorted(flags)), width=106, break_on_hyphens=False, break_long_words=False)
    print("\n".join("    " + line for line in lines))


if __name__ == "__main__":
    main(sys.argv[1:])
