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
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

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
    kv_backing: BackingFile | None  # CPU: the shared cache; CUDA: None (own shard)
    parent_pid: int


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step's model inputs, as rank 0 prepared them (CPU tensors)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs]; empty: no logits this step


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
    ) -> None:
        """Spawn ranks 1..N-1 and form the process group with them (blocks until every
        rank has joined, at most `COLLECTIVE_TIMEOUT_S`). Call `wait_ready` before the
        first step."""
        size = config.tensor_parallel_size
        device = torch.device(config.device)
        backend = backend_for(device)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        self.broken = False
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        # Stops the workers if the engine is dropped or the interpreter exits first.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
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
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.tp_worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                cwd=os.getcwd(),
            )
        finally:
            theirs.close()
        self._procs.append(proc)
        conn = Connection(ours.detach())
        self._conns.append(conn)
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


def _stop(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
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


def start_workers(
    config: EngineConfig,
    model_dir: str,
    model_config: ModelConfig,
    kv_spec: KVCacheSpec,
    kv_cache: KVCache | None,
) -> tuple[TPWorkers, KVCache, KVCache]:
    """Spawn ranks 1..N-1 of a replica and wait until they hold their shards.

    Returns the workers, the replica-wide KV cache (what the KV transfer packs and lands)
    and rank 0's own view of it. On the CPU the ranks share the replica-wide cache in
    /dev/shm (`kv_cache`, when given, must live there: the shm receiver's segment); on
    CUDA each rank keeps its own shard on its own GPU, and the "replica-wide" cache is
    rank 0's shard (KV transfer from GPU ranks is not built: config validation says so).
    """
    shard = Shard(model_config, 0, config.tensor_parallel_size)
    backing = None
    if config.device.startswith("cuda"):  # pragma: no cover - needs CUDA
        if kv_cache is not None:
            raise ValueError("a tensor-parallel CUDA replica allocates its own KV shards")
        own = KVCache.allocate(rank_spec(kv_spec, shard), config.device)
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
        workers = TPWorkers(config, model_dir, model_config, kv_spec, backing)
        workers.wait_ready()
    finally:
        if backing is not None and is_ours(backing):  # every rank has mapped it (or failed)
            unlink_quietly(backing.path)
    if kv_cache is None:  # pragma: no cover - CUDA
        return workers, own, own
    return workers, kv_cache, rank_view(kv_cache, shard)


# ---- the worker process ------------------------------------------------------------


def _serve(conn: Connection, init: WorkerInit) -> None:
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
    try:
        model = load_model(init.model_config, init.model_dir, device, tp)
        if init.kv_backing is not None:
            kv_cache = rank_view(map_shared(init.kv_backing, init.kv_spec), shard)
        else:  # pragma: no cover - CUDA: this rank's shard on its own GPU
            kv_cache = KVCache.allocate(rank_spec(init.kv_spec, shard), device)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send_bytes(pickle.dumps(("error", repr(exc))))
        raise
    conn.send_bytes(pickle.dumps(("ready", None)))
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
        _run_step(model, kv_cache, step, device)


def _run_step(model: CausalLM, kv_cache: KVCache, step: StepInput, device: torch.device) -> None:
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
    hidden = model(step.input_ids.to(device), step.positions.to(device), kv_cache, metadata)
    if step.logits_indices.numel():
        model.compute_logits(hidden[step.logits_indices.to(device)])


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    conn = Connection(int(sys.argv[1]))
    init: WorkerInit = pickle.loads(conn.recv_bytes())
    try:
        _serve(conn, init)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", init.rank)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
