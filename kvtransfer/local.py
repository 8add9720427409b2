"""`local`: sender and receiver in one process (engine unit tests, single-process demos).

`send_layer` copies the blocks synchronously into the receiver's cache and `finish`
completes at once, so the whole decode/prefill path runs without threads or sockets. The
same checks as the real backends apply: layout, epoch, deadline, abort from either side.
Receivers register themselves under a `local://<id>` endpoint in this process.
"""

from __future__ import annotations

import threading
import uuid
import weakref

import numpy as np
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    KVTransferError,
    PeerLostError,
    ReleaseFn,
    StaleEpochError,
    Ticket,
    TransferOptions,
    TransferState,
    UnknownTransferError,
)
from kvtransfer.blockcopy import CopyPlan, block_rows
from kvtransfer.connections import LayerItem
from kvtransfer.core import TableReceiver, TableSender
from kvtransfer.table import TransferRecord

_RECEIVERS: weakref.WeakValueDictionary[str, LocalReceiver] = weakref.WeakValueDictionary()
_RECEIVERS_LOCK = threading.Lock()


def copy_layer_blocks(
    src: tuple[torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    scratch: dict[str, object],
) -> None:
    """Copy one layer's K and V blocks `src_ids -> dst_ids` (CPU: CopyPlan; GPU: kv_pack)."""
    if src[0].device.type == "cpu" and dst[0].device.type == "cpu":
        rows = [block_rows(t) for t in (*src, *dst)]
        plan = scratch.get("plan")
        if not isinstance(plan, CopyPlan):
            plan = scratch["plan"] = CopyPlan.build(src_ids, dst_ids, rows[0].shape[1])
        plan.copy(rows[0], rows[2])
        plan.copy(rows[1], rows[3])
        return
    from kernels.kv_pack import pack_kv_blocks, unpack_kv_blocks

    packed = pack_kv_blocks(src[0], src[1], torch.from_numpy(src_ids).to(src[0].device))
    packed = packed.to(dst[0].device, non_blocking=True)
    unpack_kv_blocks(packed, dst[0], dst[1], torch.from_numpy(dst_ids).to(dst[0].device))


class LocalReceiver(TableReceiver):
    """In-process receiver; its cache is an ordinary tensor (any device)."""

    backend = "local"

    def __init__(
        self,
        spec: KVCacheSpec,
        kv_cache: KVCache | None = None,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        epoch: int | None = None,
    ) -> None:
        super().__init__(
            spec, kv_cache, model_id=model_id, release=release, options=options, epoch=epoch
        )
        self._endpoint = f"local://{uuid.uuid4().hex}"
        with _RECEIVERS_LOCK:
            _RECEIVERS[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # -- called by LocalSender (same process) ---------------------------------------------

    def bind(self, ticket: Ticket, sender: LocalSender) -> TransferRecord:
        """Start serving `ticket` for `sender`; raises if the ticket is stale or ended."""
        if ticket.epoch != self.epoch:
            raise StaleEpochError(
                f"ticket epoch {ticket.epoch} != receiver epoch {self.epoch} (receiver restarted)"
            )
        record = self._table.get(ticket.request_id)
        if record is None:
            raise UnknownTransferError(f"no open ticket for request {ticket.request_id!r}")
        if not self._table.bind(record, sender):
            raise record.error or KVTransferError(f"transfer is {record.state.value}")
        return record

    def land_layer(
        self,
        record: TransferRecord,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        src_ids: np.ndarray,
    ) -> None:
        with record.write_lock:
            if record.state.is_terminal:
                return
            dst = (self.kv_cache.key_caches[layer], self.kv_cache.value_caches[layer])
            dst_ids = np.asarray(record.block_ids, dtype=np.int64)
            copy_layer_blocks((k, v), dst, src_ids, dst_ids, record.cache)
        self._table.mark_layer(record, layer)

    def complete(self, record: TransferRecord) -> TransferState:
        if not self._all_layers_landed(record):
            self._table.finish(
                record.request_id, TransferState.FAILED, self._missing_layers_error(record)
            )
        else:
            self._table.finish(record.request_id, TransferState.DONE)
        return record.state

    def end_from_sender(
        self, request_id: str, state: TransferState, error: KVTransferError
    ) -> None:
        self._table.finish(request_id, state, error)

    # -- ending from this side -------------------------------------------------------------

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        if self._table.finish(request_id, state, error):
            record = self._table.get(request_id)
            if record is not None and isinstance(record.peer, LocalSender):
                record.peer.end_from_receiver(request_id, state, error)

    def _shutdown(self) -> None:
        with _RECEIVERS_LOCK:
            _RECEIVERS.pop(self._endpoint, None)


class LocalSender(TableSender):
    """In-process sender: each call completes synchronously."""

    backend = "local"

    def _receiver(self, ticket: Ticket) -> LocalReceiver:
        with _RECEIVERS_LOCK:
            receiver = _RECEIVERS.get(ticket.endpoint)
        if receiver is None or receiver._closed:
            raise PeerLostError(f"no local receiver at {ticket.endpoint}")
        self.layout.check_matches(receiver.layout, "sender", "receiver")
        return receiver

    def _bind_now(self, record: TransferRecord, ticket: Ticket, timeout_s: float) -> None:
        """Called by `connect`: bind the transfer at the receiver now (nothing to wait for)."""
        self._bind(record, ticket)

    def _bind(self, record: TransferRecord, ticket: Ticket) -> tuple[LocalReceiver, TransferRecord]:
        """The receiver and its record for this transfer, binding them on first use."""
        receiver = self._receiver(ticket)
        remote = record.cache.get("remote")
        if not isinstance(remote, TransferRecord):
            remote = record.cache["remote"] = receiver.bind(ticket, self)
            self._table.bind(record, receiver)
        return receiver, remote

    def _send_layer(self, record: TransferRecord, item: LayerItem) -> None:
        """Called by `send_layer`: copy the layer into the receiver's cache before returning."""
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        try:
            receiver, remote = self._bind(record, item.ticket)
            with record.write_lock:
                if record.state.is_terminal:
                    return
                receiver.land_layer(remote, item.layer, item.k_cache, item.v_cache, item.src_ids)
            self._table.mark_layer(record, item.layer)
        except KVTransferError as exc:
            self._terminate(item.ticket.request_id, TransferState.FAILED, exc)

    def finish(self, ticket: Ticket) -> None:
        record = self._record(ticket)
        if record is None:
            return
        remote = record.cache.get("remote")
        receiver = record.peer
        if not isinstance(remote, TransferRecord) or not isinstance(receiver, LocalReceiver):
            self._terminate(
                ticket.request_id, TransferState.FAILED, KVTransferError("finish before any layer")
            )
            return
        state = receiver.complete(remote)
        self._table.finish(ticket.request_id, state, remote.error)

    def end_from_receiver(
        self, request_id: str, state: TransferState, error: KVTransferError
    ) -> None:
        record = self._table.get(request_id)
        if record is not None:
            with record.write_lock:
                self._table.finish(request_id, state, error)

    def _notify_peer(
        self, record: TransferRecord, state: TransferState, error: KVTransferError
    ) -> None:
        receiver, remote = record.peer, record.cache.get("remote")
        if isinstance(receiver, LocalReceiver) and isinstance(remote, TransferRecord):
            receiver.end_from_sender(remote.request_id, state, error)
            return
        ticket = record.ticket
        if receiver is None and state is TransferState.ABORTED and ticket is not None:
            with _RECEIVERS_LOCK:  # aborted before the first layer: still tell the receiver
                target = _RECEIVERS.get(ticket.endpoint)
            if target is not None and target.epoch == ticket.epoch:
                target.end_from_sender(ticket.request_id, state, error)
