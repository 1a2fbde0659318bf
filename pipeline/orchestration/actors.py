"""The Ray actors that host each stage: buffer, generators (and held-out evaluation), trainer.

Each actor is a thin shell around a stage object that also runs alone (BufferServer, Generator,
Trainer), so what runs under Ray is the same code the standalone entry points and tests run. Heavy
imports happen inside the actors, never in the driver.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from buffer.config import BufferConfig
    from buffer.curve import CurveKeys
    from pipeline.config import RunConfig
    from pipeline.orchestration.turns import Turn


def _quiet() -> None:
    """Megatron warns on import that optional fused kernels (Apex, Transformer Engine) are missing; on
    a CPU run that is expected and says nothing the user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling back).*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")


def _threads(n: int) -> None:
    """Pin torch's intra-op threads to the CPUs this actor was given (oversubscription on a small
    machine costs more than it gains: two stages each spinning 2 threads on 2 cores halves both)."""
    import torch

    torch.set_num_threads(max(1, n))


def _on_this_node(address: str) -> str:
    """A loopback bind moved to this node's IP: on a cluster of several nodes every stage must be
    reachable from the others."""
    from buffer.net import on_host

    return on_host(address, ray.util.get_node_ip_address())


def _reachable(cfg: RunConfig) -> RunConfig:
    """cfg with this node's IP in place of the loopback binds (buffer, CPU weight transport, SGLang
    servers)."""
    import msgspec

    rep = msgspec.structs.replace
    return rep(
        cfg,
        buffer=rep(cfg.buffer, bind=_on_this_node(cfg.buffer.bind)),
        weights=rep(cfg.weights, bind=_on_this_node(cfg.weights.bind)),
        rollout=rep(cfg.rollout, sglang=rep(cfg.rollout.sglang, host=_on_this_node(cfg.rollout.sglang.host))),
    )


def _advertised(address: str) -> str:
    """A server bound to every interface (0.0.0.0) is reached at this node's IP."""
    return address.replace("://0.0.0.0:", f"://{ray.util.get_node_ip_address()}:")


class _Located:
    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        """The node and GPUs Ray put this actor on (the driver orders trainer ranks by it, and records
        it in <run dir>/placement.json)."""
        from pipeline.orchestration.placement import local_gpus

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "gpus": local_gpus()}


@ray.remote(num_cpus=0, concurrency_groups={"watch": 1})
class BufferActor(_Located):
    """Hosts the ZeroMQ buffer server in a thread; its data lives in the run directory."""

    def __init__(
        self, bc: BufferConfig, directory: str, reachable: bool = False, curve: CurveKeys | None = None
    ):
        import threading

        import msgspec

        from buffer.memory import reserve
        from buffer.server import BufferServer

        bc = msgspec.structs.replace(bc, bind=_on_this_node(bc.bind)) if reachable else bc
        self.memory = reserve(bc.reserve_mb)  # before the server's socket exists
        self.server = BufferServer(bc, directory if bc.durable else None, curve=curve).start()
        self.stopped = threading.Event()

    @ray.method(concurrency_group="watch")
    def watch(self) -> str:
        """Returns when the buffer is stopped; fails at once if its process dies, which is how the
        driver notices a dead buffer while the trainer waits for a batch from it."""
        self.stopped.wait()
        return "stopped"

    def address(self) -> str:
        return _advertised(self.server.address)

    def stats(self) -> dict:
        from buffer.memory import MARKER

        # reserved_mb: heap faulted in at start; malloc_settings: 1 if the process started with them
        return {
            **self.server.stats(),
            "reserved_mb": self.memory.get("reserved_mb", 0),
            "malloc_settings": int(bool(os.environ.get(MARKER))),
        }

    def drop_fetches(self, consumer: str) -> None:
        self.server.drop_fetches(consumer)

    def stop(self) -> None:
        self.server.stop()
        self.stopped.set()


@ray.remote
class GeneratorActor(_Located):
    """An engine, the receiving end of the weight transport, and the generator loop (asyncio)."""

    def __init__(
        self,
        cfg: RunConfig,
        index: int,
        buffer_address: str,
        weights_address: str | None,
        batch_groups: int,
        cpus: int = 1,
        state_path: str = "",
        reachable: bool = False,
        curve: CurveKeys | None = None,
        joining: bool = False,
        ports: list[int] | None = None,
    ):
        """`joining`: added to a run already going (elastic rollout): its admission counts from the
        trainer's version (ElasticGenerator.join) when its run() begins. `ports`: its SGLang servers'
        (a healed generator's take its predecessor's, at the URLs the trainer's sender pushes to)."""
        _threads(cpus)
        from buffer.client import BufferClient
        from pipeline.config import rollout_run
        from pipeline.orchestration.elastic_generator import ElasticGenerator
        from pipeline.orchestration.placement import local_gpus, rollout_on_gpus
        from pipeline.orchestration.turns import rollout_cfg
        from stages.rollout.build import build_engine

        # Sample uids are "<generator id>-<group>-<i>"; the random part keeps them unique when a run
        # directory (and so its buffer, which drops known uids as duplicates) is used a second time.
        generator_id = f"gen-{index}.{uuid.uuid4().hex[:6]}"
        self.id = generator_id
        cfg = rollout_on_gpus(cfg, local_gpus(), f"generator gen-{index}")  # the engines on Ray's GPUs
        cfg = _reachable(cfg) if reachable else cfg  # SGLang servers the trainer can reach
        cfg = rollout_cfg(cfg)  # cluster.offload.rollout: SGLang servers that can release their memory
        # SGLang logs as <log_dir>/sglang-gen<index>-<engine>.log: one directory for every generator
        run = rollout_run(cfg)  # the run-wide values the stage takes (sync mode's staleness bound among them)
        self.engine = build_engine(
            cfg.rollout,
            cfg.model,
            run,
            seed=cfg.run.seed * 1000 + index,
            name=f"sglang-gen{index}",
            ports=ports,
        )
        # weights.transport cpu pushes through this receiver; with nccl / cuda_ipc the trainer updates the
        # SGLang servers directly, and there is no receiver here. SGLang generators start before the
        # trainer, so theirs comes later (connect_weights)
        self.curve = curve
        self.receiver = None
        if weights_address:
            self.connect_weights(weights_address)
        self.sink = BufferClient(
            buffer_address, producer=generator_id, timeout_s=cfg.run.timeout_s, curve=curve
        )
        self.joining = joining
        self.gen = ElasticGenerator(
            cfg.rollout,
            cfg.model,
            run,
            self.sink,
            self.engine,
            generator_id,
            batch_groups,
            state_path=state_path,
        )  # state_path: the data position is written at each settled (acked) group, not only here
        self.cfg, self.evaluator = cfg, None  # the evaluator is made at the first evaluate()
        # the data position (epoch, index in the epoch's order) continues across incarnations and re-runs
        # in the same directory: a healed generator or a resumed run does not start the prompts over
        self.state_path, self._saved_at = state_path, 0.0
        if state_path and os.path.exists(state_path):
            with open(state_path) as f:
                self.gen.load_state_dict(json.load(f))

    def _save_state(self, every_s: float = 5.0) -> None:
        if not self.state_path or time.monotonic() - self._saved_at < every_s:
            return
        tmp = f"{self.state_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.gen.state_dict(), f)
        os.replace(tmp, self.state_path)  # atomic: a kill leaves the old state or the new one
        self._saved_at = time.monotonic()

    def connect_weights(self, address: str) -> None:
        """Take weight pushes from the trainer's sender at `address` (weights.transport cpu)."""
        from stages.weights.zmq_transport import WeightReceiver

        if self.receiver is None:
            self.receiver = WeightReceiver(address, self.engine, name=self.id, curve=self.curve)

    def ident(self) -> str:
        """This incarnation's generator id (the weight receiver's engine name, the uid prefix)."""
        return self.id

    def engine_pids(self) -> list[int]:
        """Process ids of this generator's SGLang servers (empty for the torch engine): what
        bench/fault_run.py kills as the `server` stage."""
        engines = getattr(self.engine, "engines", [self.engine])
        return [pid for e in engines if (pid := getattr(e, "pid", None)) is not None]

    def engine_urls(self) -> list[str]:
        """HTTP addresses of this generator's SGLang servers (empty for the torch engine)."""
        return list(getattr(self.engine, "urls", []))

    async def run(self) -> dict:
        if self.joining:
            await self.gen.join()
        await self._first_weights()
        return await self.gen.run()

    async def _first_weights(self) -> None:
        """When version 0 is not the model folder's weights (weights_start_elsewhere), generate nothing
        before the trainer's first push is applied: samples of the folder's weights would be labelled v0.
        With cluster.offload the hand-over gives the engines their first weights before they generate;
        without a receiver (SGLang pushed by the trainer directly) there is nothing to wait on."""
        from pipeline.config import weights_start_elsewhere

        if self.receiver is None or self.cfg.cluster.offload.on or not weights_start_elsewhere(self.cfg):
            return
        limit = self.cfg.run.timeout_s
        if not await asyncio.to_thread(self.receiver.wait_applied, limit):
            raise TimeoutError(
                f"{self.id}: the trainer's first weight push did not arrive within run.timeout_s={limit:.0f}s; "
                "its weights (trainer.lora.init_from, or trainer.load with finetune) are not the model folder's "
                "the engines start from, so nothing is generated before it: is the trainer running, and did "
                "its first push fail (the trainer's log)?"
            )

    async def set_share(self, batch_groups: int) -> None:
        """The run's generator count changed: this generator's share of a trainer batch (docs/elastic.md)."""
        await self.gen.set_share(batch_groups)

    async def evaluate(self, step: int) -> dict:
        """The held-out sets of cfg.eval on this generator's engine, beside its generation (the same
        engine the run trains with, SGLang included; no extra process or CPU bundle)."""
        if self.evaluator is None:
            from pipeline.orchestration.evaluation import Evaluator

            self.evaluator = Evaluator(self.cfg, self.engine, self.gen.tok)
        out = await self.evaluator.evaluate()
        out["eval/step"] = step
        return out

    async def stats(self) -> dict:
        out = dict(self.gen.stats())
        out["engine_version"] = self.engine.version
        self._save_state()
        if self.receiver is not None and self.receiver.error:
            raise RuntimeError(f"{self.id}: weight receiver failed: {self.receiver.error}")
        return out

    # the hand-over's calls (handover.py): in a worker thread, since a release waits for requests that
    # this actor's own event loop is still answering
    async def release_memory(self, tags: list[str]) -> Turn:
        """Release `tags` of the engines (none: only their bytes, for the metrics)."""
        from pipeline.orchestration.turns import engine_turn

        return await engine_turn(self.engine, True, tags, self.cfg.cluster.offload.timeout_s)

    async def resume_memory(self, tags: list[str]) -> Turn:
        from pipeline.orchestration.turns import engine_turn

        return await engine_turn(self.engine, False, tags, self.cfg.cluster.offload.timeout_s)

    async def stop(self) -> None:
        self.gen.stop()
        self._save_state(every_s=0.0)

    async def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.engine.close()
        self.sink.close()


# "control" calls run on their own thread, beside a step in progress: a step can be waiting for a
# weight push to a generator that died, and only forgetting that engine lets it finish
@ray.remote(concurrency_groups={"control": 1})
class TrainerActor(_Located):
    """One rank of the megatron trainer. The ranks of a run form one torch.distributed world (gloo on
    CPU, NCCL on GPUs) whose address rank 0 hands out; rank 0 alone fetches from the buffer (and
    broadcasts each batch), holds the weight sender and answers the driver. All ranks step together."""

    def __init__(self, world: int, cpus: int = 1):
        self.rank, self.world, self.cpus = -1, world, cpus  # the rank is given in setup()
        self.trainer = self.sender = self.source = None
        self._batch = None  # the hand-over's fetched batch, until its train_turn

    def master_address(self, loopback: bool) -> str:
        """host:port for the process group, from rank 0's node (loopback on a one-node cluster)."""
        from buffer.net import free_port

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def setup(
        self,
        rank: int,
        cfg: RunConfig,
        master: str,
        buffer_address: str,
        model_path: str,
        run_dir: str,
        num_engines: int,
        engine_urls: list[str] | None = None,
        reachable: bool = False,
        curve: CurveKeys | None = None,
        push_now: bool = False,
    ) -> None:
        """`push_now`: send this trainer's weights to the engines at once even at version 0 (a trainer
        restarted after a crash: the engines run newer weights than it has)."""
        from pipeline.orchestration.placement import local_gpus

        self.rank = rank
        cfg = _reachable(cfg) if reachable else cfg
        _threads(cfg.trainer.threads or self.cpus)
        _quiet()
        host, port = master.rsplit(":", 1)
        gpus = local_gpus() if cfg.trainer.device == "cuda" else []
        if cfg.trainer.device == "cuda" and len(gpus) != 1:
            raise RuntimeError(f"trainer rank {rank}: Ray gave it GPUs {gpus}, expected exactly one")
        # torch.distributed's env:// rendezvous; LOCAL_RANK is the GPU Ray picked (see placement.py)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK=str(gpus[0] if gpus else 0),
            MASTER_ADDR=host,
            MASTER_PORT=port,
        )
        from buffer.client import BufferClient
        from pipeline.config import sync_mode, trainer_run
        from stages.trainer.cuda_memory import choose_allocator
        from stages.trainer.trainer import Trainer
        from stages.weights import make_sender

        choose_allocator(cfg.trainer, cfg.weights)  # before anything allocates CUDA memory in this process
        if gpus:  # before the sender: an NCCL sender forms its group on the current device
            import torch

            torch.cuda.set_device(gpus[0])

        if self.rank == 0:
            self.source = BufferClient(
                buffer_address, producer="trainer", timeout_s=cfg.run.timeout_s, curve=curve
            )
            sg = cfg.rollout.sglang
            self.sender = make_sender(
                cfg.weights,
                engine_urls=engine_urls,
                min_engines=num_engines,
                engine_tp_sizes=[sg.tp_size] * len(engine_urls or []),
                pause_mode=sg.pause_mode,
                # the engines' NCCL ranks rendezvous at rank 0's node
                master_address=ray.util.get_node_ip_address() if reachable else "127.0.0.1",
                curve=curve,
                # an engine watch relaunches a dead server within about this long (0: no watch)
                restart_grace_s=sg.startup_timeout_s + 2 * sg.health_check_s if sg.health_check_s else 0.0,
            )
        # its own section and the run-wide values it takes (sync mode's staleness bound among them)
        self.trainer = Trainer(
            cfg.trainer,
            trainer_run(cfg, run_dir),
            self.source,
            model_path,
            weights=cfg.weights,
            sender=self.sender,
        )
        self.offload = cfg.cluster.offload
        if (self.trainer.engines_start_behind or push_now) and not self.offload.on:
            # resumed or loaded from a checkpoint, or adapters from a PEFT folder: the engines start from
            # the base model at version 0, and their groups would be too stale (or, at version 0, made by
            # other weights than the version says); send them the trainer's weights first (in the background:
            # the sender waits for the engines to connect, and they are started after the trainer).
            # Collective: every rank takes part in gathering the weights. With cluster.offload the
            # hand-over pushes instead, into engines that have woken their weights for it (handover.py).
            self.trainer.push_weights()
        self.sync = sync_mode(cfg)
        self._idle_s = 0.0
        self._t0 = time.perf_counter()

    def weights_address(self) -> str | None:
        """Where torch engines connect for weights (None: the sender pushes to SGLang servers itself)."""
        address = getattr(self.sender, "address", None)
        return _advertised(address) if address else None

    @ray.method(concurrency_group="control")
    def forget_engine(self, name: str) -> None:
        """A generator died: pushes stop waiting for its engine (rank 0 holds the sender)."""
        if self.sender is not None:
            self.sender.forget(name)

    @ray.method(concurrency_group="control")
    def expect_engines(self, count: int) -> None:
        """The run now has `count` generators (elastic rollout): a push waits for that many engines
        (fewer after a removal, or every push would wait for an engine that left until its timeout)."""
        if self.sender is not None:
            self.sender.expect_engines(count)

    def version(self) -> int:
        return self.trainer.version

    def step(self) -> dict:
        m = self.trainer.step()
        if self.sync:
            # sync mode: the next batch is generated only with the weights this step produced
            t0 = time.perf_counter()
            res = self.trainer.wait_push() or {}
            m["push/wait_s"] = time.perf_counter() - t0
            m["push/seconds"] = res.get("seconds", 0.0)
        self._idle_s += m.get("time/data_wait_s", 0.0)
        m["version"] = self.trainer.version
        m["trainer/idle_share"] = self._idle_s / max(time.perf_counter() - self._t0, 1e-9)
        m["trainer/ranks"] = self.world
        return m

    # -- the hand-over's turns (cluster.offload, run.mode=sync; handover.py orders them) -------------
    def fetch(self) -> float:
        """The next batch, held for train_turn; the seconds waited (the engines generated meanwhile)."""
        self._batch, wait = self.trainer.fetch()
        self._idle_s += wait
        return wait

    def train_turn(self) -> dict:
        """State back, one step on the fetched batch, gradients and optimizer state out (offload.train)."""
        batch, self._batch = self._batch, None
        return self.trainer.train_turn(batch, offload=self.offload.train)

    def push_turn(self) -> dict:
        """The push into the woken engines, waited for; then the weights out (offload.train)."""
        m = self.trainer.push_turn(offload=self.offload.train)
        m["version"] = self.trainer.version
        m["trainer/idle_share"] = self._idle_s / max(time.perf_counter() - self._t0, 1e-9)
        m["trainer/ranks"] = self.world
        return m

    def finish(self, export_hf: bool = True) -> dict:
        """Wait for the last push, save the final checkpoint and an HF export of the policy (every
        rank: both are collective; rank 0 writes the HF folder)."""
        self.trainer.close(save=True)
        out = {"version": self.trainer.version}
        if export_hf and self.trainer.tc.save_at_end:
            out["hf_export"] = self.trainer.save_hf()
        if self.sender is not None:
            self.sender.close()
        if self.source is not None:
            self.source.close()
        return out


def actor_env() -> dict:
    """runtime_env for the actors: the repo on sys.path (for runs without `pip install -e`)."""
    from pipeline.config import REPO_ROOT

    path = os.environ.get("PYTHONPATH", "")
    return {
        "env_vars": {
            "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error",  # no per-process "Loading weights" progress bars
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            # Ray picks each actor's GPUs (placement.py), but every actor keeps seeing all GPUs of its
            # node: NCCL and CUDA IPC between trainer and SGLang servers need the peer's GPU visible
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        }
    }
