"""Per-rank KV transfer endpoints of tensor-parallel replicas.

Where each rank of a TP replica holds its KV shard in memory only it can address (CUDA:
its own GPU), one endpoint in rank 0 cannot move the replica's KV. Instead every rank runs
an ordinary `Receiver` or `Sender` over its own shard, and rank i of a prefill replica
writes into rank i of a decode replica of the same TP size:

    decode rank 0   GroupReceiver.open_ticket ──▶ its own receiver, and each worker's over
                    the worker's control socket ──▶ one ticket: rank 0's endpoint, and the
                    others' in `Ticket.ranks`
    prefill rank 0  GroupSender.connect(ticket) ──▶ rank i connects to decode rank i
                    each step: rank i's layer hook sends its shard's layer
                    (`engine.tp_worker.RankSends`)
                    finish ──▶ every rank

Each rank's endpoint tells rank 0 when a transfer ends and when it settles (`ObserveFn`:
nothing can write or read its blocks any more). A group transfer is DONE once every rank's
is; any other end of one rank ends it (the others are aborted); its `release` runs once,
after every rank has settled, so blocks go back to the pool only when no rank of either
side can still touch them. A worker that dies settles its ranks' transfers as FAILED: a
dead process writes nothing.

Each rank's layout is its shard's (`rank_layout`), its model id naming the rank, so a
rank can never land another rank's heads. Ranks of another TP size are not bridged here:
`GroupSender` refuses such a ticket (`KVLayoutMismatchError`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.parallel import split
from kvtransfer.base import (
    BlockIds,
    KVLayout,
    KVLayoutMismatchError,
    KVTransferError,
    PeerLostError,
    ReleaseFn,
    Ticket,
    TransferAbortedError,
    TransferOptions,
    TransferState,
    UnknownTransferError,
    error_from_wire,
    error_to_wire,
)
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.table import ObserveFn

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a worker answers a control call (connect: its own deadline) this fast
TTL_S = 120.0  # settled group transfers stay pollable this long


def rank_model_id(model_id: str, rank: int, size: int) -> str:
    """The model id rank `rank` of `size` transfers under: ranks never match each other."""
    return f"{model_id}@rank{rank}of{size}"


def rank_layout(layout: KVLayout, rank: int) -> KVLayout:
    """Rank `rank`'s own layout, given a replica's: its shard of the KV heads, one rank."""
    size = layout.tensor_parallel_size
    return replace(
        layout,
        model_id=rank_model_id(layout.model_id, rank, size),
        num_kv_heads=len(split(layout.num_kv_heads, rank, size)),
        tensor_parallel_size=1,
    )


def rank_ticket(ticket: Ticket, rank: int) -> Ticket:
    """The ordinary ticket rank `rank` of the sender serves: rank `rank` of the receiver."""
    endpoint, epoch = (ticket.endpoint, ticket.epoch) if rank == 0 else ticket.ranks[rank - 1]
    return Ticket(
        ticket.request_id,
        endpoint,
        ticket.block_ids,
        rank_layout(ticket.layout, rank),
        epoch,
        ticket.seconds_left(),
        ticket.num_cached_blocks,
    )


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


# ---- the group's state ------------------------------------------------------------------


@dataclass(slots=True)
class _Transfer:
    states: list[TransferState | None]  # each rank's terminal state, once it ended
    errors: list[KVTransferError | None]
    settled: list[bool]
    released: bool = False
    settled_at: float = 0.0


class _GroupTable:
    """One group transfer per request id: the ranks' ends combined (see the module doc)."""

    def __init__(self, size: int, release: ReleaseFn, release_on_done: bool) -> None:
        self.size, self._release, self._release_on_done = size, release, release_on_done
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transfers: dict[str, _Transfer] = {}

    def open(self, request_id: str) -> None:
        with self._lock:
            now = time.monotonic()
            for rid in [r for r, t in self._transfers.items() if _expired(t, now)]:
                del self._transfers[rid]
            old = self._transfers.get(request_id)
            if old is not None and not old.released:
                raise ValueError(f"a transfer for request {request_id!r} is still open")
            n = self.size
            self._transfers[request_id] = _Transfer([None] * n, [None] * n, [False] * n)
            self._changed.notify_all()

    def discard(self, request_id: str) -> None:
        """Forget a transfer without releasing anything (it never reached a sender)."""
        with self._lock:
            self._transfers.pop(request_id, None)
            self._changed.notify_all()

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._transfers

    def observe(
        self,
        rank: int,
        request_id: str,
        state: TransferState,
        error: KVTransferError | None,
        settled: bool,
    ) -> None:
        """Rank `rank`'s transfer ended (`settled` False) or settled (True)."""
        release = False
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None:
                return
            if transfer.states[rank] is None:
                transfer.states[rank], transfer.errors[rank] = state, error
            transfer.settled[rank] = transfer.settled[rank] or settled
            if all(transfer.settled) and not transfer.released:
                transfer.released, transfer.settled_at = True, time.monotonic()
                done = all(s is TransferState.DONE for s in transfer.states)
                release = self._release_on_done or not done
            self._changed.notify_all()
        if release:
            try:
                self._release(request_id)
            except Exception:
                logger.exception("release(%r) raised", request_id)

    def settle_unheard(self, rank: int, error: KVTransferError) -> None:
        """Rank `rank` is gone: every transfer it has not settled settles FAILED."""
        with self._lock:
            ids = [rid for rid, t in self._transfers.items() if not t.settled[rank]]
        for rid in ids:
            self.observe(rank, rid, TransferState.FAILED, error, settled=True)

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            return _combined(self._require(request_id))

    def error(self, request_id: str) -> KVTransferError | None:
        with self._lock:
            transfer = self._require(request_id)
            if _combined(transfer) in (TransferState.DONE, TransferState.PENDING):
                return None
            return next((e for e in transfer.errors if e is not None), None)

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                state = _combined(self._require(request_id))
                left = deadline - time.monotonic()
                if state.is_terminal or left <= 0:
                    return state
                self._changed.wait(left)

    def counts(self) -> dict[str, int]:
        with self._lock:
            transfers = list(self._transfers.values())
        return {
            "num_open": sum(not _combined(t).is_terminal for t in transfers),
            "num_fenced": sum(_combined(t).is_terminal and not t.released for t in transfers),
        }

    def unsettled(self) -> list[str]:
        with self._lock:
            return [rid for rid, t in self._transfers.items() if not t.released]

    def _require(self, request_id: str) -> _Transfer:
        if (transfer := self._transfers.get(request_id)) is None:
            raise UnknownTransferError(f"no transfer for request {request_id!r}")
        return transfer


def _combined(transfer: _Transfer) -> TransferState:
    """DONE once every rank is; the first other end of any rank; else still running."""
    ended = [s for s in transfer.states if s is not None]
    failed = next((s for s in ended if s is not TransferState.DONE), None)
    if failed is not None:
        return failed
    if len(ended) == len(transfer.states):
        return TransferState.DONE
    return TransferState.TRANSFERRING if ended else TransferState.PENDING


def _expired(transfer: _Transfer, now: float) -> bool:
    return transfer.released and transfer.settled_at + TTL_S <= now


# ---- rank 0's end of a worker's control socket ------------------------------------------


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


# ---- rank 0's group endpoints ------------------------------------------------------------


@dataclass(slots=True)
class _Ranks:
    """Rank 0's own endpoint and its links to the workers, observed by one group table."""

    own: Receiver | Sender
    links: Sequence[RankLink]
    table: _GroupTable = field(init=False)

    def attach(self, table: _GroupTable) -> None:
        self.table = table
        for link in self.links:
            link.on_event = _bind_rank(table, link.rank)
            link.on_lost = _bind_lost(table, link.rank)
            if link.lost is not None:
                table.settle_unheard(link.rank, link.lost)

    def problem(self) -> str | None:
        if (problem := self.own.serving_problem()) is not None:
            return problem
        lost = next((link for link in self.links if link.lost is not None), None)
        return None if lost is None else f"tensor-parallel rank {lost.rank} is gone"

    def abort(self, request_id: str) -> None:
        self.own.abort(request_id)
        for link in self.links:
            link.cast("abort", request_id)


def _bind_rank(
    table: _GroupTable, rank: int
) -> Callable[[str, TransferState, KVTransferError | None, bool], None]:
    return lambda rid, state, error, settled: table.observe(rank, rid, state, error, settled)


def _bind_lost(table: _GroupTable, rank: int) -> Callable[[PeerLostError], None]:
    return lambda lost: table.settle_unheard(rank, lost)


def group_observer(
    holder: list[_GroupTable],
) -> Callable[[str, TransferState, KVTransferError | None, bool], None]:
    """Rank 0's own endpoint's `ObserveFn`, for a group table made after the endpoint."""
    return lambda rid, state, error, settled: holder[0].observe(0, rid, state, error, settled)


class GroupReceiver:
    """Decode rank 0's receiver for a replica whose ranks each land their own shard. The
    same calls as `Receiver` (what `decode/` uses); `release(request_id)` runs once per
    group transfer that does not end DONE, after every rank has settled."""

    def __init__(
        self,
        own: Receiver,
        links: Sequence[RankLink],
        rank_endpoints: Sequence[tuple[str, int]],
        layout: KVLayout,
        release: ReleaseFn,
        holder: list[_GroupTable],
    ) -> None:
        """`own` was created with `observe=group_observer(holder)`; `rank_endpoints`: the
        workers' receivers (endpoint, epoch), ranks 1..N-1; `layout`: the replica's."""
        self.own, self.layout, self.spec = own, layout, own.spec
        self.kv_cache, self.endpoint, self.epoch = own.kv_cache, own.endpoint, own.epoch
        self.backend = own.backend
        self._rank_endpoints = tuple(rank_endpoints)
        self._table = _GroupTable(layout.tensor_parallel_size, release, release_on_done=False)
        holder.append(self._table)
        self._ranks = _Ranks(own, links)
        self._ranks.attach(self._table)

    def open_ticket(
        self,
        request_id: str,
        block_ids: Sequence[int],
        deadline_s: float,
        num_cached_blocks: int = 0,
    ) -> Ticket:
        """Open the transfer on every rank (`Receiver.open_ticket`); the ticket names them."""
        self._table.open(request_id)
        try:
            own = self.own.open_ticket(request_id, block_ids, deadline_s, num_cached_blocks)
        except BaseException:
            self._table.discard(request_id)
            raise
        ids, links = own.block_ids, self._ranks.links
        calls = [
            link.call_async("open", request_id, ids, deadline_s, num_cached_blocks)
            for link in links
        ]
        failure: KVTransferError | None = None
        for link, call in zip(links, calls, strict=True):
            try:
                result(call, CALL_TIMEOUT_S, link.rank)
            except KVTransferError as exc:
                failure = failure or exc
        if failure is not None:
            # No sender holds the ticket: nothing can write the blocks, and they stay the
            # caller's (as when `Receiver.open_ticket` raises), so no release runs.
            self._table.discard(request_id)
            self._ranks.abort(request_id)
            raise failure
        return Ticket(
            request_id,
            own.endpoint,
            ids,
            self.layout,
            own.epoch,
            deadline_s,
            num_cached_blocks,
            self._rank_endpoints,
        )

    def abort(self, request_id: str) -> None:
        if self._table.known(request_id):
            self._ranks.abort(request_id)

    def poll(self, request_id: str) -> TransferState:
        return self._table.state(request_id)

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        return self._table.error(request_id)

    def transfer_counts(self) -> dict[str, int]:
        counts = self._table.counts()
        return {**counts, "num_quarantined": self.own.transfer_counts()["num_quarantined"]}

    def endpoint_stats(self) -> dict[str, int]:
        return self.own.endpoint_stats()

    def serving_problem(self) -> str | None:
        return self._ranks.problem()

    def close(self) -> None:
        for request_id in self._table.unsettled():
            self._ranks.abort(request_id)
        self.own.close()


class GroupSender:
    """Prefill rank 0's sender for a replica whose ranks each send their own shard to the
    same rank of a decode replica of the same TP size. The same calls as `Sender` (what
    `prefill/` uses); `release(request_id)` runs once per request id it was given, after
    every rank has settled (no rank reads the source blocks any more)."""

    def __init__(
        self,
        own: Sender,
        links: Sequence[RankLink],
        layout: KVLayout,
        release: ReleaseFn,
        holder: list[_GroupTable],
    ) -> None:
        self.own, self.layout, self.spec, self.backend = own, layout, own.spec, own.backend
        self._table = _GroupTable(layout.tensor_parallel_size, release, release_on_done=True)
        holder.append(self._table)
        self._ranks = _Ranks(own, links)
        self._ranks.attach(self._table)
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.own.closed

    def connect(self, ticket: Ticket, timeout_s: float) -> None:
        """Every rank connects to its peer rank and binds its transfer (`Sender.connect`);
        the first refusal ends the group transfer and is raised."""
        size = self.layout.tensor_parallel_size
        with self._lock:
            self._table.open(ticket.request_id)
        if diffs := self.layout.differences(ticket.layout, bridged=()):
            return self._refuse(ticket, KVLayoutMismatchError(diffs, "sender", "ticket"))
        if len(ticket.ranks) != size - 1:
            error = KVLayoutMismatchError(
                {"rank_endpoints": (size, len(ticket.ranks) + 1)}, "sender", "ticket"
            )
            return self._refuse(ticket, error)
        links = self._ranks.links
        calls = [
            link.call_async("connect", rank_ticket(ticket, link.rank), timeout_s) for link in links
        ]
        failure: KVTransferError | None = None
        try:
            self.own.connect(rank_ticket(ticket, 0), timeout_s)
        except KVTransferError as exc:
            failure = exc
        for link, call in zip(links, calls, strict=True):
            try:
                result(call, timeout_s + 1.0, link.rank)
            except KVTransferError as exc:
                failure = failure or exc
                self._table.observe(link.rank, ticket.request_id, TransferState.FAILED, exc, False)
        if failure is not None:
            self._ranks.abort(ticket.request_id)
            raise failure
        return None

    def _refuse(self, ticket: Ticket, error: KVTransferError) -> None:
        for rank in range(self.layout.tensor_parallel_size):
            self._table.observe(rank, ticket.request_id, TransferState.FAILED, error, True)
        raise error

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: BlockIds,
    ) -> None:
        """Rank 0's own shard of `layer` (the workers send theirs: `RankSends`)."""
        self.own.send_layer(rank_ticket(ticket, 0), layer, k_cache, v_cache, src_block_ids)

    def finish(self, ticket: Ticket) -> None:
        self.own.finish(rank_ticket(ticket, 0))
        for link in self._ranks.links:
            link.cast("finish", ticket.request_id)

    def abort(self, request_id: str) -> None:
        """Idempotent; a request id never connected is released all the same."""
        with self._lock:
            if not self._table.known(request_id):
                self._table.open(request_id)
                self._settle_unknown(request_id)
                return
        self._ranks.abort(request_id)

    def _settle_unknown(self, request_id: str) -> None:
        error = TransferAbortedError("aborted by prefill")
        for rank in range(self.layout.tensor_parallel_size):
            self._table.observe(rank, request_id, TransferState.ABORTED, error, True)

    def warm(self, endpoint: str, timeout_s: float) -> None:
        """Rank 0 connects to the decode replica's rank 0 (the others on first use)."""
        self.own.warm(endpoint, timeout_s)

    def poll(self, request_id: str) -> TransferState:
        return self._table.state(request_id)

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        return self._table.error(request_id)

    def serving_problem(self) -> str | None:
        return self._ranks.problem()

    def close(self) -> None:
        for request_id in self._table.unsettled():
            self._ranks.abort(request_id)
        self.own.close()


# ---- rank 0's own endpoint ---------------------------------------------------------------


def shard_spec(spec: KVCacheSpec, rank: int) -> KVCacheSpec:
    """Rank `rank`'s own cache, given a replica's spec (`engine.tp_kv.rank_spec`)."""
    size = spec.tensor_parallel_size
    return replace(
        spec,
        num_layers=spec.num_model_layers,
        num_kv_heads=len(split(spec.num_model_kv_heads, rank, size)),
        tensor_parallel_size=1,
        model_kv_heads=None,
    )


def open_group_receiver(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    options: TransferOptions,
    device: str,
    network: dict[str, Any],
) -> tuple[Receiver, RankTransfer, list[_GroupTable]]:
    """Decode rank 0 of a replica of `spec` (replica-wide) with per-rank endpoints: its own
    receiver (its cache is rank 0's shard: give it to the engine), what the workers open
    (`Engine(rank_endpoints=...)`), and the holder `GroupReceiver` takes."""
    from kvtransfer import create_receiver

    size, holder = spec.tensor_parallel_size, list[_GroupTable]()
    own_spec = shard_spec(spec, 0)
    kv_cache = None if backend == "shm" else KVCache.allocate(own_spec, device)
    own = create_receiver(
        backend,
        own_spec,
        kv_cache,
        model_id=rank_model_id(model_id, 0, size),
        release=_nothing,
        options=options,
        device=device if backend in ("nccl", "cuda_ipc") else None,
        observe=group_observer(holder),
        **network,
    )
    transfer = RankTransfer(
        "receive",
        backend,
        model_id,
        options,
        listen_host=network.get("host", "127.0.0.1"),
        advertise_host=network.get("advertise_host"),
    )
    return own, transfer, holder


def open_group_sender(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    options: TransferOptions,
    device: str,
    source_host: str | None,
) -> tuple[Sender, RankTransfer, list[_GroupTable]]:
    """Prefill rank 0's own sender (over rank 0's shard), what the workers open, and the
    holder `GroupSender` takes."""
    from kvtransfer import create_sender

    size, holder = spec.tensor_parallel_size, list[_GroupTable]()
    own = create_sender(
        backend,
        shard_spec(spec, 0),
        model_id=rank_model_id(model_id, 0, size),
        release=_nothing,
        options=options,
        host=source_host if backend == "tcp" else None,
        device=device if backend in ("nccl", "cuda_ipc") else None,
        observe=group_observer(holder),
    )
    transfer = RankTransfer("send", backend, model_id, options, source_host=source_host)
    return own, transfer, holder


# What a replica's server holds: one endpoint, or rank 0's group of per-rank endpoints.
AnyReceiver = Receiver | GroupReceiver
AnySender = Sender | GroupSender
