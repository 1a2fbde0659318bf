"""Weight-push time into live SGLang servers against the raw transfer of the same bytes, in one run.

Two GPUs. GPU 0 holds the "trainer" (the model's weights as bf16 CUDA tensors, pushed as the trainer
pushes them) and a colocated SGLang server (CUDA IPC pushes); GPU 1 holds a second SGLang server (NCCL
pushes from GPU 0). For each transport: `--pushes` pushes with the server idle, then as many while it
generates (64 requests of up to 128 tokens at a time, as in the GPU configs), each push's phases
(pause, load, of which transfer, continue) from the sender itself, and the server's own time inside
the load (SGLang's `weight_load_duration_seconds` metric, `--enable-metrics`). The raw baselines of
`bench/nccl_broadcast.py` (per-tensor and flat broadcast GPU 0 -> GPU 1, device copy on GPU 0) run in
the same invocation, before the servers start. Prints one JSON line last.

    PYTHONPATH=. python bench/gpu_push.py [--model smollm2-135m|DIR] [--pushes 10] [--cuda-graph]
                                          [--bucket-mb 512 1024 4096] [--nccl-only] [--profile DIR]

Each transport is measured at every `--bucket-mb` (a bucket costs an HTTP round trip into the server on
top of its bytes; `by_bucket_mb`), the NCCL one with each `--nccl-receive` (weights.nccl_receive: the
bucket as one flat broadcast, or one broadcast per tensor), and `push_vs_raw` is judged at the NCCL
transport's default size and receive (`push_vs_raw_<receive>` for each one measured).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from _results import record  # bench/ is on sys.path when a bench runs
from sglang_profile import profiled

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_dir(name: str) -> str:
    from pipeline.config import ModelConfig
    from stages.models import resolve_model

    if Path(name).is_dir():
        return name
    return str(resolve_model(ModelConfig(name=name, cache_dir="/tmp/models-gpu-push")))


def raw_baselines(path: str) -> dict:
    """bench/nccl_broadcast.py's JSON, or {"error": ...}: a baseline that fails does not cost the push
    measurement (its progress and errors go to this process's stderr, i.e. the bench's log)."""
    cmd = [sys.executable, str(REPO / "bench" / "nccl_broadcast.py"), path, "--gpus", "0,1", "--runs", "10"]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "nccl_broadcast.py gave no result in 600 s"}
    if p.returncode != 0 or not p.stdout.strip():
        return {"error": f"nccl_broadcast.py exited with {p.returncode} (its stderr is in this log)"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def nccl_key(receive: str) -> str:
    """The NCCL transport's entry in a bucket size's row for a receive: "nccl" for flat, as before the
    per-tensor one existed (earlier JSON lines), "nccl_per_tensor" for that."""
    return "nccl" if receive == "flat" else f"nccl_{receive}"


def server_load_s(url: str) -> float:
    """The server's own time for its last weight load (SGLang's `weight_load_duration_seconds` gauge)."""
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    m = re.findall(
        r'^sglang:weight_load_duration_seconds\{[^}]*source="(?:tensor|distributed)"[^}]*\} ([0-9.e+-]+)',
        text,
        re.M,
    )
    return max((float(x) for x in m), default=float("nan"))


def _timed_out(signum, frame):
    raise TimeoutError("SIGTERM (the phase's time limit): measuring stopped here")


def warm_up(url: str, n: int = 64) -> None:
    """Short generations, one alone and then `n` in one batch (the load's size), waited for: the first
    of each batch size compiles kernels (an MoE's Triton kernels take minutes)."""
    import requests

    one = {"input_ids": list(range(100, 148)), "sampling_params": {"max_new_tokens": 16}}
    requests.post(url + "/generate", json=one, timeout=900).raise_for_status()
    batch = [list(range(100 + i, 148 + i)) for i in range(n)]
    body = {"input_ids": batch, "sampling_params": {"max_new_tokens": 16}}
    requests.post(url + "/generate", json=body, timeout=900).raise_for_status()


def _load_child(url: str, n: int, max_new: int) -> None:
    """Child process: keep `n` generate requests in flight on `url` until stdin closes."""
    import random

    import requests

    stop = threading.Event()
    done, failed = [0], [0]

    def worker(i: int) -> None:
        rng, s = random.Random(i), requests.Session()
        while not stop.is_set():
            body = {
                "input_ids": [rng.randrange(100, 40000) for _ in range(48)],
                "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0},
                "return_logprob": True,
            }
            try:
                ok = s.post(url + "/generate", json=body, timeout=600).status_code == 200
            except requests.RequestException:
                ok = False
            done[0] += ok
            failed[0] += not ok

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    print("generating", flush=True)
    sys.stdin.read()
    stop.set()
    print(f"{done[0]} {failed[0]}", flush=True)  # requests completed / failed while it ran


class Load:
    """Keeps a server generating (`n` requests in flight, up to `max_new` tokens each) until stopped,
    from a process of its own (in this one, its Python would compete with the push thread)."""

    def __init__(self, url: str, n: int = 64, max_new: int = 128):
        self.cmd = [sys.executable, __file__, "--_load", url, "--_n", str(n), "--_max-new", str(max_new)]

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdout.readline()
        time.sleep(3)  # requests running
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        line = self.proc.stdout.readline().split()  # after the running requests ended
        self.done, self.failed = (int(line[0]), int(line[1])) if len(line) == 2 else (0, -1)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(sender, engine, named, pushes: int, version0: int) -> dict:
    out = {}
    for label, busy in (("idle", False), ("generating", True)):
        rows = []
        ctx = Load(engine.url) if busy else None
        if ctx:
            ctx.__enter__()
        try:
            for i in range(pushes + 2):
                r = sender.push(version0 + i, named).result()
                r["server_load_s"] = server_load_s(engine.url)
                if i >= 2:  # two warm-ups
                    rows.append(r)
                time.sleep(0.3)
        finally:
            if ctx:
                ctx.__exit__()
        if ctx:  # the load really ran: requests completed during the pushes, none failed
            out_load = {"requests_done": ctx.done}
            if ctx.failed or not ctx.done:  # recorded, not fatal: what else was measured still counts
                out_load["load_error"] = (
                    f"the generating load did not run cleanly: {ctx.done} done, {ctx.failed} failed"
                )
        out[label] = {
            k[:-2] + "_ms": round(statistics.median(r[k] for r in rows) * 1e3, 2)
            for k in rows[0]
            if k.endswith("_s")
        }
        if ctx:
            out[label].update(out_load)
        out[label]["seconds_ms_p90"] = round(
            sorted(r["seconds"] for r in rows)[math.ceil(0.9 * len(rows)) - 1] * 1e3, 2
        )
        out[label]["seconds_ms"] = round(statistics.median(r["seconds"] for r in rows) * 1e3, 2)
        for k in ("pause_s", "load_s", "seconds"):
            out[label][f"{k.removesuffix('_s')}_ms_max"] = round(max(r[k] for r in rows) * 1e3, 2)
        version0 += pushes + 2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--cuda-graph", action="store_true", help="as the GPU configs run (slower start)")
    ap.add_argument(
        "--bucket-mb", type=int, nargs="+", default=[512, 1024, 4096], help="bucket sizes to push in (MB)"
    )
    ap.add_argument(
        "--nccl-receive",
        nargs="+",
        default=["flat", "per_tensor"],
        choices=["flat", "per_tensor"],
        help="how the NCCL server receives (weights.nccl_receive): each one measured",
    )
    ap.add_argument(
        "--profile",
        default="",
        help="also profile one idle NCCL push per bucket size and receive on the server (SGLang's torch "
        "profiler, traces into this folder): where its load spends the time (bench/sglang_profile.py)",
    )
    ap.add_argument("--nccl-only", action="store_true", help="leave out the CUDA IPC server and its pushes")
    ap.add_argument("--shape", default="", help="name of the model's shape in the JSON (e.g. 7b)")
    ap.add_argument("--results", default="", help="append the JSON (with device and date) to this .jsonl")
    ap.add_argument("--_load", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_n", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--_max-new", type=int, default=128, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._load:
        return _load_child(a._load, a._n, a._max_new)

    import torch
    from safetensors.torch import load_file

    from stages.rollout.config import SGLangConfig
    from stages.rollout.sglang_engine import SGLangEngine
    from stages.weights.config import BUCKET_MB, WeightsConfig
    from stages.weights.cuda_ipc_sender import CudaIpcSGLangSender
    from stages.weights.nccl_sender import NcclSGLangSender, per_tensor_for
    from stages.weights.sglang_protocol import align_nccl_env

    align_nccl_env()
    path = model_dir(a.model)
    import sglang

    result = {"bench": "gpu_push", "model": a.model, "shape": a.shape or a.model}
    result["device"] = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    result["versions"] = {"torch": torch.__version__, "sglang": sglang.__version__}
    result["raw"] = raw_baselines(path)
    print("raw:", result["raw"], flush=True)

    torch.cuda.set_device(0)
    named = []
    for f in sorted(Path(path).glob("*.safetensors")):
        named += [(n, t.to("cuda:0", torch.bfloat16)) for n, t in load_file(str(f)).items()]
    result["tensors"], result["bytes"] = len(named), sum(t.numel() * t.element_size() for _, t in named)

    cfg = dict(disable_cuda_graph=not a.cuda_graph, keep_weights_copy=False, extra_args=["--enable-metrics"])
    engines: dict[int, SGLangEngine] = {}
    t0 = time.perf_counter()

    def start(gpu: int) -> None:
        engines[gpu] = SGLangEngine(
            path,
            SGLangConfig(mem_fraction_static=0.5, **cfg),
            gpu_id=gpu,
            name=f"push-{gpu}",
            fp32_lm_head=True,
        )

    gpus = (1,) if a.nccl_only else (0, 1)
    threads = [threading.Thread(target=start, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(engines) != len(gpus):
        raise SystemExit("an SGLang server did not start (see the errors above)")
    result["server_start_s"] = round(time.perf_counter() - t0, 1)
    result["by_bucket_mb"] = {}
    # a phase's time limit (SIGTERM) ends the measuring, not the record of what was measured
    signal.signal(signal.SIGTERM, _timed_out)
    try:
        for e in engines.values():  # first kernels compiled (an MoE's Triton kernels take minutes)
            warm_up(e.url)
        for i, mb in enumerate(dict.fromkeys(a.bucket_mb)):  # a group name per sender: servers keep theirs
            row = result["by_bucket_mb"][str(mb)] = {}  # filled as it goes: a failure keeps what came before
            for j, receive in enumerate(a.nccl_receive):  # weights.nccl_receive
                nccl = NcclSGLangSender(
                    [engines[1].url],
                    timeout_s=120,
                    bucket_mb=mb,
                    group_name=f"bench-{mb}-{receive}",
                    receive=receive,
                )
                version0 = 1 + 100 * i + 50 * j
                key = nccl_key(receive)
                row[key] = {}
                if a.profile:  # before the timed pushes, after one that sets up the NCCL group
                    nccl.push(version0, named).result()
                    try:
                        row[key]["profile"] = profiled(
                            engines[1].url,
                            lambda s=nccl, v=version0 + 1: s.push(v, named).result(),
                            f"{a.profile}/{mb}-{receive}",
                        )
                    except Exception as e:  # noqa: BLE001 - the timing below still counts
                        row[key]["profile"] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"profile {mb} {receive}:", json.dumps(row[key]["profile"]), flush=True)
                row[key].update(measure(nccl, engines[1], named, a.pushes, version0 + 2))
                nccl.close()
            if not a.nccl_only:
                ipc = CudaIpcSGLangSender([engines[0].url], timeout_s=120, bucket_mb=mb)
                row["cuda_ipc"] = measure(ipc, engines[0], named, a.pushes, 1 + 100 * i)
                ipc.close()
            row["buckets"] = math.ceil(result["bytes"] / (mb << 20))
            print(f"bucket_mb {mb}:", row, flush=True)
    except Exception as e:  # noqa: BLE001 - record what was measured before it (minutes of GPU time)
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        for e in engines.values():
            e.close()
    raw = result["raw"]
    if "error" in raw or not result["by_bucket_mb"]:  # nothing to judge against, or nothing to judge
        result["push_vs_raw"] = None
    else:
        for row in result["by_bucket_mb"].values():
            for mode in ("idle", "generating"):
                for key in [nccl_key(r) for r in a.nccl_receive if nccl_key(r) in row]:
                    got = row[key].get(mode)
                    # cut off, or pushes made without the load they are judged under
                    if not got or "load_error" in got:
                        continue
                    total = got["seconds_ms"] / 1e3
                    row[f"{key}_{mode}_vs_raw_flat"] = round(total / raw["raw_broadcast_flat_s"], 2)
                    row[f"{key}_{mode}_vs_raw_per_tensor"] = round(total / raw["raw_broadcast_s"], 2)
                if mode in row.get("cuda_ipc", {}):
                    row[f"ipc_{mode}_vs_d2d"] = round(
                        row["cuda_ipc"][mode]["seconds_ms"] / 1e3 / raw["d2d_copy_s"], 2
                    )
        # issue #17's judgement: the whole push (pause to continue) into a live server over NCCL against
        # a flat NCCL broadcast of the same bytes; goal <= 1.5 at 7B. Judged at the bucket size the
        # pipeline's NCCL transport uses (weights.bucket_mb 0 = BUCKET_MB["nccl"]) when it was measured
        judged = (
            str(BUCKET_MB["nccl"])
            if str(BUCKET_MB["nccl"]) in result["by_bucket_mb"]
            else str(a.bucket_mb[0])
        )
        result["judged_bucket_mb"] = int(judged)
        # at the pipeline's receive (weights.nccl_receive's default; auto: what it picks for this model's
        # tensors), and each receive measured
        receive = WeightsConfig().nccl_receive
        if receive == "auto":
            receive = "per_tensor" if per_tensor_for("auto", named) else "flat"
        result["judged_receive"] = receive
        judged_row = result["by_bucket_mb"].get(judged, {})
        result["push_vs_raw"] = judged_row.get(f"{nccl_key(receive)}_generating_vs_raw_flat")
        for r in a.nccl_receive:
            result[f"push_vs_raw_{r}"] = judged_row.get(f"{nccl_key(r)}_generating_vs_raw_flat")
    result["goal"] = 1.5
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    record(result, a.results)  # result["device"] is set above


if __name__ == "__main__":
    main()
