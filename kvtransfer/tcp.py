"""`tcp`: transfer across hosts; each layer travels as one frame on the control connection.

Frame payload of a LAYER: `[2 (K, V), num_blocks, bytes_per_block]`, K rows in the ticket's
block order then V rows, with an optional CRC32 of exactly those bytes. Layers stream back
to back without acknowledgement (many in flight; the kernel's socket buffers and the
receiver's thread pace them). Neither end copies in user space: the sender gathers the
source rows with `sendmsg` (one buffer per run of consecutive blocks), the receiver
scatters the payload with `recvmsg_into` straight into the destination blocks. It does so
holding the record's write_lock, and an ended transfer's blocks stay fenced until the
sender's ABORT_ACK is read after any frame in flight (see `receiver`).

Addresses: a receiver binds a configured host and names in its tickets the address senders
reach it at (`advertise_host`: on a cluster, the node's IP); a sender may pick the local
address its connections leave from.
"""

from __future__ import annotations

import ipaddress
import socket
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_cache import KVCache
from kvtransfer.base import ChecksumMismatchError
from kvtransfer.blockcopy import block_rows, cache_rows, contiguous_runs
from kvtransfer.sender import LayerItem
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header, Kind


def parse_endpoint(endpoint: str, scheme: str = "tcp") -> tuple[str, int]:
    """`"tcp://host:port"` -> `(host, port)`."""
    prefix = f"{scheme}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {scheme} endpoint: {endpoint!r}")
    host, _, port = endpoint.removeprefix(prefix).rpartition(":")
    return host.strip("[]"), int(port)


def connect(
    endpoint: str, timeout_s: float, source_host: str | None, scheme: str = "tcp"
) -> socket.socket:
    """A TCP connection to `endpoint`, leaving from `source_host` when given."""
    source = None if source_host is None else (source_host, 0)
    return socket.create_connection(parse_endpoint(endpoint, scheme), timeout_s, source)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_advertised(
    host: str, port: int, advertise_host: str | None, scheme: str
) -> tuple[socket.socket, str]:
    """Called by the tcp and nccl landings: a listener bound to `host:port` (port 0: any
    free port) and the endpoint tickets name: `advertise_host` (else `host`, which must
    then be a specific address) and the port actually bound."""
    advertised = advertise_host or host
    if advertised in WILDCARD_HOSTS:
        raise ValueError(f"a receiver bound to {host!r} needs an advertise_host senders can reach")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart can rebind
        listener.bind((host, port))
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    bound = listener.getsockname()[1]
    address = f"[{advertised}]" if ":" in advertised else advertised
    return listener, f"{scheme}://{address}:{bound}"


class TcpLanding:
    """Receiving data path: listens on `host:port`, scatters LAYER payloads into the cache."""

    backend = "tcp"
    remote_writer = False  # this process lands every byte

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        scheme: str = "tcp",
    ) -> None:
        self.kv_cache = kv_cache
        self.listener, self.endpoint = listen_advertised(host, port, advertise_host, scheme)
        self._rows = cache_rows(kv_cache)

    def welcome(self, conn: Connection) -> dict[str, object]:
        return {}

    def connected(self, conn: Connection) -> None:
        pass

    def payload_bytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.kv_cache.spec.bytes_per_block_per_layer

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        runs = record.cache.get("runs")
        if not isinstance(runs, list):
            runs = record.cache["runs"] = _id_runs(record.block_ids)
        layer = header.layer
        with record.write_lock:
            if record.state.is_terminal:
                conn.fs.discard(header.nbytes)
                return
            views = _layer_views(self._rows[layer, 0], self._rows[layer, 1], runs)
            conn.fs.recv_views(views)
            if header.has_crc:
                crc = _crc(views)
                if crc != header.crc:
                    raise ChecksumMismatchError(
                        f"layer {layer} of {record.request_id!r}: payload crc32 {crc:#010x}, "
                        f"sender computed {header.crc:#010x}"
                    )

    def skip(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        conn.fs.discard(header.nbytes)

    def fence(self) -> None:
        pass  # landing is synchronous, under the record's write_lock

    def writer_running(self, conn: Connection) -> bool:
        return False

    def disconnected(self, conn: Connection) -> None:
        pass

    def close(self) -> None:
        pass


class TcpWriting:
    """Sending data path: each layer goes as one LAYER frame, gathered from the cache.

    `host`, when set, is the local address connections leave from (a multi-homed node).
    """

    backend = "tcp"

    def __init__(self, host: str | None = None) -> None:
        self.host = host

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        return connect(endpoint, timeout_s, self.host)

    def welcome(self, conn: Connection) -> None:
        pass

    def ready(self, k_cache: torch.Tensor) -> object | None:
        return None

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        for item in items:
            assert item.k_cache is not None and item.v_cache is not None
            parts = self.payload(record, item)
            if record.state.is_terminal:
                return
            conn.fs.send(
                Kind.LAYER,
                record.request_id,
                epoch=item.ticket.epoch,
                layer=item.layer,
                crc=_crc(parts) if checksum else None,
                payload=parts,
            )

    def payload(self, record: TransferRecord, item: LayerItem) -> list[memoryview]:
        """The layer's LAYER payload as views into the source cache (no copy)."""
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        runs = record.cache.get("runs")
        if not isinstance(runs, list):
            runs = record.cache["runs"] = _id_runs(item.src_ids)
        return _layer_views(block_rows(item.k_cache), block_rows(item.v_cache), runs)

    def disconnected(self, conn: Connection) -> None:
        pass


def _id_runs(block_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive block ids as `(first id, length)`, in order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return [(int(ids[i]), k) for i, k in contiguous_runs(ids)]


def _layer_views(
    k_rows: np.ndarray, v_rows: np.ndarray, runs: list[tuple[int, int]]
) -> list[memoryview]:
    """A layer's payload in wire order: the K views of `_run_views`, then the V views."""
    return _run_views(k_rows, runs) + _run_views(v_rows, runs)


def _run_views(rows: np.ndarray, runs: list[tuple[int, int]]) -> list[memoryview]:
    """One flat byte view per run of rows of a `[blocks, bytes]` matrix (no copies)."""
    flat, row_bytes = rows.reshape(-1).data, rows.shape[1]
    return [flat[start * row_bytes : (start + k) * row_bytes] for start, k in runs]


def _crc(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc
