"""Ranks 1..N-1 of a tensor-parallel replica: child processes that run their shard of
every step in lockstep with rank 0.

Rank 0 is the replica's own process: it schedules, prepares each step's inputs, sends
them to every worker over the worker's socket (`TPWorkers.start_step`), runs its own shard
and samples. Workers run only the model; the collectives inside it (one all-reduce per
attention and per MLP, the embedding's all-reduce, the logits' all-gather) keep the ranks
in step, each under `COLLECTIVE_TIMEOUT_S`.

A worker's life:

    spawned (`python -m engine.tp_worker FD`) ──init message──▶ joins the process group
      ──loads its shard, maps the KV cache──▶ "ready" ──steps──▶ exits on: a stop
      message, its socket closing (rank 0 exited or was killed), rank 0 no longer being
      its parent, or any error (then rank 0's next collective fails)

So no worker outlives its replica: `TPWorkers.shutdown` stops them (and kills a worker
that does not stop within `STOP_TIMEOUT_S`), and a killed rank 0 closes their sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.kernels.metadata import AttentionMetadata
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model import CausalLM
from engine.parallel import COLLECTIVE_TIMEOUT_S, Shard, TensorParallel, create_group, new_group
from engine.tp_kv import (
    BackingFile,
    allocate_shared,
    backing_file,
    is_ours,
    map_shared,
    rank_spec,
    rank_view,
    unlink_quietly,
)

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # a worker loads its shard and maps the cache within this
STOP_TIMEOUT_S = 10.0  # a stopped worker exits within this, or is killed
IDLE_POLL_S = 1.0  # an idle worker checks that rank 0 is still its parent this often


class RankEndpoints(Protocol):
    """Per-rank KV transfer endpoints (`kvtransfer.ranks.RankTransfer`; the engine names
    no transfer code): how rank 0 links to a worker's endpoint and how the worker opens it."""

    def link(self, rank: int, conn: Connection, exited: Callable[[], bool]) -> Any: ...

    def open_host(
        self,
        rank: int,
        size: int,
        conn: Connection,
        spec: KVCacheSpec,
        kv_cache: KVCache | None,
        device: torch.device,
    ) -> tuple[Any, KVCache, tuple[str, int] | None]: ...

    @property
    def lands_in_shared_memory(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RankSends:
    """A step's layer hook on a replica whose ranks each send their own KV shard: `own`
    (rank 0's hook) with the model layer, and in every worker its endpoint's
    `send_layers` for `sends` (request id, source block ids in the ticket's order)."""

    own: Callable[[int], None]
    sends: tuple[tuple[str, tuple[int, ...]], ...]

    def __call__(self, layer: int) -> None:
        self.own(layer)


class WorkersLostError(RuntimeError):
    """A tensor-parallel worker is gone or out of step; the replica cannot go on."""


@dataclass(frozen=True, slots=True)
class WorkerInit:
    """What rank `rank` needs to join the replica (sent once, pickled)."""

    rank: int
    size: int
    backend: str  # "gloo" | "nccl"
    store_port: int
    config: EngineConfig
    model_dir: str
    model_config: ModelConfig
    kv_spec: KVCacheSpec  # the replica-wide spec
    kv_backing: BackingFile | None  # CPU: the shared cache; None: each rank its own shard
    parent_pid: int
    # Per-rank KV transfer (`kvtransfer.ranks`): this rank's own endpoint, answering rank 0
    # on a control socket of its own; None: no endpoint here (rank 0's moves every rank's).
    transfer: RankEndpoints | None = None


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step's model inputs, as rank 0 prepared them (CPU tensors)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs]; empty: no logits this step
    # Per-rank KV transfer: after each layer, this rank sends its shard of these requests'
    # blocks (request id, source block ids in the ticket's order; `kvtransfer.ranks`).
    kv_sends: tuple[tuple[str, tuple[int, ...]], ...] = ()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPWorkers:
    """Rank 0's handle on the other ranks: starts them, feeds them steps, stops them."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        kv_backing: BackingFile | None,
        transfer: RankEndpoints | None = None,
    ) -> None:
        """Spawn ranks 1..N-1 and form the process group with them (blocks until every
        rank has joined, at most `COLLECTIVE_TIMEOUT_S`). Call `wait_ready` before the
        first step. With `transfer`, each worker opens its own KV transfer endpoint
        (`links`: rank 0's control sockets to them; `rank_endpoints`: their receivers)."""
        size = config.tensor_parallel_size
        device = torch.device(config.device)
        backend = backend_for(device)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        self.broken = False
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self.links: list[Any] = []  # kvtransfer.ranks.RankLink
        self.rank_endpoints: list[tuple[str, int]] = []  # receivers of ranks 1..N-1
        # Stops the workers if the engine is dropped or the interpreter exits first.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self.links)
        try:
            for rank in range(1, size):
                init = WorkerInit(
                    rank=rank,
                    size=size,
                    backend=backend,
                    store_port=store.port,
                    config=config,
                    model_dir=model_dir,
                    model_config=model_config,
                    kv_spec=kv_spec,
                    kv_backing=kv_backing,
                    parent_pid=os.getpid(),
                    transfer=transfer,
                )
                self._spawn(init)
            group = new_group(backend, store, 0, size, device)
        except BaseException:
            self.shutdown()
            raise
        self.tp = TensorParallel(Shard(model_config, 0, size), group)
        self._store = store  # workers' stores connect to it: keep it alive

    def _spawn(self, init: WorkerInit) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pairs = [(ours, theirs)]
        if init.transfer is not None:  # the control socket of the rank's KV endpoint
            pairs.append(socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
        fds = [their.fileno() for _, their in pairs]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.tp_worker", *map(str, fds)],
                pass_fds=fds,
                cwd=os.getcwd(),
            )
        finally:
            for _, their in pairs:
                their.close()
        self._procs.append(proc)
        conn = Connection(ours.detach())
        self._conns.append(conn)
        if init.transfer is not None:
            control = Connection(pairs[1][0].detach())
            # A rank whose link is lost may write until its process has exited.
            self.links.append(
                init.transfer.link(init.rank, control, lambda: proc.poll() is not None)
            )
        conn.send_bytes(pickle.dumps(init))

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every worker has loaded its shard; raise with a worker's error."""
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns, start=1):
            left = deadline - time.monotonic()
            if left <= 0 or not conn.poll(left):
                self.shutdown()
                raise WorkersLostError(f"tensor-parallel rank {rank} not ready in {timeout_s} s")
            try:
                status, detail = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                self.shutdown()
                raise WorkersLostError(f"tensor-parallel rank {rank} exited at start") from exc
            if status != "ready":
                self.shutdown()
                raise WorkersLostError(f"tensor-parallel rank {rank} failed to start: {detail}")
            if detail is not None:  # its KV receiver: (endpoint, epoch)
                self.rank_endpoints.append(detail)

    def start_step(self, step: StepInput) -> None:
        """Send one step's inputs to every worker (each then runs its shard)."""
        if self.broken:
            raise WorkersLostError("tensor-parallel workers are out of step")
        payload = pickle.dumps(step)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self.broken = True
            raise WorkersLostError("a tensor-parallel worker is gone") from exc

    def problem(self) -> str | None:
        """Why the workers cannot serve (one exited, or a step broke), or None."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited with {proc.returncode}"
        if self.broken:
            return "a step failed inside the model: the tensor-parallel ranks are out of step"
        return None

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()


def _stop(procs: list[subprocess.Popen[bytes]], conns: list[Connection], links: list[Any]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(None))
        conn.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    for link in links:  # after the processes: their transfers settle as they go
        link.close()


def start_workers(
    config: EngineConfig,
    model_dir: str,
    model_config: ModelConfig,
    kv_spec: KVCacheSpec,
    kv_cache: KVCache | None,
    transfer: RankEndpoints | None = None,
) -> tuple[TPWorkers, KVCache, KVCache]:
    """Spawn ranks 1..N-1 of a replica and wait until they hold their shards.

    Returns the workers, the KV cache the replica's transfer endpoint moves and rank 0's
    own view of it. On the CPU the ranks share the replica-wide cache in /dev/shm
    (`kv_cache`, when given, must live there: the shm receiver's segment), and one endpoint
    in rank 0 moves every rank's KV. With `transfer` (per-rank endpoints, and always on
    CUDA, where each rank keeps its shard on its own GPU) every rank holds its own shard:
    rank 0's is `kv_cache` (of `rank_spec`, its endpoint's) or allocated here, and each
    worker opens its own endpoint over its own (`kvtransfer.ranks`).
    """
    shard = Shard(model_config, 0, config.tensor_parallel_size)
    backing = None
    own: KVCache | None = None
    if transfer is not None or config.device.startswith("cuda"):
        own_spec = rank_spec(kv_spec, shard)
        if kv_cache is not None and kv_cache.spec != own_spec:
            raise ValueError(f"rank 0's KV cache {kv_cache.spec} != its shard's {own_spec}")
        own = kv_cache if kv_cache is not None else KVCache.allocate(own_spec, config.device)
    elif kv_cache is None:
        kv_cache, backing = allocate_shared(kv_spec)
    else:
        backing = backing_file(kv_cache)
        if backing is None:
            raise ValueError(
                "a CPU tensor-parallel replica's KV cache must live in /dev/shm "
                "(tp_kv.allocate_for_engine, or the shm receiver's)"
            )
    try:
        workers = TPWorkers(config, model_dir, model_config, kv_spec, backing, transfer)
        workers.wait_ready()
    finally:
        if backing is not None and is_ours(backing):  # every rank has mapped it (or failed)
            unlink_quietly(backing.path)
    if own is not None:
        return workers, own, own
    assert kv_cache is not None
    return workers, kv_cache, rank_view(kv_cache, shard)


# ---- the worker process ------------------------------------------------------------


def _serve(conn: Connection, init: WorkerInit, control: Connection | None) -> None:
    from engine.engine import load_model  # here: engine.engine imports this module

    config = init.config
    torch.set_num_threads(config.num_threads or 1)
    device = torch.device(config.device)
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        device = torch.device("cuda", init.rank)
        torch.cuda.set_device(device)
    group = create_group(init.backend, init.store_port, init.rank, init.size, device)
    shard = Shard(init.model_config, init.rank, init.size)
    tp = TensorParallel(shard, group)
    host: Any = None  # kvtransfer.ranks.RankHost
    try:
        model = load_model(init.model_config, init.model_dir, device, tp)
        ready = None
        kv_cache: KVCache | None
        if init.kv_backing is not None:
            kv_cache = rank_view(map_shared(init.kv_backing, init.kv_spec), shard)
        else:  # this rank's own shard (CUDA: on its own GPU)
            spec = rank_spec(init.kv_spec, shard)
            shm = init.transfer is not None and init.transfer.lands_in_shared_memory
            kv_cache = None if shm else KVCache.allocate(spec, device)  # shm: the receiver's
            if init.transfer is not None:
                assert control is not None
                host, kv_cache, ready = init.transfer.open_host(
                    init.rank, init.size, control, spec, kv_cache, device
                )
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send_bytes(pickle.dumps(("error", repr(exc))))
        if host is not None:
            host.close()
        raise
    conn.send_bytes(pickle.dumps(("ready", ready)))
    assert kv_cache is not None
    try:
        while True:
            if not conn.poll(IDLE_POLL_S):
                if os.getppid() != init.parent_pid:
                    return  # rank 0 is gone (we were re-parented)
                continue
            try:
                step: StepInput | None = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if step is None:
                return
            _run_step(model, kv_cache, step, device, host)
    finally:
        if host is not None:
            host.close()


def _run_step(
    model: CausalLM,
    kv_cache: KVCache,
    step: StepInput,
    device: torch.device,
    host: Any,
) -> None:
    metadata = step.metadata
    if device.type != "cpu":  # pragma: no cover - needs CUDA
        metadata = AttentionMetadata(
            slot_mapping=metadata.slot_mapping.to(device),
            query_start_loc=metadata.query_start_loc.to(device),
            seq_lens=metadata.seq_lens.to(device),
            block_tables=metadata.block_tables.to(device),
            query_lens_list=metadata.query_lens_list,
            seq_lens_list=metadata.seq_lens_list,
            block_size=metadata.block_size,
        )
    hook = None
    if step.kv_sends and host is not None:
        sends = step.kv_sends

        def hook(layer: int) -> None:
            host.send_layers(layer, kv_cache, sends)

    input_ids, positions = step.input_ids.to(device), step.positions.to(device)
    hidden = model(input_ids, positions, kv_cache, metadata, hook)
    if step.logits_indices.numel():
        model.compute_logits(hidden[step.logits_indices.to(device)])


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    conn = Connection(int(sys.argv[1]))
    control = Connection(int(sys.argv[2])) if len(sys.argv) > 2 else None
    init: WorkerInit = pickle.loads(conn.recv_bytes())
    try:
        _serve(conn, init, control)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", init.rank)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
