"""A minimal ctypes binding to NCCL: unique ids, communicators, grouped point-to-point.

One NCCL, torch's (its CUDA build depends on the `nvidia-nccl-cu12`/`-cu13` wheel and maps
it when imported; pdserve pins none). `libnccl.so.2` is searched: already mapped into this
process by torch (`/proc/self/maps`), next to torch (`torch/lib`), then the system loader.
Importing needs neither CUDA nor NCCL; `load_nccl()` raises `BackendUnavailableError` naming
every place it looked and what to install.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from kvtransfer.base import BackendUnavailableError, KVTransferError

UNIQUE_ID_BYTES = 128
LIBRARY_NAME = "libnccl.so.2"
MAPS = "/proc/self/maps"  # where a process lists the libraries it mapped (torch's NCCL)
NCCL_UINT8 = 1  # ncclDataType_t of the raw bytes we move


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class NcclError(KVTransferError):
    """An NCCL call returned an error code."""


def loaded_libraries(maps: str) -> list[str]:
    """Paths of the NCCL libraries mapped into a process, from its `/proc/<pid>/maps` text."""
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so") and path not in found:
            found.append(path)
    return found


def candidate_paths(maps: str | None = None, torch_lib_dir: str | None = None) -> Iterator[str]:
    """Where `libnccl.so.2` may be, in the order of the module docstring: files that exist
    (each once), then the bare name for the system loader. The arguments default to this
    process's maps and torch's `lib` directory."""
    if maps is None:
        maps = Path(MAPS).read_text(errors="replace") if os.path.exists(MAPS) else ""
    if torch_lib_dir is None:
        torch_lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = loaded_libraries(maps)
    found += sorted(glob.glob(os.path.join(torch_lib_dir, "libnccl.so*"))) if torch_lib_dir else []
    seen: set[str] = set()
    for path in found:
        if (real := os.path.realpath(path)) not in seen:
            seen.add(real)
            yield path
    yield LIBRARY_NAME  # the system loader's search path (LD_LIBRARY_PATH, ldconfig)


class NcclLibrary:
    """Typed wrappers over the NCCL C API functions pdserve uses; each raises NcclError."""

    def __init__(self, path: str) -> None:
        self.path, lib = path, ctypes.CDLL(path)
        c_int, ptr, size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        p2p: tuple[list[object], object] = ([ptr, size, c_int, c_int, ptr, ptr], c_int)
        signatures: dict[str, tuple[list[object], object]] = {
            "ncclGetVersion": ([ctypes.POINTER(c_int)], c_int),
            "ncclGetUniqueId": ([ctypes.POINTER(NcclUniqueId)], c_int),
            "ncclCommInitRank": ([ctypes.POINTER(ptr), c_int, NcclUniqueId, c_int], c_int),
            "ncclCommAbort": ([ptr], c_int),
            "ncclSend": p2p,
            "ncclRecv": p2p,
            "ncclGroupStart": ([], c_int),
            "ncclGroupEnd": ([], c_int),
            "ncclGetErrorString": ([c_int], ctypes.c_char_p),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

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
        return bytes(bytearray(uid.internal))

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Join a communicator; blocks until all `nranks` ranks joined. Returns the handle."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid, comm = NcclUniqueId(), ctypes.c_void_p()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
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

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")


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
        "NCCL not found: it comes with a CUDA build of torch (which depends on "
        "nvidia-nccl-cu12 or -cu13); install that torch, not a separate NCCL. Tried: "
        + "; ".join(tried)
    )
