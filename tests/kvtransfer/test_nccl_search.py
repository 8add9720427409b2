"""Where `kvtransfer.nccl_lib` looks for NCCL (CPU: fake library files, fake NCCLs).

A fake NCCL, built with the C compiler under the soname `libnccl.so.2`, exports the
functions `NcclLibrary` binds and reports its own version, so the version `load_nccl`
returns shows which library it took. Each such case runs in a fresh process (a loaded
library stays loaded), and needs a CPU build of torch: a CUDA build loads the real NCCL
on import, which then comes first, as it should.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtransfer import BackendUnavailableError, nccl_lib

ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc") or shutil.which("gcc")
FAKE_NCCL = """
int ncclGetVersion(int* version) { *version = VERSION; return 0; }
const char* ncclGetErrorString(int result) { return "fake"; }
int ncclGetUniqueId(void) { return 0; }
int ncclCommInitRank(void) { return 0; }
int ncclCommAbort(void) { return 0; }
int ncclSend(void) { return 0; }
int ncclRecv(void) { return 0; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
"""
# In a fresh process: load argv[1] first (as torch loads its NCCL on import), then report
# what load_nccl finds with argv[2] as torch's lib directory.
LOAD = """
import ctypes, sys
from kvtransfer import nccl_lib
if sys.argv[1]:
    ctypes.CDLL(sys.argv[1])
nccl_lib.TORCH_LIB_DIR = sys.argv[2]
try:
    print(nccl_lib.load_nccl().version())
except nccl_lib.BackendUnavailableError as exc:
    print(exc)
"""


def fake_library(directory: Path, name: str = "libnccl.so.2") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(b"not really a shared object")
    return str(path)


def fake_nccl(directory: Path, version: int, name: str = "libnccl.so.2") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    source, path = directory / "fake_nccl.c", directory / name
    source.write_text(FAKE_NCCL)
    assert CC is not None
    command = [CC, "-shared", "-fPIC", f"-DVERSION={version}", "-Wl,-soname,libnccl.so.2"]
    subprocess.run([*command, "-o", str(path), str(source)], check=True, timeout=60)
    return str(path)


def load_in_fresh_process(loaded: str, torch_lib_dir: str, system_dir: str) -> str:
    """What `load_nccl` reports in a new process: a version, or its error."""
    library_path = os.pathsep.join(p for p in (system_dir, os.environ.get("LD_LIBRARY_PATH")) if p)
    env = {**os.environ, "LD_LIBRARY_PATH": library_path, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", LOAD, loaded, torch_lib_dir]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_candidates_are_the_loaded_library_then_torch_lib_then_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_lib = fake_library(tmp_path / "torch" / "lib")
    os.symlink(torch_lib, tmp_path / "torch" / "lib" / "libnccl.so")  # one file, two names
    monkeypatch.setattr(nccl_lib, "TORCH_LIB_DIR", str(tmp_path / "torch" / "lib"))
    assert nccl_lib.candidates() == [
        (nccl_lib.LIBRARY_NAME, os.RTLD_NOLOAD),
        (os.path.realpath(torch_lib), ctypes.DEFAULT_MODE),  # tried once
        (nccl_lib.LIBRARY_NAME, ctypes.DEFAULT_MODE),
    ]
    monkeypatch.setattr(nccl_lib, "TORCH_LIB_DIR", str(tmp_path / "empty"))
    assert nccl_lib.candidates() == [
        (nccl_lib.LIBRARY_NAME, os.RTLD_NOLOAD),
        (nccl_lib.LIBRARY_NAME, ctypes.DEFAULT_MODE),
    ]


@pytest.mark.skipif(CC is None, reason="needs a C compiler to build fake NCCLs")
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch loads the real NCCL")
def test_the_nccl_torch_loaded_comes_first_then_torch_lib_then_the_loader(tmp_path: Path) -> None:
    # as torch's wheel dependency: a file of another name, found only because it is loaded
    wheel = fake_nccl(tmp_path / "site" / "nvidia" / "nccl" / "lib", 1, "libnccl.so.2.99.1")
    torch_lib = str(Path(fake_nccl(tmp_path / "torch" / "lib", 2)).parent)
    system = str(Path(fake_nccl(tmp_path / "system", 3)).parent)
    empty = str(tmp_path / "empty")
    assert load_in_fresh_process(wheel, torch_lib, system) == "1"
    assert load_in_fresh_process("", torch_lib, system) == "2"  # an unloaded wheel: not searched
    assert load_in_fresh_process("", empty, system) == "3"
    if ctypes.util.find_library("nccl") is None:  # else the system's own NCCL loads here
        message = load_in_fresh_process("", empty, empty)
        assert "NCCL not found" in message and "libnccl.so.2 among loaded libraries" in message


def test_unloadable_candidates_give_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = fake_library(tmp_path / "nvidia" / "nccl" / "lib")  # not an ELF file
    tried = [(broken, ctypes.DEFAULT_MODE), ("/nope/libnccl.so.2", ctypes.DEFAULT_MODE)]
    nccl_lib.load_nccl.cache_clear()
    monkeypatch.setattr(nccl_lib, "candidates", lambda: tried)
    try:
        with pytest.raises(BackendUnavailableError) as info:
            nccl_lib.load_nccl()
    finally:
        nccl_lib.load_nccl.cache_clear()
    message = str(info.value)
    assert broken in message and "/nope/libnccl.so.2" in message
    assert "CUDA build of torch" in message
