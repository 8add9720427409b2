"""The KV-transfer vocabulary both ends share: states, errors, layout, ticket, options.

A transfer's lifecycle (one per request; `Receiver` on decode, `Sender` on prefill):

    decode: open_ticket ──▶ PENDING ──first layer accepted──▶ TRANSFERRING ──finish──▶ DONE
    prefill:                 send_layer(0) … send_layer(L-1), finish
    any state ──abort (either side)──▶ ABORTED     ──deadline passed──▶ EXPIRED
              ──peer lost / checksum / protocol error──▶ FAILED

Every transfer ends in exactly one terminal state. The receiver calls its `release` once for
every terminal state but DONE (the blocks then hold the KV and stay with the decode request);
the sender calls its `release` once in every terminal state (the source blocks are unread).
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from engine.kv_cache import KVCacheSpec

# The cache layout both ends assume, `[layers, 2 (K, V), blocks, slots, kv_heads, head_dim]`:
# bump when engine/kv_cache.py changes it.
KV_MEMORY_LAYOUT = "layer.kv.block.slot.head.dim/v1"

ReleaseFn = Callable[[str], None]
BlockIds = Sequence[int] | torch.Tensor | np.ndarray


class TransferState(enum.Enum):
    PENDING = "pending"  # ticket open, no sender has started
    TRANSFERRING = "transferring"  # a sender is writing layers
    DONE = "done"  # all layers landed; the destination blocks hold the KV
    FAILED = "failed"  # peer lost, checksum mismatch, refused or protocol error
    ABORTED = "aborted"  # either side called abort()
    EXPIRED = "expired"  # the ticket's deadline passed first

    @property
    def is_terminal(self) -> bool:
        return self not in (TransferState.PENDING, TransferState.TRANSFERRING)

    @property
    def code(self) -> int:
        """Small integer for the wire."""
        return list(TransferState).index(self)

    @classmethod
    def from_code(cls, code: int) -> TransferState:
        """Inverse of `code`; a code no state has (a broken peer) is a `ProtocolError`."""
        if not 0 <= code < len(cls):
            raise ProtocolError(f"unknown transfer state code {code}")
        return list(cls)[code]


class KVTransferError(RuntimeError):
    """Base of every transfer failure (each becomes a transfer's `error()`)."""


class KVLayoutMismatchError(KVTransferError):
    """The two ends disagree on model, dtype, block size or cache layout."""

    def __init__(
        self,
        differences: dict[str, tuple[object, object]],
        ours: str = "local",
        theirs: str = "remote",
    ) -> None:
        self.differences, self.labels = dict(differences), (ours, theirs)
        listed = "; ".join(f"{k}: {ours}={a!r} {theirs}={b!r}" for k, (a, b) in differences.items())
        super().__init__(f"KV layout mismatch between {ours} and {theirs}: {listed}")


class StaleEpochError(KVTransferError):
    """The ticket was issued by an earlier incarnation of the receiver (it restarted)."""


class ChecksumMismatchError(KVTransferError):
    """A layer's payload does not match the checksum its sender computed."""


class TransferAbortedError(KVTransferError):
    """One side called abort()."""


class TransferExpiredError(KVTransferError):
    """The ticket's deadline passed before the transfer completed."""


class PeerLostError(KVTransferError):
    """The connection to the other side closed or failed mid-transfer."""


class PeerTimeoutError(PeerLostError):
    """The peer did not answer within the time allowed (a handshake)."""


class ProtocolError(PeerLostError):
    """The peer broke the protocol (oversized or malformed frame): its connection is closed."""


class AuthenticationError(KVTransferError):
    """The peer could not prove it holds the application's shared secret (or we could not)."""


class BackendUnavailableError(KVTransferError):
    """The backend cannot run on this machine (e.g. `nccl` without CUDA)."""


class UnknownTransferError(KVTransferError):
    """No transfer with this request id is known (never opened, or long forgotten)."""


# Errors cross the wire by name (an unknown name arrives as a KVTransferError);
# KVLayoutMismatchError travels with its differences.
_WIRE_ERRORS = {c.__name__: c for c in KVTransferError.__subclasses__()}
_WIRE_ERRORS |= {c.__name__: c for c in (KVTransferError, PeerTimeoutError, ProtocolError)}
del _WIRE_ERRORS["KVLayoutMismatchError"]


def error_to_wire(error: KVTransferError) -> dict[str, object]:
    """JSON-able form of an error, for the control channel."""
    wire: dict[str, object] = {"error": type(error).__name__, "message": str(error)}
    if isinstance(error, KVLayoutMismatchError):
        wire |= {"differences": error.differences, "labels": error.labels}
    return wire


def error_from_wire(obj: dict[str, object], context: str) -> KVTransferError:
    """Inverse of `error_to_wire`; `context` says who reported it (e.g. "receiver")."""
    name, diffs, labels = obj.get("error"), obj.get("differences"), obj.get("labels")
    if name == "KVLayoutMismatchError" and isinstance(diffs, dict):
        ours, theirs = (
            labels if isinstance(labels, list | tuple) and len(labels) == 2 else ("?", "?")
        )
        pairs = {str(k): tuple(v) for k, v in diffs.items() if isinstance(v, list | tuple)}
        return KVLayoutMismatchError(pairs, str(ours), str(theirs))  # type: ignore[arg-type]
    return _WIRE_ERRORS.get(str(name), KVTransferError)(f"{context}: {obj.get('message', name)}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What both ends must agree on for blocks to be byte-compatible, except
    `tensor_parallel_size`: a sender re-shards KV heads into a receiver of another TP size
    (`kvtransfer.reshard`). The geometry is the model's (`num_layers` layers of
    `num_kv_heads` heads); a replica of TP size N holds `num_items` = layers x N items, each
    `head_slots` heads wide (rank r's heads of layer l in item l x N + r, `engine.parallel`)."""

    model_id: str  # model name or fingerprint (weights + config)
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    memory_layout: str = KV_MEMORY_LAYOUT
    tensor_parallel_size: int = 1

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str) -> KVLayout:
        geometry = (spec.block_size, spec.num_model_layers, spec.num_model_kv_heads, spec.head_dim)
        return cls(model_id, spec.dtype, *geometry, tensor_parallel_size=spec.tensor_parallel_size)

    @property
    def num_items(self) -> int:
        """Per-(layer, rank) items of the cache: what LAYER frames number."""
        return self.num_layers * self.tensor_parallel_size

    @property
    def head_slots(self) -> int:
        """KV heads each item has room for (the widest rank's share)."""
        return -(-self.num_kv_heads // self.tensor_parallel_size)

    def cache_spec(self, num_blocks: int) -> KVCacheSpec:
        """The geometry of a cache of `num_blocks` blocks in this layout (a replica's whole
        cache: `num_items` items of `head_slots` heads), for its shapes and byte counts."""
        return KVCacheSpec(
            self.num_items,
            num_blocks,
            self.block_size,
            self.head_slots,
            self.head_dim,
            self.dtype,
            self.tensor_parallel_size,
            self.num_kv_heads,
        )

    def differences(
        self, other: KVLayout, bridged: tuple[str, ...] = ("tensor_parallel_size",)
    ) -> dict[str, tuple[object, object]]:
        """Fields that differ, as `{field: (self's value, other's value)}`, except the
        `bridged` ones (by default the TP size, which a sender re-shards)."""
        pairs = ((f.name, getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        return {name: (a, b) for name, a, b in pairs if a != b and name not in bridged}

    def check_matches(self, other: KVLayout, ours: str = "local", theirs: str = "remote") -> None:
        """Raise `KVLayoutMismatchError` listing every differing field."""
        if diffs := self.differences(other):
            raise KVLayoutMismatchError(diffs, ours, theirs)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: object) -> KVLayout:
        """Inverse of `to_dict` (unknown keys ignored); ProtocolError if malformed (a peer's
        handshake)."""
        given = obj if isinstance(obj, dict) else {}
        try:
            layout = cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
        except TypeError:
            raise ProtocolError("malformed layout in the handshake") from None
        size, heads = layout.tensor_parallel_size, layout.num_kv_heads
        if not (isinstance(size, int) and isinstance(heads, int) and 1 <= size <= heads):
            raise ProtocolError(f"malformed layout: tensor_parallel_size {size!r}, {heads!r} heads")
        return layout


@dataclass(frozen=True, slots=True)
class Ticket:
    """Where and how the prefill side must write one request's KV. Small and picklable.

    The deadline travels as a duration, never as a wall-clock instant two hosts would have
    to agree on: each process that unpickles a ticket starts its own monotonic countdown
    from the seconds that were left when it was pickled.

    Prefix reuse: the receiver may already hold the KV of the prompt's first
    `num_cached_blocks` blocks (its prefix cache; those blocks are pinned by the decode
    request, never written by the transfer). `block_ids` are the destinations of the blocks
    after them: the sender sends the prompt's blocks `num_cached_blocks ..
    num_cached_blocks + num_blocks - 1`, whatever its own prefix cache held.

    Per-rank endpoints (`kvtransfer.ranks`): a tensor-parallel receiver of N ranks, each
    landing its own shard, names ranks 1..N-1 in `ranks` as (endpoint, epoch); `endpoint`
    and `epoch` are rank 0's. Rank i of the sender writes rank i's shard there.
    """

    request_id: str
    endpoint: str  # backend-specific address of the receiver, e.g. "tcp://10.0.0.3:41234"
    block_ids: tuple[int, ...]  # destination blocks, in token order
    layout: KVLayout
    epoch: int  # the receiver's incarnation; fences tickets from before a restart
    deadline_s: float = field(compare=False)  # seconds the transfer may take, from issue
    num_cached_blocks: int = 0  # the prompt's leading blocks the receiver holds already
    ranks: tuple[tuple[str, int], ...] = ()  # per-rank receivers 1..N-1: (endpoint, epoch)
    expires_at: float = field(init=False, compare=False, repr=False)  # this process: monotonic

    def __post_init__(self) -> None:
        if self.num_cached_blocks < 0:
            raise ValueError(f"num_cached_blocks must be >= 0, got {self.num_cached_blocks}")
        object.__setattr__(self, "expires_at", time.monotonic() + self.deadline_s)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        fields_ = (self.request_id, self.endpoint, self.block_ids, self.layout, self.epoch)
        return (Ticket, (*fields_, self.seconds_left(), self.num_cached_blocks, self.ranks))

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def seconds_left(self) -> float:
        """Seconds until the transfer expires, by this process's monotonic clock."""
        return self.expires_at - time.monotonic()


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """Settings shared by every backend; the defaults suit serving, tests shorten them."""

    checksum: bool = False  # sender: CRC32 of each layer's payload, verified by the receiver
    io_timeout_s: float = 30.0  # a socket send stuck this long fails the connection
    connect_timeout_s: float = 10.0  # connect + handshake (also capped by the ticket deadline)
    fence_timeout_s: float = 5.0  # receiver: wait this long for a remote writer's ABORT_ACK
    reap_interval_s: float = 0.05  # how often deadlines are checked
    tombstone_ttl_s: float = 120.0  # ended transfers stay pollable this long
    # Shared by every replica of one application; both ends of a connection prove they hold
    # it (HMAC challenge-response, `kvtransfer.auth`). None: no authentication (tests, tools).
    secret: str | None = field(default=None, repr=False)
    max_connections: int = 256  # receiver: connections beyond this are closed at once
    handshake_timeout_s: float = 5.0  # receiver: a peer must finish the handshake this fast
    # Receiver: a connection with no transfer bound to it closes after this long without a
    # frame; senders drop their idle connections after half of it (so they never race it).
    idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("TransferOptions.secret must be at least 16 characters")
        for name in ("max_connections", "handshake_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


_last_epoch, _epoch_lock = 0, threading.Lock()


def new_epoch() -> int:
    """A receiver incarnation number: start time (µs) with 12 random low bits; fits 64 bits.
    Strictly increasing within a process; the random bits separate processes."""
    global _last_epoch
    candidate = (((time.time_ns() // 1000) << 12) | secrets.randbits(12)) & (2**64 - 1)
    with _epoch_lock:
        _last_epoch = max(candidate, _last_epoch + 1)
        return _last_epoch
