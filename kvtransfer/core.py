"""Backend-independent halves of the interface: ticket bookkeeping, polling, abort, expiry.

`TableReceiver` and `TableSender` implement everything in `base.py` that only needs the
`TransferTable` (what both sides share lives in `TableEnd`); a backend adds how bytes move
and how the other side is told.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BlockIds,
    KVLayout,
    KVLayoutMismatchError,
    KVReceiver,
    KVSender,
    KVTransferError,
    ReleaseFn,
    Ticket,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
    new_epoch,
)
from kvtransfer.blockcopy import as_id_array
from kvtransfer.connections import LayerItem
from kvtransfer.table import Reaper, TransferRecord, TransferTable


class RejectedError(KVTransferError):
    """The receiver refused or ended the transfer; `state` is the state it reported."""

    def __init__(self, state: TransferState, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.state = state
        self.cause = error


class TableEnd:
    """What both ends answer from their `TransferTable`: poll, wait, error, abort, expiry, close.

    Subclasses say how a transfer ends on their side (`_terminate`) and set the names below.
    """

    backend: str
    _role: str  # in close()'s error: "receiver" / "sender" closed
    _replica: str  # in abort()'s error: aborted by "decode" / "prefill"
    _thread_tag: str  # reaper thread name: kv-<backend>-"recv"/"send"-reaper

    def __init__(
        self, spec: KVCacheSpec, model_id: str, options: TransferOptions, table: TransferTable
    ) -> None:
        """Called at the end of `TableReceiver`/`TableSender.__init__`; starts the reaper."""
        self.spec = spec
        self.layout = KVLayout.from_spec(spec, model_id)
        self.options = options
        self._table = table
        self._closed = False
        self._close_lock = threading.Lock()
        self._reaper = Reaper(
            f"kv-{self.backend}-{self._thread_tag}-reaper", options.reap_interval_s, self._reap
        )

    def poll(self, request_id: str) -> TransferState:
        return self._table.require(request_id).state

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        return self._table.require(request_id).error

    def abort(self, request_id: str) -> None:
        self._terminate(
            request_id, TransferState.ABORTED, TransferAbortedError(f"aborted by {self._replica}")
        )

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer from this side (abort, expiry, failure, close)."""
        raise NotImplementedError

    def _reap(self) -> None:
        """Called by the reaper thread: expire overdue transfers, time out fences, and
        release quarantined blocks whose writer is proven gone."""
        for request_id in self._table.overdue(time.time()):
            self._terminate(
                request_id, TransferState.EXPIRED, TransferExpiredError("ticket deadline passed")
            )
        self._table.sweep(self._on_fence_timeout)
        for record in self._table.quarantined_records():
            if self._writer_gone(record):
                self._table.unfence(record.request_id)

    def _on_fence_timeout(self, record: TransferRecord) -> bool:
        """A writer never confirmed it stopped within `fence_timeout_s`: cut it off and
        return True when that stops its writes (the blocks are then released), or return
        False to keep them quarantined until `_writer_gone`. Receivers only; a sender never
        fences its records."""
        return True

    def _writer_gone(self, record: TransferRecord) -> bool:
        """Reaper, for a quarantined record: whether its writer can no longer write."""
        return True

    def _shutdown(self) -> None:
        """Backend teardown after open transfers were aborted (sockets, threads, memory)."""

    def serving_problem(self) -> str | None:
        """Closed, or the reaper (which expires transfers) died; stream backends also check
        their own threads (they extend this)."""
        if self._closed:
            return f"{self._role} closed"
        if not self._reaper.is_alive:
            return f"{self._role} reaper thread died"
        return None

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for record in self._table.open_records():
            self._terminate(
                record.request_id,
                TransferState.ABORTED,
                TransferAbortedError(f"{self._role} closed"),
            )
        self._table.wait_unfenced(1.0)  # only a receiver fences (until its writers stop)
        self._reaper.stop()
        self._shutdown()
        for record in self._table.fenced_records():
            self._table.unfence(record.request_id)


class TableReceiver(TableEnd, KVReceiver):
    """Receiver bookkeeping; subclasses move bytes and override `_terminate`/`_shutdown`."""

    backend = "abstract"
    _role, _replica, _thread_tag = "receiver", "decode", "recv"

    def __init__(
        self,
        spec: KVCacheSpec,
        kv_cache: KVCache | None,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions,
        epoch: int | None = None,
    ) -> None:
        """`kv_cache=None` allocates the destination cache on the CPU."""
        if kv_cache is None:
            kv_cache = KVCache.allocate(spec)
        if kv_cache.spec != spec:
            raise ValueError(f"kv_cache spec {kv_cache.spec} != receiver spec {spec}")
        self.epoch = new_epoch() if epoch is None else epoch
        self._kv_cache = kv_cache
        table = TransferTable(
            release,
            release_on_done=False,
            fence_timeout_s=options.fence_timeout_s,
            tombstone_ttl_s=options.tombstone_ttl_s,
            barrier=self._release_barrier,
        )
        super().__init__(spec, model_id, options, table)

    @property
    def kv_cache(self) -> KVCache:
        return self._kv_cache

    def open_ticket(self, request_id: str, block_ids: Sequence[int], deadline_s: float) -> Ticket:
        if self._closed:
            raise RuntimeError("receiver is closed")
        ids = tuple(int(b) for b in block_ids)
        if not ids:
            raise ValueError("a ticket needs at least one block")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination block ids for {request_id!r}")
        if min(ids) < 0 or max(ids) >= self.spec.num_blocks:
            raise ValueError(f"block ids out of range [0, {self.spec.num_blocks})")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        deadline = time.time() + deadline_s
        self._table.add(TransferRecord(request_id, ids, deadline))
        return Ticket(request_id, self.endpoint, ids, self.layout, self.epoch, deadline)

    def num_layers_received(self, request_id: str) -> int:
        return self._table.require(request_id).num_layers_done

    def transfer_counts(self) -> dict[str, int]:
        """Quarantined blocks belong to ended transfers whose writer did not confirm it
        stopped and may still run (a stopped prefill process): they return once it does."""
        return self._table.counts()

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer from this side (abort, expiry, failure); backends notify the peer."""
        self._table.finish(request_id, state, error)

    def _release_barrier(self, record: TransferRecord) -> None:
        """Runs right before `release` (nccl: wait for the stream writing the blocks)."""

    def _all_layers_landed(self, record: TransferRecord) -> bool:
        """Called when the sender finishes: whether every layer of the transfer was marked."""
        return record.layers_mask == (1 << self.spec.num_layers) - 1

    def _missing_layers_error(self, record: TransferRecord) -> KVTransferError:
        """The error that fails a transfer finished before all its layers landed."""
        missing = [i for i in range(self.spec.num_layers) if not record.layers_mask >> i & 1]
        return KVTransferError(f"finished without layers {missing}")


class TableSender(TableEnd, KVSender):
    """Sender bookkeeping; subclasses queue/move bytes and override `_notify_peer`."""

    backend = "abstract"
    _role, _replica, _thread_tag = "sender", "prefill", "send"

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
    ) -> None:
        self._records_lock = threading.Lock()
        table = TransferTable(
            release, release_on_done=True, tombstone_ttl_s=options.tombstone_ttl_s
        )
        super().__init__(spec, model_id, options, table)

    # -- records ---------------------------------------------------------------------------

    def _record(self, ticket: Ticket) -> TransferRecord | None:
        """The live record serving `ticket`, created on first use; None once it is terminal."""
        failure: KVTransferError | None = None
        with self._records_lock:
            record = self._table.get(ticket.request_id)
            if record is not None and (record.ticket is None or record.ticket == ticket):
                return None if record.state.is_terminal else record
            if record is not None and not record.state.is_terminal:
                raise ValueError(
                    f"request {ticket.request_id!r} already has an open transfer "
                    "under another ticket"
                )
            record = TransferRecord(ticket.request_id, ticket.block_ids, ticket.deadline, ticket)
            self._table.add(record)
            diffs = self.layout.differences(ticket.layout)
            if diffs:
                failure = KVLayoutMismatchError(diffs, "sender", "ticket")
        if failure is not None:
            self._table.finish(ticket.request_id, TransferState.FAILED, failure)
            return None
        return record

    # -- interface -------------------------------------------------------------------------

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: BlockIds,
    ) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.spec.num_layers})")
        expected = (self.spec.num_blocks, *self.spec.block_shape)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(t.shape) != expected or t.dtype != self.spec.torch_dtype:
                raise ValueError(
                    f"{name} is {tuple(t.shape)}/{t.dtype}, expected {expected}/"
                    f"{self.spec.torch_dtype}"
                )
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (one layer of a paged cache)")
        if len(src_block_ids) != ticket.num_blocks:
            raise ValueError(
                f"{len(src_block_ids)} source blocks for a ticket of {ticket.num_blocks}"
            )
        record = self._record(ticket)
        if record is not None:  # else the transfer already ended: nothing to send
            item = LayerItem(ticket, layer, k_cache, v_cache, as_id_array(src_block_ids))
            self._send_layer(record, item)

    def _send_layer(self, record: TransferRecord, item: LayerItem) -> None:
        """Called by `send_layer` once its arguments passed and the transfer is live: move
        (local) or queue (socket backends) the layer. Transfer problems end it FAILED."""
        raise NotImplementedError

    def connect(self, ticket: Ticket, timeout_s: float) -> None:
        record = self._record(ticket)
        if record is None:  # refused on the spot (layout) or already ended
            ended = self._table.require(ticket.request_id)
            raise ended.error or KVTransferError(f"transfer is {ended.state.value}")
        try:
            self._bind_now(record, ticket, timeout_s)
        except RejectedError as exc:
            self._terminate(ticket.request_id, exc.state, exc.cause)
            raise exc.cause from None
        except KVTransferError as exc:
            self._terminate(ticket.request_id, TransferState.FAILED, exc)
            raise

    def _bind_now(self, record: TransferRecord, ticket: Ticket, timeout_s: float) -> None:
        """Called by `connect` on the caller's thread: bind `record` at the receiver now.

        Raise KVTransferError to end the transfer FAILED (RejectedError: in its state).
        """
        raise NotImplementedError

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer from this side: stop writing, tell the receiver, release."""
        with self._records_lock:
            record = self._table.get(request_id)
            if record is None:
                tomb = TransferRecord(request_id, (), time.time())
                self._table.add_terminal(tomb, state, error)
                return
        with record.write_lock:  # wait for an in-flight layer copy into remote blocks
            ended = self._table.finish(request_id, state, error)
        if ended:
            self._notify_peer(record, state, error)

    def _notify_peer(
        self, record: TransferRecord, state: TransferState, error: KVTransferError
    ) -> None:
        """Tell the receiver this transfer ended on our side (backends with a channel)."""
