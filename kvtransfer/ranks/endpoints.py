"""Rank 0's group endpoints: `GroupReceiver` (decode) and `GroupSender` (prefill), the
calls of one `Receiver` or `Sender` made over every rank's own endpoint."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec
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
)
from kvtransfer.ranks.group import GroupTable
from kvtransfer.ranks.link import (
    CALL_TIMEOUT_S,
    NotSentError,
    RankLink,
    RankTransfer,
    open_rank_endpoint,
    result,
)
from kvtransfer.ranks.shards import rank_ticket, shard_spec
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender

HEALTH_PERIOD_S = 5.0  # a worker's own endpoint is asked for problems this often
SILENT_MARGIN_S = 60.0  # past a transfer's deadline, a rank that has not ended it is stuck


@dataclass(slots=True)
class _Ranks:
    """Rank 0's own endpoint and its links to the workers, observed by one group table."""

    own: Receiver | Sender
    links: Sequence[RankLink]
    table: GroupTable
    # per worker rank: (when last asked, the call in flight, its last answer)
    _health: dict[int, tuple[float, Future[Any] | None, str | None]] = field(default_factory=dict)
    _health_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for link in self.links:  # rank 0's own endpoint was opened observing the table
            link.on_event = _bind_rank(self.table, link.rank)
            link.on_dead = _bind_dead(self.table, link.rank)
            if link.dead and link.lost is not None:
                self.table.settle_rank(link.rank, link.lost)

    def gone(self) -> list[int]:
        """Worker ranks whose process has exited."""
        return [link.rank for link in self.links if link.dead]

    def problem(self) -> str | None:
        """Why this group cannot serve: rank 0's endpoint's problem, a worker's (asked every
        `HEALTH_PERIOD_S`, without waiting), a lost control link, or a rank that has not
        ended a transfer well past its deadline. Never blocks."""
        if (problem := self.own.serving_problem()) is not None:
            return problem
        for link in self.links:
            if link.lost is not None:
                return f"tensor-parallel rank {link.rank}: control link lost"
            if (problem := self._worker_problem(link)) is not None:
                return f"tensor-parallel rank {link.rank}: {problem}"
        silent = self.table.silent_ranks(SILENT_MARGIN_S)
        if silent:
            return f"tensor-parallel rank(s) {sorted(silent)} hold transfers past their deadline"
        return None

    def _worker_problem(self, link: RankLink) -> str | None:
        with self._health_lock:  # health checks may come from several threads
            return self._ask_worker(link)

    def _ask_worker(self, link: RankLink) -> str | None:
        now = time.monotonic()
        asked, call, answer = self._health.get(link.rank, (0.0, None, None))
        if call is not None and call.done():
            try:
                answer = call.result()
            except KVTransferError as exc:
                answer = f"no answer: {exc}"
            call = None
        elif call is not None and now - asked > CALL_TIMEOUT_S:
            return f"does not answer (asked {now - asked:.0f} s ago)"
        if call is None and now - asked >= HEALTH_PERIOD_S:
            asked, call = now, link.call_async("problem")
        self._health[link.rank] = (asked, call, answer)
        return answer

    def abort(self, request_id: str) -> None:
        self.own.abort(request_id)
        for link in self.links:
            link.cast("abort", request_id)


def _bind_rank(
    table: GroupTable, rank: int
) -> Callable[[str, TransferState, KVTransferError | None, bool], None]:
    return lambda rid, state, error, settled: table.observe(rank, rid, state, error, settled)


def _bind_dead(table: GroupTable, rank: int) -> Callable[[PeerLostError], None]:
    return lambda lost: table.settle_rank(rank, lost)


class _Group:
    """What both group endpoints answer from their group table."""

    def __init__(self, own: Receiver | Sender, links: Sequence[RankLink], table: GroupTable):
        self._table = table
        self._ranks = _Ranks(own, links, table)

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
        self._ranks.own.close()


class GroupReceiver(_Group):
    """Decode rank 0's receiver for a replica whose ranks each land their own shard. The
    same calls as `Receiver` (what `decode/` uses), except that `open_ticket` waits for
    every worker's answer (bounded by the ticket's deadline): call it off the event loop.
    `release(request_id)` runs once per group transfer that does not end DONE, after every
    rank has settled."""

    def __init__(
        self,
        own: Receiver,
        links: Sequence[RankLink],
        rank_endpoints: Sequence[tuple[str, int]],
        layout: KVLayout,
        table: GroupTable,
    ) -> None:
        """`own` and `table` from `open_group_receiver`; `rank_endpoints`: the workers'
        receivers (endpoint, epoch), ranks 1..N-1; `layout`: the replica's."""
        super().__init__(own, links, table)
        self.own, self.layout, self.spec = own, layout, own.spec
        self.kv_cache, self.endpoint, self.epoch = own.kv_cache, own.endpoint, own.epoch
        self.backend = own.backend
        self._rank_endpoints = tuple(rank_endpoints)

    def open_ticket(
        self,
        request_id: str,
        block_ids: Sequence[int],
        deadline_s: float,
        num_cached_blocks: int = 0,
    ) -> Ticket:
        """Open the transfer on every rank (`Receiver.open_ticket`); the ticket names them.
        When a rank cannot open it, nothing was sent: every rank's record is aborted, no
        release runs (the blocks stay the caller's, as when `Receiver.open_ticket`
        raises) and the first rank's error is raised."""
        expires_at = time.monotonic() + deadline_s
        self._table.open(request_id, deadline_s, gone=self._ranks.gone())
        try:
            own = self.own.open_ticket(request_id, block_ids, deadline_s, num_cached_blocks)
        except BaseException:
            self._table.end_unsent(request_id, TransferAbortedError("not opened"))
            raise
        ids, links = own.block_ids, self._ranks.links
        calls = [
            link.call_async("open", request_id, ids, deadline_s, num_cached_blocks)
            for link in links
        ]
        failure = self._table.error(request_id)  # a rank already gone
        for link, call in zip(links, calls, strict=True):
            try:
                left = min(expires_at - time.monotonic(), CALL_TIMEOUT_S)
                result(call, max(left, 0.0), link.rank)
            except KVTransferError as exc:
                failure = failure or exc
        if failure is not None:
            self._table.end_unsent(request_id, failure)
            self._ranks.abort(request_id)  # an answer that came too late opened it after all
            raise failure
        return Ticket(
            request_id,
            own.endpoint,
            ids,
            self.layout,
            own.epoch,
            max(expires_at - time.monotonic(), 0.001),
            num_cached_blocks,
            self._rank_endpoints,
        )

    def abort(self, request_id: str) -> None:
        if self._table.known(request_id):
            self._ranks.abort(request_id)

    def transfer_counts(self) -> dict[str, int]:
        """`num_open`, `num_fenced` (ended, some rank not yet settled: a worker rank's
        quarantine shows here) and rank 0's own `num_quarantined`."""
        counts = self._table.counts()
        return {**counts, "num_quarantined": self.own.transfer_counts()["num_quarantined"]}

    def endpoint_stats(self) -> dict[str, int]:
        return self.own.endpoint_stats()


class GroupSender(_Group):
    """Prefill rank 0's sender for a replica whose ranks each send their own shard to the
    same rank of a decode replica of the same TP size. The same calls as `Sender` (what
    `prefill/` uses); `release(request_id)` runs once per request id it was given, after
    every rank has settled (no rank reads the source blocks any more)."""

    def __init__(
        self,
        own: Sender,
        links: Sequence[RankLink],
        layout: KVLayout,
        table: GroupTable,
    ) -> None:
        """`own` and `table` from `open_group_sender`; `layout`: the replica's."""
        super().__init__(own, links, table)
        self.own, self.layout, self.spec, self.backend = own, layout, own.spec, own.backend
        self._lock = threading.Lock()  # one of connect/abort registers an id
        # Rank 0's own ticket of each transfer, from connect to finish or abort (its layers
        # go with it: built once, not per layer).
        self._own_tickets: dict[str, Ticket] = {}

    @property
    def closed(self) -> bool:
        return self.own.closed

    def connect(self, ticket: Ticket, timeout_s: float) -> None:
        """Every rank connects to its peer rank and binds its transfer (`Sender.connect`);
        the first refusal ends the group transfer and is raised. An id seen before (ended,
        or aborted before it connected) is refused."""
        rid, size = ticket.request_id, self.layout.tensor_parallel_size
        with self._lock:
            if self._table.known(rid):
                ended = self._table.error(rid)
                raise ended or TransferAbortedError(f"transfer {rid!r} ended already")
            self._table.open(rid, ticket.seconds_left(), gone=self._ranks.gone())
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
        failure = self._table.error(rid)  # a rank already gone
        own = self._own_tickets[rid] = rank_ticket(ticket, 0)
        try:
            self.own.connect(own, timeout_s)
        except KVTransferError as exc:
            failure = failure or exc
        for link, call in zip(links, calls, strict=True):
            try:
                result(call, timeout_s + 1.0, link.rank)
            except KVTransferError as exc:
                failure = failure or exc
                # A live rank that got the call reports its own end (abort below); one
                # that is dead, or never got it, never will.
                unheard = link.dead or isinstance(exc, NotSentError)
                self._table.observe(link.rank, rid, TransferState.FAILED, exc, unheard)
        if failure is not None:
            self._own_tickets.pop(rid, None)
            self._ranks.abort(rid)
            raise failure
        return None

    def _refuse(self, ticket: Ticket, error: KVTransferError) -> None:
        """No rank has seen the ticket: the group ends, released as any other end."""
        self._table.end_unsent(ticket.request_id, error, release=True)
        raise error

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: BlockIds,
    ) -> None:
        """Rank 0's own shard of `layer` (the workers send theirs: `RankSends`); nothing
        once the transfer was finished or aborted here."""
        if (own := self._own_tickets.get(ticket.request_id)) is not None:
            self.own.send_layer(own, layer, k_cache, v_cache, src_block_ids)

    def finish(self, ticket: Ticket) -> None:
        if (own := self._own_tickets.pop(ticket.request_id, None)) is not None:
            self.own.finish(own)
        for link in self._ranks.links:
            link.cast("finish", ticket.request_id)

    def abort(self, request_id: str) -> None:
        """Idempotent. An id never connected is released all the same (as `Sender.abort`
        does) and stays refused: a connect arriving after it does not start."""
        with self._lock:
            if not self._table.known(request_id):
                self._table.open(request_id, 0.0)
                aborted = TransferAbortedError("aborted by prefill")
                self._table.end_unsent(request_id, aborted, release=True)
                return
        self._own_tickets.pop(request_id, None)
        self._ranks.abort(request_id)

    def warm(self, endpoint: str, timeout_s: float) -> None:
        """Rank 0 connects to the decode replica's rank 0 (the others on first use)."""
        self.own.warm(endpoint, timeout_s)


def open_group_receiver(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    options: TransferOptions,
    device: str,
    network: dict[str, Any],
    release: ReleaseFn,
) -> tuple[Receiver, RankTransfer, GroupTable]:
    """Decode rank 0 of a replica of `spec` (replica-wide) with per-rank endpoints: its own
    receiver (its cache is rank 0's shard: give it to the engine), what the workers open
    (`Engine(rank_endpoints=...)`), and the group table (`release`: the group's) that
    `GroupReceiver` takes."""
    transfer = RankTransfer(
        "receive",
        backend,
        model_id,
        options,
        listen_host=network.get("host", "127.0.0.1"),
        advertise_host=network.get("advertise_host"),
    )
    table = GroupTable(spec.tensor_parallel_size, release, release_on_done=False)
    own_spec = shard_spec(spec, 0)
    kv_cache = None if transfer.lands_in_shared_memory else KVCache.allocate(own_spec, device)
    own = _open_own(transfer, own_spec, spec.tensor_parallel_size, kv_cache, device, table)
    assert isinstance(own, Receiver)
    return own, transfer, table


def open_group_sender(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    options: TransferOptions,
    device: str,
    source_host: str | None,
    release: ReleaseFn,
) -> tuple[Sender, RankTransfer, GroupTable]:
    """Prefill rank 0's own sender (over rank 0's shard), what the workers open, and the
    group table (`release`: the group's) that `GroupSender` takes."""
    transfer = RankTransfer("send", backend, model_id, options, source_host=source_host)
    table = GroupTable(spec.tensor_parallel_size, release, release_on_done=True)
    own_spec = shard_spec(spec, 0)
    own = _open_own(transfer, own_spec, spec.tensor_parallel_size, None, device, table)
    assert isinstance(own, Sender)
    return own, transfer, table


def _open_own(
    transfer: RankTransfer,
    spec: KVCacheSpec,
    size: int,
    kv_cache: KVCache | None,
    device: str,
    table: GroupTable,
) -> Receiver | Sender:
    """Rank 0's own endpoint, opened as the workers open theirs, reporting to `table`."""
    observe = _bind_rank(table, 0)
    return open_rank_endpoint(transfer, spec, 0, size, kv_cache, torch.device(device), observe)


# What a replica's server holds: one endpoint, or rank 0's group of per-rank endpoints.
AnyReceiver = Receiver | GroupReceiver
AnySender = Sender | GroupSender
