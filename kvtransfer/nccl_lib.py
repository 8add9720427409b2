"""A minimal ctypes binding to NCCL: unique ids, communicators, grouped point-to-point.

`libnccl.so.2` is searched, in order, in the `nvidia-nccl-cu12` wheel (`nvidia/nccl/lib`),
in torch's bundled `torch/lib`, then by the system loader. Importing this module needs
neither CUDA nor NCCL; `load_nccl()` raises `BackendUnavailableError` naming every place
it looked.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import glob
import importlib.util
import os
from collections.abc import Iterator

from kvtransfer.base import BackendUnavailableError, KVTransferError

UNIQUE_ID_BYTES = 128
LIBRARY_NAME = "libnccl.so.2"


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class NcclDataType(enum.IntEnum):
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


class NcclError(KVTransferError):
    """An NCCL call returned an error code."""


def candidate_paths() -> Iterator[str]:
    """Where `libnccl.so.2` may be, most specific first (files that exist, then bare name)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        yield from sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.origin:
        torch_lib = os.path.join(os.path.dirname(torch_spec.origin), "lib")
        yield from sorted(glob.glob(os.path.join(torch_lib, "libnccl.so*")))
    yield LIBRARY_NAME  # the system loader's search path (LD_LIBRARY_PATH, ldconfig)


class NcclLibrary:
    """Typed wrappers over the NCCL C API functions pdserve uses."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        signatures: dict[str, tuple[list[object], object]] = {
            "ncclGetVersion": ([ctypes.POINTER(c_int)], c_int),
            "ncclGetUniqueId": ([ctypes.POINTER(NcclUniqueId)], c_int),
            "ncclCommInitRank": ([ctypes.POINTER(c_void_p), c_int, NcclUniqueId, c_int], c_int),
            "ncclCommDestroy": ([c_void_p], c_int),
            "ncclCommAbort": ([c_void_p], c_int),
            "ncclSend": ([c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p], c_int),
            "ncclRecv": ([c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p], c_int),
            "ncclGroupStart": ([], c_int),
            "ncclGroupEnd": ([], c_int),
            "ncclGetErrorString": ([c_int], ctypes.c_char_p),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            message = self._lib.ncclGetErrorString(result)
            text = message.decode() if message else "unknown error"
            raise NcclError(f"{what} failed with NCCL error {result}: {text}")

    def version(self) -> int:
        out = ctypes.c_int()
        self._check(self._lib.ncclGetVersion(ctypes.byref(out)), "ncclGetVersion")
        return out.value

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Join a communicator; blocks until all `nranks` ranks joined. Returns the handle."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(
            self._lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank), "ncclCommInitRank"
        )
        assert comm.value is not None
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._check(self._lib.ncclCommDestroy(ctypes.c_void_p(comm)), "ncclCommDestroy")

    def comm_abort(self, comm: int) -> None:
        """Tear a communicator down even with operations stuck on a dead peer."""
        self._check(self._lib.ncclCommAbort(ctypes.c_void_p(comm)), "ncclCommAbort")

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._check(
            self._lib.ncclSend(ptr, nbytes, NcclDataType.UINT8, peer, comm, stream), "ncclSend"
        )

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._check(
            self._lib.ncclRecv(ptr, nbytes, NcclDataType.UINT8, peer, comm, stream), "ncclRecv"
        )

    def group_start(self) -> None:
        self._check(self._lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        self._check(self._lib.ncclGroupEnd(), "ncclGroupEnd")


@functools.lru_cache(maxsize=1)
def load_nccl() -> NcclLibrary:
    """The first loadable NCCL among `candidate_paths()`; BackendUnavailableError if none."""
    tried: list[str] = []
    for path in candidate_paths():
        try:
            return NcclLibrary(path)
        except OSError as exc:
            tried.append(f"{path} ({exc})")
    raise BackendUnavailableError(
        "NCCL not found; install nvidia-nccl-cu12 (pip install 'pdserve[gpu]'). Tried: "
        + "; ".join(tried)
    )
