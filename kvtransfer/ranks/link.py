"""The control socket between rank 0 and a worker rank's KV endpoint: rank 0's end
(`RankLink`: calls, and the worker's transfer events) and the worker's (`RankHost`: its
own `Receiver` or `Sender`, opened from a `RankTransfer`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import threading
import time
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
EXIT_POLL_S = 0.2  # a lost link's rank is checked for having exited this often


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

    def link(self, rank: int, conn: Connection, exited: Callable[[], bool]) -> RankLink:
        """Rank 0: its end of worker `rank`'s control socket (`exited`: whether the
        worker's process has exited)."""
        return RankLink(rank, conn, exited)

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

    def __init__(self, rank: int, conn: Connection, exited: Callable[[], bool]) -> None:
        """`exited()`: whether the rank's process has exited; until it has, a lost link's
        rank may still be writing, so its transfers stay unsettled."""
        self.rank, self._conn, self.exited = rank, conn, exited
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._closed = False
        self._ids = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self.lost: PeerLostError | None = None  # the socket closed or broke
        self.dead = False  # lost, and the rank's process has exited (`on_dead` ran)
        self.on_event: Callable[[str, TransferState, KVTransferError | None, bool], None] = (
            lambda *_: None
        )
        self.on_dead: Callable[[PeerLostError], None] = lambda _: None
        self._reader = threading.Thread(target=self._read, name=f"kv-rank{rank}-link", daemon=True)
        self._reader.start()

    def call_async(self, op: str, *args: object) -> Future[Any]:
        """The call's answer; `NotSentError` when the link was lost before it left."""
        future: Future[Any] = Future()
        not_sent = NotSentError(f"tensor-parallel rank {self.rank}: control link lost")
        with self._lock:
            if self.lost is not None:
                future.set_exception(not_sent)
                return future
            call_id = next(self._ids)
            self._pending[call_id] = future
        if not self._send(("call", call_id, op, args)):
            with self._lock:
                self._pending.pop(call_id, None)
            future.set_exception(not_sent)
        return future

    def cast(self, op: str, *args: object) -> None:
        """A call whose answer nobody waits for (abort, finish)."""
        self._send(("cast", -1, op, args))

    def close(self) -> None:
        with self._send_lock:  # not under a send in progress
            self._closed = True
            _close(self._conn)

    def _send(self, message: tuple[object, ...]) -> bool:
        payload = pickle.dumps(message)
        with self._send_lock:
            if self._closed:
                return False
            try:
                self._conn.send_bytes(payload)
                return True
            except Exception:  # noqa: BLE001 - a broken link: the reader reports it lost
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
                    self._event(*rest)
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
        while not self.exited():  # it may still write: its transfers settle once it is gone
            time.sleep(EXIT_POLL_S)
        self.dead = True
        self.on_dead(lost)

    def _event(self, request_id: str, code: int, error: Any, settled: bool) -> None:
        try:
            err = None if error is None else error_from_wire(error, f"rank {self.rank}")
            self.on_event(request_id, TransferState.from_code(code), err, settled)
        except Exception:  # the link stays up: one bad event is that transfer's problem
            logger.exception("tensor-parallel rank %d: event for %r failed", self.rank, request_id)


class NotSentError(PeerLostError):
    """A call never reached the worker (its control link was lost already): the worker knows
    nothing of it."""


def _close(conn: Connection) -> None:
    """Shut the socket down (a thread blocked reading it wakes up, the peer reads EOF), then
    close it."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    with contextlib.suppress(OSError):
        conn.close()


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
    thread (connects, warm-ups and aborts each on a thread of their own, as they may wait
    on a peer or a write in flight), reports its transfers' ends, and sends its shard's
    layers in the step's hook."""

    def __init__(self, rank: int, conn: Connection) -> None:
        """Then `start(endpoint)`, the endpoint opened with `observe=host.observe`."""
        self.rank, self._conn = rank, conn
        self.endpoint: Receiver | Sender | None = None
        self._send_lock = threading.Lock()
        self._closed = False
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

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        self._close()

    def _close(self) -> None:
        with self._send_lock:  # once, and not under a send in progress
            if not self._closed:
                self._closed = True
                _close(self._conn)

    def _send(self, message: tuple[object, ...]) -> None:
        payload = pickle.dumps(message)
        with self._send_lock:
            if not self._closed:
                with contextlib.suppress(Exception):  # rank 0 gone: nothing to tell
                    self._conn.send_bytes(payload)

    def _serve(self) -> None:
        try:
            while True:
                kind, call_id, op, args = pickle.loads(self._conn.recv_bytes())
                if op in ("connect", "warm", "abort"):  # may wait on a peer or a write
                    worker = threading.Thread(
                        target=self._answer, args=(kind, call_id, op, args), daemon=True
                    )
                    worker.start()
                else:
                    self._answer(kind, call_id, op, args)
        except (EOFError, OSError, ValueError):
            pass  # rank 0 is gone; the worker's main loop exits on its own socket
        except Exception:
            logger.exception("tensor-parallel rank %d: control socket failed", self.rank)
        finally:  # rank 0 sees the link lost (its health check says so)
            self._close()

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

    # send
    def _op_connect(self, ticket: Ticket, timeout_s: float) -> None:
        assert isinstance(self.endpoint, Sender)
        self._tickets[ticket.request_id] = ticket  # before any layer of it can be sent
        try:
            self.endpoint.connect(ticket, timeout_s)
        except BaseException:
            self._tickets.pop(ticket.request_id, None)  # refused: no event may follow
            raise

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
    spec: KVCacheSpec,
    rank: int,
    size: int,
    kv_cache: KVCache | None,
    device: torch.device,
    observe: ObserveFn,
) -> Receiver | Sender:
    """Rank `rank`'s own endpoint over its shard (`spec`: the shard's), in a worker or
    in rank 0; releases nothing itself (the blocks belong to rank 0's pool: the group
    releases them)."""
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
            release=_nothing,
            options=transfer.options,
            device=device if transfer.backend in ("nccl", "cuda_ipc") else None,
            observe=observe,
            **network,
        )
    return create_sender(
        transfer.backend,
        spec,
        model_id=model_id,
        release=_nothing,
        options=transfer.options,
        host=transfer.source_host if transfer.backend == "tcp" else None,
        device=device if transfer.backend in ("nccl", "cuda_ipc") else None,
        observe=observe,
    )


def _nothing(_: str) -> None:
    pass
