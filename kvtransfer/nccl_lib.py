"""A minimal ctypes binding to NCCL: unique ids, communicators, grouped point-to-point.

One NCCL, torch's: its CUDA build depends on the `nvidia-nccl-cu12`/`-cu13` wheel and loads
it on import (pdserve pins none). `load_nccl` takes the `libnccl.so.2` already loaded in
this process (glibc finds a loaded library by its soname, wherever it lies), else one in
`torch/lib`, else the system loader's. Importing needs neither CUDA nor NCCL.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
from collections.abc import Iterator

import torch

from kvtransfer.base import BackendUnavailableError, KVTransferError

UNIQUE_ID_BYTES = 128
LIBRARY_NAME = "libnccl.so.2"
TORCH_LIB_DIR = os.path.join(os.path.dirname(torch.__file__), "lib")
NCCL_UINT8 = 1  # ncclDataType_t of the raw bytes we move


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class NcclError(KVTransferError):
    """An NCCL call returned an error code."""


def candidates() -> list[tuple[str, int]]:
    """Where `load_nccl` looks, in order, as (name or path, dlopen mode): the NCCL this
    process loaded, each file in torch's `lib`, the system loader's search path."""
    found = glob.glob(os.path.join(TORCH_LIB_DIR, "libnccl.so*"))
    files = [(path, ctypes.DEFAULT_MODE) for path in sorted(set(map(os.path.realpath, found)))]
    return [(LIBRARY_NAME, os.RTLD_NOLOAD), *files, (LIBRARY_NAME, ctypes.DEFAULT_MODE)]


class NcclLibrary:
    """Typed wrappers over the NCCL C API functions pdserve uses; each raises NcclError."""

    def __init__(self, path: str, mode: int = ctypes.DEFAULT_MODE) -> None:
        self.path, self._lib = path, ctypes.CDLL(path, mode)
        c_int, ptr = ctypes.c_int, ctypes.c_void_p
        p2p = (ptr, ctypes.c_size_t, c_int, c_int, ptr, ptr)  # buf, count, type, peer, comm, stream
        for name, restype, *argtypes in (
            ("ncclGetVersion", c_int, ctypes.POINTER(c_int)),
            ("ncclGetUniqueId", c_int, ctypes.POINTER(NcclUniqueId)),
            ("ncclCommInitRank", c_int, ctypes.POINTER(ptr), c_int, NcclUniqueId, c_int),
            ("ncclCommAbort", c_int, ptr),
            ("ncclSend", c_int, *p2p),
            ("ncclRecv", c_int, *p2p),
            ("ncclGroupStart", c_int),
            ("ncclGroupEnd", c_int),
            ("ncclGetErrorString", ctypes.c_char_p, c_int),
        ):
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    def _call(self, name: str, *args: object) -> None:
        if (result := getattr(self._lib, name)(*args)) != 0:
            message = self._lib.ncclGetErrorString(result)
            text = message.decode() if message else "unknown error"
            raise NcclError(f"{name} failed with NCCL error {result}: {text}")

    def version(self) -> int:
        out = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(out))
        return out.value

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Join a communicator; blocks until all `nranks` ranks joined. Returns the handle."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid, comm = NcclUniqueId.from_buffer_copy(unique_id), ctypes.c_void_p()
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        assert comm.value is not None
        return comm.value

    def comm_abort(self, comm: int) -> None:
        """Tear a communicator down even with operations stuck on a dead peer."""
        self._call("ncclCommAbort", ctypes.c_void_p(comm))

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclSend", ptr, nbytes, NCCL_UINT8, peer, comm, stream)

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclRecv", ptr, nbytes, NCCL_UINT8, peer, comm, stream)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The sends and receives posted inside run as one group; the group ends even when
        one of them fails (an open group would swallow every later call)."""
        self._call("ncclGroupStart")
        try:
            yield
        finally:
            self._call("ncclGroupEnd")


@functools.lru_cache(maxsize=1)
def load_nccl() -> NcclLibrary:
    """The first loadable NCCL among `candidates()`; BackendUnavailableError naming each
    place tried if none."""
    tried: list[str] = []
    for path, mode in candidates():
        try:
            return NcclLibrary(path, mode)
        except OSError as exc:
            where = f"{path} among loaded libraries" if mode == os.RTLD_NOLOAD else path
            tried.append(f"{where} ({exc})")
    raise BackendUnavailableError(
        "NCCL not found: it comes with a CUDA build of torch (which depends on "
        "nvidia-nccl-cu12 or -cu13); install that torch, not a separate NCCL. Tried: "
        + "; ".join(tried)
    )
