"""Building and loading the C kernels of the CPU path, on first use.

A kernel module hands its C source (`csrc/<name>.c`, read by `kernel_source`) to
`load_library`; the source is compiled with the system C compiler for this machine's
instructions (`-march=native`, OpenMP) into a private
directory (`~/.cache/pdserve/kernels`, else `<tmp>/pdserve-<uid>/kernels`, mode 0700), named
by the SHA-256 of the source, the flags and this CPU's model and flags, with the SHA-256 of
the built library recorded beside it. It is loaded only when the directory and library are
ours, writable by nobody else, and the hash matches. Without a compiler, or when any step
fails (logged once per library), `load_library` returns None and the caller runs its torch
path.

OpenMP: the library links `libgomp.so.1`, the name of the runtime torch itself loads, so the
dynamic loader gives the kernels torch's runtime (one thread pool; `torch.set_num_threads`
holds for both). Kernels take their thread count as an argument anyway.
"""

from __future__ import annotations

import contextlib
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
from pathlib import Path

import torch

from engine.kernels.cpu_info import cpu_info

logger = logging.getLogger(__name__)

CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    # vectorized reductions (sums in another order); no -ffinite-math: softmax masks use -inf
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
BUILD_TIMEOUT_S = 120


class UntrustedLibraryError(OSError):
    """The kernel directory or library could have been written by someone else."""


def _private_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates = [
        os.path.join(base, "pdserve", "kernels"),
        os.path.join(tempfile.gettempdir(), f"pdserve-{os.getuid()}", "kernels"),
    ]
    error: OSError = OSError("no cache directory")
    for path in candidates:
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


def _build(compiler: str, source: str, flags: tuple[str, ...], target: str, record: str) -> None:
    """Compile in a temporary directory beside `target`, record the hash, move it in."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        with open(os.path.join(tmp, "kernel.c"), "w") as f:
            f.write(source)
        cmd = [compiler, *flags, "-o", "kernel.so", "kernel.c", "-lm"]
        result = subprocess.run(
            cmd, cwd=tmp, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if result.returncode != 0:
            raise OSError(f"building {os.path.basename(target)} failed: {result.stderr[-2000:]}")
        built = os.path.join(tmp, "kernel.so")
        os.chmod(built, 0o700)
        with open(built, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(tmp, "sha256"), "w") as f:
            f.write(digest)
        os.replace(os.path.join(tmp, "sha256"), record)
        os.replace(built, target)


def _open_verified(target: str, record: str) -> int:
    """An fd of `target` after checking its owner, mode and recorded hash (the bytes hashed
    are those of the open file, which is what gets loaded)."""
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private(target, os.fstat(fd), directory=False)
        with open(record, opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW)) as f:
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


@functools.cache
def load_library(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `source` (built on first use with `CFLAGS` and `extra_flags`), or None
    where it cannot be (logged once)."""
    try:
        return _load(name, source, extra_flags)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("C kernel %s not loaded, using the torch path: %s", name, exc)
        return None


def _load(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    flags = (*CFLAGS, *extra_flags)
    key = "\n".join([source, " ".join(flags), platform.machine(), cpu_info().identity()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    directory = _private_dir()
    target = os.path.join(directory, f"{name}-{digest}.so")
    record = target + ".sha256"
    with open(os.path.join(directory, f"{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; loaders see whole files
        if not (os.path.exists(target) and os.path.exists(record)):
            compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
            if compiler is None:
                logger.info("no C compiler: the CPU kernels use their torch paths")
                return None
            _build(compiler, source, flags, target, record)
        fd = _open_verified(target, record)
        try:
            # By its own (digest-named) path: dlopen reuses an earlier handle whose name
            # matches, so a reused `/proc/self/fd/N` name could return another library.
            # Between the check and the load only our uid can replace it (private dir).
            return ctypes.CDLL(target)
        finally:
            os.close(fd)


def kernel_source(filename: str) -> str:
    """The C source of a kernel, `engine/kernels/csrc/<filename>`, with each `#include` of a
    header of that directory pasted in (so the source, the library's cache key, covers it)."""
    directory = Path(__file__).parent / "csrc"
    lines = []
    for line in (directory / filename).read_text().splitlines(keepends=True):
        name = line.strip().removeprefix("#include").strip()
        if line.startswith("#include") and name.startswith('"') and name.endswith('"'):
            line = kernel_source(name.strip('"'))
        lines.append(line)
    return "".join(lines)


def labelled(name: str) -> contextlib.AbstractContextManager[object]:
    """A label (`pdserve::<name>`) for a C kernel's call while torch's profiler records:
    a ctypes call is invisible to it otherwise (`pdserve bench engine --profile`). Costs a
    flag check when it does not record."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"pdserve::{name}")
    return contextlib.nullcontext()
