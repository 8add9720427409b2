"""`tcp`: transfer across hosts; each layer is one LAYER frame on the control connection.

The payload (`payload`: K rows in ticket order, then V rows, optional CRC32) is gathered
from the source cache by `sendmsg` and scattered into the destination blocks by
`recvmsg_into` under the record's write_lock, with no user-space copy. A receiver binds a
configured host and advertises the address senders reach (on a cluster, the node's IP);
a sender may pick the local address its connections leave from.
"""

from __future__ import annotations

import ipaddress
import socket

from engine.kv_cache import KVCache
from kvtransfer.datapath import Landing, LayerItem, Writing
from kvtransfer.payload import cache_rows, check_crc, crc32, layer_views, record_runs
from kvtransfer.rowcopy import block_rows
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header


def parse_endpoint(endpoint: str, scheme: str = "tcp") -> tuple[str, int]:
    """`"tcp://host:port"` -> `(host, port)`."""
    if not endpoint.startswith(f"{scheme}://"):
        raise ValueError(f"not a {scheme} endpoint: {endpoint!r}")
    host, _, port = endpoint.removeprefix(f"{scheme}://").rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or "localhost"."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(
    host: str, port: int, advertise_host: str | None, scheme: str
) -> tuple[socket.socket, str]:
    """Called by the tcp and nccl landings: a listener on `host:port` (port 0: any free one;
    SO_REUSEADDR, so a restart can rebind) and the endpoint tickets name: `advertise_host`
    (else `host`, which must then be a specific address) and the port bound."""
    advertised = advertise_host or host
    if advertised in ("", "0.0.0.0", "::"):
        raise ValueError(f"a receiver bound to {host!r} needs an advertise_host senders can reach")
    ipv6 = ":" in host  # then dual-stack, as a plain IPv6 socket is on Linux
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=64, dualstack_ipv6=ipv6)
    address = f"[{advertised}]" if ":" in advertised else advertised
    return listener, f"{scheme}://{address}:{listener.getsockname()[1]}"


class TcpLanding(Landing):
    """Receiving data path: listens on `host:port`, scatters LAYER payloads into the cache."""

    backend = "tcp"

    def __init__(
        self, kv_cache: KVCache, host: str, port: int = 0, advertise_host: str | None = None
    ) -> None:
        self.kv_cache, self._rows = kv_cache, cache_rows(kv_cache)
        self.listener, self.endpoint = listen(host, port, advertise_host, "tcp")

    def payload_bytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.kv_cache.spec.bytes_per_block_per_layer

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        rows, runs = self._rows[header.layer], record_runs(record.cache, record.block_ids)
        views = layer_views(rows[0], rows[1], runs)
        with record.write_lock:
            if record.state.is_terminal:
                return conn.fs.discard(header.nbytes)
            conn.fs.recv_into(*views)
            if header.has_crc:
                check_crc(header.crc, views, f"layer {header.layer} of {record.request_id!r}")


class TcpWriting(Writing):
    """Sending data path: each layer goes as one LAYER frame gathered from the cache, on
    connections that leave from `host` when set (a multi-homed node)."""

    backend = "tcp"

    def __init__(self, host: str | None = None) -> None:
        self.host = host

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        source = None if self.host is None else (self.host, 0)
        return socket.create_connection(parse_endpoint(endpoint), timeout_s, source)

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        for item in items:
            if record.state.is_terminal:
                return
            parts = self.payload(record, item)
            conn.send_layer(item.ticket, item.layer, crc32(parts) if checksum else None, parts)

    def payload(self, record: TransferRecord, item: LayerItem) -> list[memoryview]:
        """The layer's LAYER payload as views into the source cache (no copy)."""
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        runs = record_runs(record.cache, item.src_ids)
        return layer_views(block_rows(item.k_cache), block_rows(item.v_cache), runs)
