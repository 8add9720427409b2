"""The state each end keeps for one control connection, and the sender's queued items.

`SenderConnection` is the receiver's end of a sender's connection; `ReceiverConnection`
the sender's end of a receiver's. Both wrap a `FrameSocket` and carry per-backend state
(the shm mapping, the NCCL communicator's staging buffer).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.base import Ticket
from kvtransfer.wire import FrameSocket


class SenderConnection:
    """The receiver's end of one sender's connection."""

    def __init__(self, fs: FrameSocket, name: str) -> None:
        self.fs = fs
        self.name = name
        self.alive = True
        self.authenticated = False  # handshake completed (with the secret's proof, if any)
        self.last_frame_at = time.monotonic()  # idle connections are closed after a while
        self.thread: threading.Thread | None = None
        self.state: dict[str, object] = {}  # backend per-connection state (communicator)


class ReceiverConnection:
    """The sender's end of one receiver's connection."""

    def __init__(self, fs: FrameSocket, endpoint: str, welcome: dict[str, object]) -> None:
        self.fs = fs
        self.endpoint = endpoint
        self.epoch = int(str(welcome["epoch"]))
        self.num_blocks = int(str(welcome["num_blocks"]))
        self.welcome = welcome
        self.alive = True
        self.pending: dict[str, Future[None]] = {}
        self.last_used = time.monotonic()  # the sender drops connections idle too long
        self.state: dict[str, object] = {}  # backend per-connection state (mapping, comm)
        self.thread: threading.Thread | None = None


FINISH_ITEM, ABORT_ITEM = -1, -2


@dataclass(slots=True)
class LayerItem:
    """One unit of the sender's queue, in the order the prefill produced it."""

    ticket: Ticket
    layer: int  # >= 0: a layer; FINISH_ITEM; ABORT_ITEM: tell the receiver we aborted
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    src_ids: np.ndarray | None = None
    ready: object | None = None  # backend: e.g. a CUDA event recorded after the layer
