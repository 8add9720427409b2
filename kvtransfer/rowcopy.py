"""Copying rows of byte matrices (KV blocks) between caches on the CPU: few calls, no GIL.

A layer's K (or V) cache `[num_blocks, block_size, kv_heads, head_dim]` is viewed as a numpy
`[num_blocks, bytes_per_block]` uint8 matrix (`block_rows`, any dtype). Two ways to copy
rows `src_ids[i] -> dst_ids[i]`:

- `CopyPlan` (the reference, plain numpy: one memcpy per row or run, GIL released; built
  once per id pair since a transfer's ids are the same for every layer): runs where both
  ids advance by one become slice copies, a contiguous side one fancy-index scatter or
  gather, ids random on both sides go through L2-sized chunks;
- `copy_rows_many` (the optimized kernel): a ~40-line C helper with non-temporal stores
  (AVX-512, SSE2, plain memcpy off x86) that copies several matrices in one call. glibc's
  memcpy streams only copies of tens of MiB; a KV block written for another process is
  not read again by this core, so ordinary stores waste half the bandwidth on
  read-for-ownership. Large transfers use it (`worth_streaming`).

The helper is compiled on first use with the system C compiler into a private directory
(`~/.cache/pdserve`, else `<tmp>/pdserve-<uid>`, mode 0700) with the SHA-256 of the built
library recorded beside it; it is loaded only when the directory and library are ours,
writable by nobody else, and the hash matches. Otherwise (or without a compiler; logged
once) `available()` is False and callers use `CopyPlan`.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

STAGING_BYTES = 256 * 1024  # chunk of the two-sided path: fits in L2 on current CPUs
MIN_MEAN_RUN = 4  # blocks per run below which per-run slice copies lose to fancy indexing
# Below this many bytes per transfer the blocks may still be in the last-level cache when
# decode reads them, and per-call overhead dominates. Measured: 512-token transfers of a
# 135M model (24 MB) copy ~1.7x faster with streaming stores.
STREAMING_MIN_BYTES = 4 * 1024 * 1024


def block_rows(cache: torch.Tensor) -> np.ndarray:
    """`[num_blocks, bytes_per_block]` uint8 view (no copy) of one contiguous CPU layer cache."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        raise ValueError(f"expected a contiguous CPU layer cache, got one on {cache.device}")
    return cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()


def as_id_array(block_ids: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """Block ids as a contiguous 1-D int64 numpy array."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().to("cpu", torch.int64).numpy()
    return np.ascontiguousarray(np.asarray(block_ids, dtype=np.int64).reshape(-1))


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, as `(index of the run's first id, length)`."""
    return [(s, k) for s, _, k in _runs(ids, ids)]


def matched_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where both sides advance by one, as `(src_start_id, dst_start_id, length)`."""
    return [(int(src_ids[s]), int(dst_ids[s]), k) for s, _, k in _runs(src_ids, dst_ids)]


def _runs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int]]:
    """`(start index, end index, length)` of the maximal runs where both advance by one."""
    if len(a) == 0:
        return []
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    bounds = np.concatenate(([0], breaks, [len(a)])).tolist()
    return [(s, e, e - s) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How to copy rows `src_ids[i] -> dst_ids[i]` for every i; see the module docstring."""

    kind: str  # "slices" | "scatter" | "gather" | "staged"
    slices: tuple[tuple[int, int, int], ...] = ()  # (src_start, dst_start, length)
    src_index: tuple[np.ndarray, ...] = ()  # per step: source ids (gather/staged)
    dst_index: tuple[np.ndarray, ...] = ()  # per step: destination ids (scatter/staged)
    src_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    dst_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def build(
        cls,
        src_ids: Sequence[int] | torch.Tensor | np.ndarray,
        dst_ids: Sequence[int] | torch.Tensor | np.ndarray,
        row_bytes: int,
    ) -> CopyPlan:
        src, dst = as_id_array(src_ids), as_id_array(dst_ids)
        if src.shape != dst.shape:
            raise ValueError(f"{len(src)} source ids but {len(dst)} destination ids")
        n, runs = len(src), matched_runs(src, dst)
        slices: tuple[tuple[int, int, int], ...] = ()
        src_index: tuple[np.ndarray, ...] = ()
        dst_index: tuple[np.ndarray, ...] = ()
        if len(runs) * MIN_MEAN_RUN <= n or len(runs) <= 2:
            kind, slices = "slices", tuple(runs)
        elif len(src_runs := contiguous_runs(src)) * MIN_MEAN_RUN <= n:  # scatter each run
            kind, slices = "scatter", tuple((int(src[i]), 0, k) for i, k in src_runs)
            dst_index = tuple(dst[i : i + k] for i, k in src_runs)
        elif len(dst_runs := contiguous_runs(dst)) * MIN_MEAN_RUN <= n:  # gather into each
            kind, slices = "gather", tuple((0, int(dst[i]), k) for i, k in dst_runs)
            src_index = tuple(src[i : i + k] for i, k in dst_runs)
        else:
            kind, step = "staged", max(1, STAGING_BYTES // max(1, row_bytes))
            src_index = tuple(src[i : i + step] for i in range(0, n, step))
            dst_index = tuple(dst[i : i + step] for i in range(0, n, step))
        return cls(kind, slices, src_index, dst_index, src, dst)

    def copy(self, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        """Copy the planned rows from `src_rows` into `dst_rows` (both `[blocks, bytes]`)."""
        if self.kind == "slices":
            for s, d, k in self.slices:
                dst_rows[d : d + k] = src_rows[s : s + k]
        elif self.kind == "scatter":
            for (s, _, k), index in zip(self.slices, self.dst_index, strict=True):
                dst_rows[index] = src_rows[s : s + k]
        elif self.kind == "gather":
            for (_, d, k), index in zip(self.slices, self.src_index, strict=True):
                dst_rows[d : d + k] = src_rows[index]
        else:
            for s_index, d_index in zip(self.src_index, self.dst_index, strict=True):
                dst_rows[d_index] = src_rows[s_index]


_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAGE 4096

__attribute__((target("avx512f")))
static inline void copy256(uint8_t* d, const uint8_t* s) {
    __m512i a = _mm512_loadu_si512((const void*)s);
    __m512i b = _mm512_loadu_si512((const void*)(s + 64));
    __m512i c = _mm512_loadu_si512((const void*)(s + 128));
    __m512i e = _mm512_loadu_si512((const void*)(s + 192));
    _mm512_stream_si512((void*)d, a);
    _mm512_stream_si512((void*)(d + 64), b);
    _mm512_stream_si512((void*)(d + 128), c);
    _mm512_stream_si512((void*)(d + 192), e);
}

/* Streams up to 4 pages of the row side by side (as glibc's large memcpy does): more
   DRAM streams in flight than walking the row front to back. */
__attribute__((target("avx512f")))
static void row_avx512(uint8_t* d, const uint8_t* s, int64_t n) {
    if ((uintptr_t)d & 63) {
        int64_t k = 64 - (int64_t)((uintptr_t)d & 63);
        if (k > n) k = n;
        memcpy(d, s, k); d += k; s += k; n -= k;
    }
    while (n >= PAGE) {
        int64_t pages = n / PAGE < 4 ? n / PAGE : 4;
        for (int64_t k = 0; k < PAGE; k += 256)
            for (int64_t p = 0; p < pages; p++) copy256(d + p * PAGE + k, s + p * PAGE + k);
        d += pages * PAGE; s += pages * PAGE; n -= pages * PAGE;
    }
    for (; n >= 256; n -= 256, s += 256, d += 256) copy256(d, s);
    if (n) memcpy(d, s, n);
}

static void row_sse2(uint8_t* d, const uint8_t* s, int64_t n) {
    if ((uintptr_t)d & 15) {
        int64_t k = 16 - (int64_t)((uintptr_t)d & 15);
        if (k > n) k = n;
        memcpy(d, s, k); d += k; s += k; n -= k;
    }
    for (; n >= 64; n -= 64, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i*)s);
        __m128i b = _mm_loadu_si128((const __m128i*)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i*)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i*)(s + 48));
        _mm_stream_si128((__m128i*)d, a);
        _mm_stream_si128((__m128i*)(d + 16), b);
        _mm_stream_si128((__m128i*)(d + 32), c);
        _mm_stream_si128((__m128i*)(d + 48), e);
    }
    if (n) memcpy(d, s, n);
}
#endif

/* For each of `pairs` (dst, src) matrices: dst[dst_ids[i]] = src[src_ids[i]], i < n. */
void pd_copy_rows(int64_t pairs, const int64_t* dsts, const int64_t* srcs,
                  const int64_t* dst_ids, const int64_t* src_ids, int64_t n,
                  int64_t row_bytes) {
#if defined(__x86_64__)
    int wide = __builtin_cpu_supports("avx512f");
#endif
    for (int64_t p = 0; p < pairs; p++) {
        uint8_t* dst = (uint8_t*)(uintptr_t)dsts[p];
        const uint8_t* src = (const uint8_t*)(uintptr_t)srcs[p];
        for (int64_t i = 0; i < n; i++) {
            uint8_t* d = dst + dst_ids[i] * row_bytes;
            const uint8_t* s = src + src_ids[i] * row_bytes;
#if defined(__x86_64__)
            if (wide) row_avx512(d, s, row_bytes); else row_sse2(d, s, row_bytes);
#else
            memcpy(d, s, row_bytes);
#endif
        }
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
}
"""


class UntrustedLibraryError(OSError):
    """The helper's directory or library could have been written by someone else."""


def cache_dirs() -> list[str]:
    """Where the helper may live, in order of preference."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    per_user = os.path.join(tempfile.gettempdir(), f"pdserve-{os.getuid()}")
    return [os.path.join(base, "pdserve"), per_user]


def _private_dir() -> str:
    """The first of `cache_dirs()` we can create (mode 0700) that is ours and closed to
    others; raises UntrustedLibraryError (or OSError) when none is."""
    error: OSError = OSError("no cache directory")
    for path in cache_dirs():
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            _check_private(path, os.lstat(path), directory=True)
            return path
        except UntrustedLibraryError:
            raise  # it exists and someone else could write it: do not look elsewhere
        except OSError as exc:
            error = exc
    raise error


def _check_private(path: str, info: os.stat_result, *, directory: bool) -> None:
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise UntrustedLibraryError(f"{path} is not a plain {'directory' if directory else 'file'}")
    if info.st_uid != os.getuid():
        raise UntrustedLibraryError(f"{path} is owned by uid {info.st_uid}, not by us")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedLibraryError(f"{path} is writable by others (mode {info.st_mode:o})")


def _build(compiler: str, target: str, record: str) -> None:
    """Compile in a temporary directory beside `target`, record the hash, move it in."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        with open(os.path.join(tmp, "ntcopy.c"), "w") as f:
            f.write(_SOURCE)
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", "ntcopy.so", "ntcopy.c"]
        result = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise OSError(f"building the streaming-copy helper failed: {result.stderr}")
        built = os.path.join(tmp, "ntcopy.so")
        os.chmod(built, 0o700)
        with open(built, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(tmp, "sha256"), "w") as f:
            f.write(digest)
        os.replace(os.path.join(tmp, "sha256"), record)
        os.replace(built, target)


def _open_verified(target: str, record: str) -> int:
    """An fd of `target` after checking its owner, mode and recorded hash (no TOCTOU: the
    bytes hashed are those of the open file, which is what gets loaded)."""
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private(target, os.fstat(fd), directory=False)
        with open(record, opener=_open_nofollow) as f:
            _check_private(record, os.fstat(f.fileno()), directory=False)
            expected = f.read().strip()
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        if digest.hexdigest() != expected:
            raise UntrustedLibraryError(f"{target} does not match the hash recorded at build")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The loaded helper, or None (no compiler, a failed build or check: logged once)."""
    try:
        return _load()
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("streaming-copy helper not loaded, using numpy copies: %s", exc)
        return None


def _load() -> ctypes.CDLL | None:
    digest = hashlib.sha256((_SOURCE + platform.machine()).encode()).hexdigest()[:16]
    directory = _private_dir()
    target = os.path.join(directory, f"ntcopy-{digest}.so")
    record = target + ".sha256"
    with open(os.path.join(directory, "ntcopy.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; loaders see whole files
        if not (os.path.exists(target) and os.path.exists(record)):
            compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
            if compiler is None:
                logger.info("no C compiler: KV block copies use numpy (ordinary stores)")
                return None
            _build(compiler, target, record)
        fd = _open_verified(target, record)
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else target)
    finally:
        os.close(fd)
    fn = lib.pd_copy_rows
    fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    return lib


def available() -> bool:
    """Whether streaming copies are available (builds the helper on first call)."""
    return _library() is not None


def worth_streaming(transfer_bytes: int) -> bool:
    """Whether a transfer of `transfer_bytes` (all layers) should use streaming stores."""
    return transfer_bytes >= STREAMING_MIN_BYTES and available()


def copy_rows_many(
    pairs: list[tuple[int, int]],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    *,
    row_bytes: int,
    src_num_rows: int,
    dst_num_rows: int,
) -> None:
    """`dst[dst_ids] = src[src_ids]` with streaming stores, for several (source address,
    destination address) row matrices at once (e.g. K and V of every queued layer), the
    GIL released throughout. Each source has `src_num_rows` rows of `row_bytes` at its
    address, each destination `dst_num_rows` (the caller guarantees those; the contiguous
    int64 ids are checked against them)."""
    lib = _library()
    assert lib is not None, "check available() first"
    n = len(src_ids)
    if n != len(dst_ids):
        raise ValueError(f"{n} source ids but {len(dst_ids)} destination ids")
    for ids, limit in ((src_ids, src_num_rows), (dst_ids, dst_num_rows)):
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            raise ValueError("ids must be a contiguous int64 vector")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise IndexError(f"block id out of range [0, {limit})")
    if n == 0 or not pairs:
        return
    addresses = np.asarray(pairs, dtype=np.int64)  # [pairs, 2]: source, destination
    srcs = np.ascontiguousarray(addresses[:, 0])
    dsts = np.ascontiguousarray(addresses[:, 1])
    args = (dsts.ctypes.data, srcs.ctypes.data, dst_ids.ctypes.data, src_ids.ctypes.data)
    lib.pd_copy_rows(len(pairs), *args, n, row_bytes)
