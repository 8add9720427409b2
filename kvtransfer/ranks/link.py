"""The control socket between rank 0 and a worker rank's KV endpoint: rank 0's end
(`RankLink`: calls, and the worker's transfer events) and the worker's (`RankHost`: its
own `Receiver` or `Sender`, opened from a `RankTransfer`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BlockIds,
    KVTransferError,
    PeerLostError,
    Ticket,
    TransferOptions,
    TransferState,
    error_from_wire,
    error_to_wire,
)
from kvtransfer.ranks.shards import rank_model_id
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.table import ObserveFn

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a worker answers a control call (connect: its own deadline) this fast


@dataclass(frozen=True, slots=True)
class RankTransfer:
    """How a worker rank opens its endpoint (picklable: sent in `WorkerInit`)."""

    role: str  # "receive" | "send"
    backend: str
    model_id: str  # the replica's; each rank transfers under `rank_model_id`
    options: TransferOptions = TransferOptions()
    listen_host: str = "127.0.0.1"  # a tcp/nccl receiver listens here (any free port)
    advertise_host: str | None = None
    source_host: str | None = None  # tcp senders connect from here

    @property
    def lands_in_shared_memory(self) -> bool:
        """An shm receiver: it makes its rank's cache (in shared memory) itself."""
        return self.role == "receive" and self.backend == "shm"

    def link(self, rank: int, conn: Connection) -> RankLink:
        """Rank 0: its end of worker `rank`'s control socket."""
        return RankLink(rank, conn)

    def open_host(
        self,
        rank: int,
        size: int,
        conn: Connection,
        spec: KVCacheSpec,
        kv_cache: KVCache | None,
        device: torch.device,
    ) -> tuple[RankHost, KVCache, tuple[str, int] | None]:
        """Worker `rank`: its endpoint over its own shard (`spec`; `kv_cache` None for an
        shm receiver, which makes its own in shared memory), answering on `conn`. Returns
        the host, the shard's cache and, for a receiver, its (endpoint, epoch)."""
        host = RankHost(rank, conn)
        endpoint = open_rank_endpoint(self, spec, rank, size, kv_cache, device, host.observe)
        host.start(endpoint)
        if isinstance(endpoint, Receiver):
            return host, endpoint.kv_cache, (endpoint.endpoint, endpoint.epoch)
        assert kv_cache is not None
        return host, kv_cache, None


class RankLink:
    """Rank 0's end of worker `rank`'s control socket: calls (answered in any order) and
    the worker's transfer events, read by one thread."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank, self._conn = rank, conn
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self.lost: PeerLostError | None = None
        self.on_event: Callable[[str, TransferState, KVTransferError | None, bool], None] = (
            lambda *_: None
        )
        self.on_lost: Callable[[PeerLostError], None] = lambda _: None
        self._reader = threading.Thread(target=self._read, name=f"kv-rank{rank}-link", daemon=True)
        self._reader.start()

    def call_async(self, op: str, *args: object) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self.lost is not None:
                future.set_exception(self.lost)
                return future
            call_id = next(self._ids)
            self._pending[call_id] = future
        if not self._send(("call", call_id, op, args)):
            with self._lock:
                self._pending.pop(call_id, None)
            future.set_exception(PeerLostError(f"tensor-parallel rank {self.rank} is gone"))
        return future

    def call(self, op: str, *args: object, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return result(self.call_async(op, *args), timeout_s, self.rank)

    def cast(self, op: str, *args: object) -> None:
        """A call whose answer nobody waits for (abort, finish)."""
        self._send(("cast", -1, op, args))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()

    def _send(self, message: tuple[object, ...]) -> bool:
        payload = pickle.dumps(message)
        with self._send_lock:
            try:
                self._conn.send_bytes(payload)
                return True
            except (OSError, ValueError):
                return False

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = pickle.loads(self._conn.recv_bytes())
                if kind == "reply":
                    call_id, ok, value = rest
                    with self._lock:
                        future = self._pending.pop(call_id, None)
                    if future is not None:
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(error_from_wire(value, f"rank {self.rank}"))
                else:  # "event"
                    request_id, code, error, settled = rest
                    err = None if error is None else error_from_wire(error, f"rank {self.rank}")
                    self.on_event(request_id, TransferState.from_code(code), err, settled)
        except (EOFError, OSError, ValueError):
            pass
        except Exception:
            logger.exception("tensor-parallel rank %d control link failed", self.rank)
        lost = PeerLostError(f"tensor-parallel rank {self.rank} is gone")
        with self._lock:
            self.lost = lost
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            with contextlib.suppress(Exception):
                future.set_exception(lost)
        self.on_lost(lost)


def result(future: Future[Any], timeout_s: float, rank: int) -> Any:
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise PeerLostError(
            f"tensor-parallel rank {rank} did not answer in {timeout_s} s"
        ) from None


# ---- the worker's end --------------------------------------------------------------------


class RankHost:
    """A worker rank's endpoint and its control socket: answers rank 0's calls on one
    thread (connects and warm-ups each on a thread of their own, as they may wait on a
    peer), reports its transfers' ends, and sends its shard's layers in the step's hook."""

    def __init__(self, rank: int, conn: Connection) -> None:
        """Then `start(endpoint)`, the endpoint opened with `observe=host.observe`."""
        self.rank, self._conn = rank, conn
        self.endpoint: Receiver | Sender | None = None
        self._send_lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}  # sender: the rank tickets being served
        self._thread = threading.Thread(target=self._serve, name="kv-rank-host", daemon=True)

    def start(self, endpoint: Receiver | Sender) -> None:
        self.endpoint = endpoint
        self._thread.start()

    def observe(
        self, request_id: str, state: TransferState, error: KVTransferError | None, settled: bool
    ) -> None:
        """The endpoint's `ObserveFn`: tell rank 0."""
        if settled:
            self._tickets.pop(request_id, None)
        wire = None if error is None else error_to_wire(error)
        self._send(("event", request_id, state.code, wire, settled))

    def send_layers(self, layer: int, kv_cache: Any, sends: Sequence[tuple[str, BlockIds]]) -> None:
        """Worker main thread, after layer `layer` of a step is in this rank's cache."""
        assert isinstance(self.endpoint, Sender)
        for request_id, block_ids in sends:
            ticket = self._tickets.get(request_id)
            if ticket is not None:
                k, v = kv_cache.key_caches[layer], kv_cache.value_caches[layer]
                self.endpoint.send_layer(ticket, layer, k, v, block_ids)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        with contextlib.suppress(OSError):
            self._conn.close()

    def _send(self, message: tuple[object, ...]) -> None:
        payload = pickle.dumps(message)
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._conn.send_bytes(payload)

    def _serve(self) -> None:
        try:
            while True:
                kind, call_id, op, args = pickle.loads(self._conn.recv_bytes())
                if op in ("connect", "warm"):
                    worker = threading.Thread(
                        target=self._answer, args=(kind, call_id, op, args), daemon=True
                    )
                    worker.start()
                else:
                    self._answer(kind, call_id, op, args)
        except (EOFError, OSError, ValueError):
            return  # rank 0 is gone; the worker's main loop exits on its own socket

    def _answer(self, kind: str, call_id: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            value = getattr(self, f"_op_{op}")(*args)
            reply: tuple[object, ...] = ("reply", call_id, True, value)
        except KVTransferError as exc:
            reply = ("reply", call_id, False, error_to_wire(exc))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0
            reply = ("reply", call_id, False, error_to_wire(KVTransferError(repr(exc))))
        if kind == "call":
            self._send(reply)

    # receive
    def _op_open(
        self, request_id: str, block_ids: tuple[int, ...], deadline_s: float, num_cached: int
    ) -> None:
        assert isinstance(self.endpoint, Receiver)
        self.endpoint.open_ticket(request_id, block_ids, deadline_s, num_cached)

    def _op_counts(self) -> dict[str, int]:
        assert isinstance(self.endpoint, Receiver)
        return self.endpoint.transfer_counts()

    # send
    def _op_connect(self, ticket: Ticket, timeout_s: float) -> None:
        assert isinstance(self.endpoint, Sender)
        self._tickets[ticket.request_id] = ticket
        self.endpoint.connect(ticket, timeout_s)

    def _op_finish(self, request_id: str) -> None:
        assert isinstance(self.endpoint, Sender)
        if (ticket := self._tickets.get(request_id)) is not None:
            self.endpoint.finish(ticket)

    def _op_warm(self, endpoint: str, timeout_s: float) -> None:
        assert isinstance(self.endpoint, Sender)
        self.endpoint.warm(endpoint, timeout_s)

    # both
    def _op_abort(self, request_id: str) -> None:
        assert self.endpoint is not None
        self.endpoint.abort(request_id)

    def _op_problem(self) -> str | None:
        assert self.endpoint is not None
        return self.endpoint.serving_problem()


def open_rank_endpoint(
    transfer: RankTransfer,
    spec: Any,
    rank: int,
    size: int,
    kv_cache: Any,
    device: Any,
    observe: ObserveFn,
) -> Receiver | Sender:
    """Worker rank `rank`'s own endpoint over its shard (`spec`: the shard's); releases
    nothing itself (the blocks belong to rank 0's pool: the group releases them)."""
    from kvtransfer import create_receiver, create_sender

    model_id = rank_model_id(transfer.model_id, rank, size)
    if transfer.role == "receive":
        network: dict[str, Any] = {}
        if transfer.backend in ("tcp", "nccl"):
            network = {"host": transfer.listen_host, "advertise_host": transfer.advertise_host}
        return create_receiver(
            transfer.backend,
            spec,
            kv_cache,
            model_id=model_id,
            release=nothing,
            options=transfer.options,
            device=device if transfer.backend in ("nccl", "cuda_ipc") else None,
            observe=observe,
            **network,
        )
    return create_sender(
        transfer.backend,
        spec,
        model_id=model_id,
        release=nothing,
        options=transfer.options,
        host=transfer.source_host if transfer.backend == "tcp" else None,
        device=device if transfer.backend in ("nccl", "cuda_ipc") else None,
        observe=observe,
    )


def nothing(_: str) -> None:
    pass
