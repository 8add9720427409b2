"""A backend's data path, in two halves: the `Landing` a `Receiver` holds and the `Writing`
a `Sender` holds. The endpoints run the protocol (handshake, BEGIN/ACCEPT, fences); a data
path only moves bytes: set up on WELCOME, write a layer, land a layer, fence, tear down.
Backends subclass both to inherit the optional steps, which default to nothing.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.kv_cache import KVCache
from kvtransfer.base import Ticket
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header

FINISH_ITEM, ABORT_ITEM = -1, -2


@dataclass(slots=True)
class LayerItem:
    """One unit of the sender's queue, in the order the prefill produced it."""

    ticket: Ticket
    layer: int  # >= 0: a layer; FINISH_ITEM; ABORT_ITEM: tell the receiver we aborted
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    src_ids: np.ndarray | None = None
    ready: object | None = None  # `Writing.ready`'s marker (nccl: a CUDA event)


class Writing(Protocol):
    """A backend's sending data path, held by one `Sender` (which calls every method)."""

    backend: str

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        """A connected socket to the receiver's control endpoint."""
        raise NotImplementedError

    def welcome(self, conn: Connection) -> None:
        """After the receiver's WELCOME was verified: set up the connection's data path."""
        return None

    def settle(self, conn: Connection, timeout_s: float) -> None:
        """Wait until what `welcome` started in the background is done (shm: populating the
        mapping); PeerTimeoutError after `timeout_s`."""
        return None

    def ready(self, k_cache: torch.Tensor) -> object | None:
        """In `send_layer`, on the caller's thread: mark the layer computed (nccl: event)."""
        return None

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Worker thread: move queued layers of one transfer, then send their LAYER frames
        (a CRC32 each with `checksum`); the receiver's blocks are written under
        `record.write_lock`, and only while the record is not terminal."""
        raise NotImplementedError

    def disconnected(self, conn: Connection) -> None:
        """The connection is gone: free its state (shm: unmap; nccl: abort the comm)."""
        return None


class Landing(Protocol):
    """A backend's receiving data path, held by one `Receiver` (which calls every method)."""

    backend: str
    kv_cache: KVCache  # the destination cache
    endpoint: str  # the address tickets name
    listener: socket.socket  # the control socket senders connect to
    remote_writer: bool = False  # another process writes our memory: fences may quarantine

    def welcome(self, conn: Connection) -> dict[str, object]:
        """During the handshake: backend facts for the sender's WELCOME."""
        return {}

    def connected(self, conn: Connection) -> None:
        """After WELCOME was sent, on the connection's thread (nccl: join the communicator)."""
        return None

    def payload_bytes(self, num_blocks: int) -> int:
        """The exact payload size of a LAYER frame for a transfer of `num_blocks` blocks."""
        return 0

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """Consume a LAYER frame's payload (size already checked) and land the layer in the
        record's blocks under its write_lock; raise KVTransferError to fail the transfer."""
        raise NotImplementedError

    def skip(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        """Consume a LAYER frame of a transfer that ended or is not bound here."""
        conn.fs.discard(header.nbytes)

    def fence(self, record: TransferRecord) -> bool:
        """Wait until no write `land` queued for `record` is in flight (before DONE, and
        before its blocks return to the pool); False if the writes ended incomplete."""
        return True

    def writer_running(self, conn: Connection) -> bool:
        """Whether the process writing through `conn` may still write (shm: the sender)."""
        return False

    def disconnected(self, conn: Connection) -> None:
        """The connection is gone: free its state (nccl: abort its communicator)."""
        return None

    def close(self) -> None:
        """At receiver close, after every connection ended: free the cache's resources."""
        return None
