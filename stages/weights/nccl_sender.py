"""NCCL weight transport into SGLang servers (disaggregated: trainer and engines on different GPUs), the
push sequence of sglang_transport.py with a bucket delivered by NCCL broadcast.

The trainer rank 0 is rank
0 of a dedicated NCCL group; server i joins with rank_offset = 1 + (sum of earlier servers' TP sizes)
via POST /init_weights_update_group, while the trainer joins with SGLang's own
`init_custom_process_group` (the two must rendezvous at the same time, hence the threads). Each bucket
is POST /update_weights_from_distributed {names, dtypes, shapes} while rank 0 broadcasts each tensor of
the bucket in that order (weights.nccl_receive=per_tensor: the server receives each into a tensor of its
own and loads them), or with load_format: flattened_bucket while rank 0 broadcasts the bucket as one
flat byte tensor (flat: one NCCL call per bucket, which SGLang 0.5.17 copies once more). auto (the
default) takes per_tensor for buckets of large tensors (a 7B model's: 1.2x faster than flat) and flat
for small ones (a 135M model's, where the NCCL calls cost more than the copies). The group spans
exactly the servers a push reaches: when one is left out (restarting) or comes back, the sender forms a
new group (a new name) with the servers of this push before it loads anything (see `_regroup`); the old
group is dropped, not destroyed.
NCCL's broadcast to a server that died waits for it until the watchdog ends the process (the default
TORCH_NCCL_ASYNC_ERROR_HANDLING), so the group is made with the watchdog only reporting, and rank 0
watches its broadcast beside the servers' load calls: when one finds its server gone (or fails, or
weights.timeout_s passes) the group is aborted and the push ends as above: without the dead server, or
failing (`_broadcast`). The broadcast call runs on a thread of its own, since NCCL's first collective
on a new group sets up the communicator and blocks until every rank does.
NCCL cannot put two ranks on one GPU: this needs the engines on other GPUs (see notes/sglang-on-gpu.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import secrets
import threading
import time

import torch

import stages.weights.sglang_protocol as proto
from buffer.net import free_port
from stages.weights.base import WeightPushError
from stages.weights.buckets import check_flat_layout, pack_into
from stages.weights.config import PER_TENSOR_MIN_MEAN_MB
from stages.weights.sglang_transport import _SGLangSender, answer_within, lost_servers, unreachable

log = logging.getLogger(__name__)


def _in_thread(fn, *args) -> cf.Future:
    """fn(*args) on a daemon thread of its own, as a future: a call that may never return is waited for
    with a timeout, and left behind if it must be (a pool's worker would be lost with it)."""
    fut: cf.Future = cf.Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name="weights-broadcast", daemon=True).start()
    return fut


def await_broadcast(started: cf.Future, calls: dict[str, cf.Future], deadline: float) -> list[str]:
    """Wait for a broadcast (`started`: the future of its call, whose result is its work) while the
    servers' `calls` run beside it: [] once it completed, the servers found gone as soon as one call
    finds its server so (their receive will never finish), a call's own error (or the broadcast
    call's) as soon as one fails otherwise, and WeightPushError at `deadline` (monotonic) naming the
    servers still receiving."""
    t0 = time.monotonic()
    while not (started.done() and started.result().is_completed()):
        dead = unreachable(calls)
        if dead:
            return dead
        failed = [c.exception() for c in calls.values() if c.done() and c.exception() is not None]
        if failed:  # a server that answered an error is out of its receive: the broadcast cannot finish
            raise failed[0]
        if time.monotonic() > deadline:
            waiting = [url for url, c in calls.items() if not c.done()]
            raise WeightPushError(
                f"weights: the broadcast of a bucket did not finish within weights.timeout_s "
                f"({deadline - t0:.0f}s); servers still receiving: {waiting}"
            )
        # a bucket takes milliseconds to a tenth of a second: poll finely at first
        time.sleep(0.0005 if time.monotonic() - t0 < 1.0 else 0.01)
    return []


@contextlib.contextmanager
def _env(**values: str):
    """These environment variables set for the block, then as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flat_bucket(group, device) -> torch.Tensor:
    """The bucket as one uint8 tensor on `device` in SGLang's flattened_bucket layout (each tensor's
    bytes back to back, in order): a packed bucket's own (buckets_marking_last), else filled tensor by
    tensor: one buffer of the bucket's size, where building it from per-tensor device copies would
    take two (host snapshots at 7B)."""
    packed = getattr(group, "flat", None)
    if packed is not None and packed.device == torch.device(device):
        return packed
    flat = torch.empty(sum(x.numel() * x.element_size() for _, x in group), dtype=torch.uint8, device=device)
    offset = 0
    for name, x in group:
        pack_into(flat, offset, name, x)
        offset += x.numel() * x.element_size()
    return flat


def per_tensor_for(receive: str, group) -> bool:
    """Whether a bucket goes out one broadcast per tensor (weights.nccl_receive): auto says so where its
    tensors average PER_TENSOR_MIN_MEAN_MB or more, where one more NCCL call costs less than the flat
    receive's copies of the same bytes."""
    if receive != "auto":
        return receive == "per_tensor"
    total = sum(x.numel() * x.element_size() for _, x in group)
    return total >= len(group) * (PER_TENSOR_MIN_MEAN_MB << 20)


def tensors_on(group, device) -> list[torch.Tensor]:
    """The bucket's tensors, in order, each contiguous on `device`: what the per-tensor receive
    broadcasts one by one. Nothing is copied that is there already: a packed bucket's views of its flat
    buffer (weights.snapshot=direct), a GPU snapshot's tensors; a host snapshot's come over one by one."""
    device = torch.device(device)
    # non_blocking: a host snapshot is pinned; the broadcast waits for this stream first (_broadcast)
    return [
        x if x.device == device and x.is_contiguous() else x.to(device, non_blocking=True).contiguous()
        for _, x in group
    ]


class _AllWork:
    """Several async collectives' works as one: completed when every one is (gloo may run them on
    threads of its own, so the last one's completion says nothing of the others)."""

    def __init__(self, works: list):
        self.works = works
        self._done = 0  # works[:_done] are known complete: a poll does not ask them again

    def is_completed(self) -> bool:
        while self._done < len(self.works) and self.works[self._done].is_completed():
            self._done += 1
        return self._done == len(self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class NcclSGLangSender(_SGLangSender):
    def __init__(
        self,
        urls,
        *,
        master_address: str = "127.0.0.1",
        group_name: str = "slipstream-weights",
        receive: str = "auto",
        **kw,
    ):
        super().__init__(urls, **kw)
        # weights.nccl_receive. per_tensor: each tensor of a bucket is its own broadcast, which the
        # server receives straight into a tensor of that shape and loads (SGLang's receive without
        # load_format); flat: one broadcast of the whole bucket, which SGLang 0.5.17 copies once more;
        # auto: by the bucket's mean tensor size (per_tensor_for)
        if receive not in ("auto", "flat", "per_tensor"):
            raise ValueError(f"weights.nccl_receive={receive!r}: choose one of auto, flat, per_tensor")
        self.receive = receive
        self.master_address = master_address
        self.group_name = group_name
        # every group this sender tries gets a new name: a server keeps each name it joined (a failed
        # attempt's too, and an earlier trainer's, whose sender started from the same group_name)
        self._name_base = f"{group_name}-{secrets.token_hex(3)}"
        self.group_names: list[str] = []
        self._group = None
        self._members: list[str] = []  # the servers in self._group, in rank order
        self._version_at: dict[str, str] = {}  # the version the last push set on each server
        # long-lived threads for the per-server calls that run beside the broadcast: their keep-alive
        # sessions persist from push to push
        self._http = cf.ThreadPoolExecutor(len(self.urls), thread_name_prefix="weights-http")
        self._rank0 = cf.ThreadPoolExecutor(1, thread_name_prefix="weights-rendezvous")
        # no group yet: the first push forms it (_regroup), with the servers it reaches, while they
        # generate (a server paused for a push may not serve the join request)

    def _join(self, urls: list[str]) -> None:
        """Form a trainer<->engines NCCL group with `urls` (every one of them and rank 0 rendezvous
        together). Each group gets a new name: a server that was in an earlier one still holds it."""
        proto.align_nccl_env()  # no-op after init_distributed; a standalone sender needs it before its group
        name = f"{self._name_base}-{len(self.group_names)}"
        self.group_names.append(name)
        port = free_port()
        sizes = [self.tp_of[u] for u in urls]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        joins = [
            self._http.submit(
                self._post,
                url,
                proto.JOIN_GROUP,
                proto.join_group_body(self.master_address, port, off, world, name, "nccl"),
                self.timeout_s,
            )
            for url, off in zip(urls, offsets)
        ]
        forming = self._rank0.submit(self._new_group, f"tcp://{self.master_address}:{port}", world, name)
        # a server that refuses to join would leave rank 0 waiting in the rendezvous: fail at its answer
        cf.wait([forming, *joins], timeout=self.timeout_s, return_when=cf.FIRST_EXCEPTION)
        for url, j in zip(urls, joins):
            if j.done() and j.exception() is not None:
                raise WeightPushError(f"weights: {url} did not join NCCL group {name}: {j.exception()}")
        if forming.done() and forming.exception() is not None:
            raise WeightPushError(f"weights: NCCL group {name} did not form: {forming.exception()}")
        if not all(f.done() for f in (forming, *joins)):
            raise WeightPushError(
                f"weights: NCCL group {name} with {urls} did not form within {self.timeout_s:.0f}s "
                f"(weights.timeout_s); is {self.master_address}:{port} reachable from the servers?"
            )
        self._group = forming.result()
        self._members, self._group_name = list(urls), name
        log.info("weights: NCCL group %s formed with %d engine ranks (%s)", name, world - 1, ", ".join(urls))

    def _new_group(self, init_method: str, world: int, name: str):
        """Rank 0 of a new group (SGLang's own helper, as the servers use); its rendezvous gives up
        after weights.timeout_s (SGLang's default is 30 minutes)."""
        from datetime import timedelta

        from sglang.srt.utils import init_custom_process_group

        # the watchdog of this group only reports: by default it ends the whole trainer process when a
        # collective times out, and a server killed mid-push makes one; the push aborts the group
        # itself instead (_broadcast). Read when the group is made, so set only around that
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
            return init_custom_process_group(
                backend="nccl",
                init_method=init_method,
                world_size=world,
                rank=0,
                group_name=name,
                # past the push's own deadline (weights.timeout_s), at which it aborts the group itself
                timeout=timedelta(seconds=2 * self.timeout_s),
            )

    def _catch_up_targets(self, behind: list[str]) -> list[str] | None:
        # every server: the group is re-formed once with all of them, not once for the server that
        # came back and again at the next regular push (the others get the version they hold)
        return None

    def _regroup(self, live: list[str]) -> None:
        """Make the group exactly `live`: the first push, a server was left out, one came back, or one
        was relaunched since the last push (it reports another weight version than that push set, the
        base model's: a new process holds none of our groups, and a load naming one would fail inside
        it). The servers are paused; a join is only asked of generating servers, so they go on
        generating while the new group forms and are paused again. That includes a server partly
        loaded when another died mid-push (`_left_out`), healed by this push: for the seconds of the
        join it generates from those weights, its tokens labeled with the older version it reports
        and carrying the logprobs of the weights it ran, which TIS weighs them by. The old group is
        dropped, not destroyed: destroying a communicator whose peer died can block, here and in the
        servers."""
        if not live:  # every server is down: no group holds, the one that comes back forms a new one
            self._group, self._members = None, []
            return
        if live == self._members and not self._relaunched(live):
            return
        for url in live:
            self._resume(url)
        log.warning("weights: the servers changed (%s -> %s): forming a new NCCL group", self._members, live)
        self._group, self._members = None, []  # a failed join leaves no group to broadcast to
        self._join(live)
        for url in live:
            self._pause(url)

    def _relaunched(self, urls: list[str]) -> list[str]:
        """The servers that report another weight version than the last push set on them."""
        known = [u for u in urls if u in self._version_at]
        answers = [self._http.submit(self._model_version, u, self.timeout_s) for u in known]
        return [
            u for u, a in zip(known, answers) if answer_within(a, self.timeout_s, u) != self._version_at[u]
        ]

    def _send_bucket(self, group, version: int | None, urls: list[str]) -> float:
        if urls != self._members:  # _regroup made them equal; anything else would hang the broadcast
            raise WeightPushError(f"weights: NCCL group {self._members} is not this push's servers {urls}")
        per_tensor = per_tensor_for(self.receive, group)
        if not per_tensor:  # only a flat bucket lays tensors of several dtypes back to back
            check_flat_layout(group)
        body = proto.distributed_body(
            *proto.describe(group),
            self._group_name,
            flat=not per_tensor,
            flush_cache=self.flush_cache,
            version=version,
        )
        # built before any server is asked to receive: a failure here leaves them paused, not waiting
        # in a receive that never comes
        device = self._bucket_device()
        parts = tensors_on(group, device) if per_tensor else [flat_bucket(group, device)]
        calls = {
            url: self._http.submit(self._post, url, proto.LOAD_DISTRIBUTED, body, self.timeout_s)
            for url in urls
        }
        moved = self._broadcast(parts, calls)  # the servers wait in their receive meanwhile
        for url, c in calls.items():
            answer_within(c, self.timeout_s, url)  # one that received, then died in its load: _gone
        if version is not None:
            self._version_at.update({url: str(version) for url in urls})
        return moved

    def _broadcast(self, parts: list[torch.Tensor], calls: dict[str, cf.Future]) -> float:
        """Rank 0's broadcast of one bucket (`parts`: the flat bucket, or each of its tensors in order)
        while the servers' load `calls` run; returns its seconds (the floor of any push). A server that
        dies meanwhile would leave NCCL waiting for it until its watchdog ends the trainer's process (a
        2-GPU kill test did): the broadcast is watched beside the calls, and the group aborted when one
        of them finds its server gone, or at weights.timeout_s."""
        # this stream only (the push thread's): the bucket is written; NCCL's stream waits on it, and
        # after the call this stream waits on NCCL's. (A CPU group in the tests has no stream.)
        on_gpu = parts[0].is_cuda
        sync = torch.cuda.current_stream().synchronize if on_gpu else (lambda: None)
        sync()
        t0 = time.monotonic()
        try:
            # NCCL sets up a new group's communicator in its first collective, blocking until every rank
            # does: a server that died after joining would hold this thread there for good. Started on
            # a thread of its own, the call is waited for like the broadcast, and left behind if it must
            stream = torch.cuda.current_stream() if on_gpu else None
            started = _in_thread(self._start_broadcast, parts, stream)
            dead = await_broadcast(started, calls, t0 + self.timeout_s)
            if not dead:
                started.result().wait()  # raises what the backend saw (gloo: a peer that closed its socket)
        except Exception as e:
            # the calls say whether a server died (gloo fails the broadcast itself when one does)
            cf.wait(list(calls.values()), timeout=5.0)
            dead = unreachable(calls)
            if not dead:
                self._abort_group()
                if isinstance(e, WeightPushError):
                    raise
                raise WeightPushError(f"weights: the broadcast to {list(calls)} failed: {e}") from e
        if dead:
            self._abort_group()
            raise lost_servers(dead, calls[dead[0]].exception())
        sync()
        return time.monotonic() - t0

    def _start_broadcast(self, parts: list[torch.Tensor], stream) -> _AllWork:
        """Rank 0's broadcast calls, one per part in order (async: their works are returned), on the
        push's stream and device."""

        # the group as the push saw it: an abort (or a regroup) may set self._group while this thread
        # still issues calls, which must then stop, not go to no group (the trainer's default group) or
        # to the next push's
        group = self._group

        def start():
            works = []
            for x in parts:
                if self._group is not group:
                    raise WeightPushError("weights: the weight group was given up during its broadcast")
                works.append(torch.distributed.broadcast(x, src=0, group=group, async_op=True))
            return _AllWork(works)

        if stream is None:
            return start()
        torch.cuda.set_device(parts[0].device)
        with torch.cuda.stream(stream):
            return start()

    def _abort_group(self) -> None:
        """End the group's communicator, so that a broadcast no server will finish returns, and never use
        the group again (the next push forms a new one)."""
        group, name = self._group, getattr(self, "_group_name", None)
        self._group, self._members = None, []
        if group is None:
            return
        try:  # the group's own abort: ncclCommAbort, which does not wait for the dead peer
            group.abort()
        except Exception as e:  # noqa: BLE001 - a group that cannot abort is left to its own timeout
            log.warning("weights: could not abort the weight group %s: %s", name, e)

    def close(self) -> None:
        super().close()
        self._http.shutdown(wait=True)
        self._rank0.shutdown(wait=False)  # a rendezvous that failed ends at its own timeout
