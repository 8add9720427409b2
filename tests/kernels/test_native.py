"""C kernels are built once into a private directory and loaded only when they are ours."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.kernels import native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


def source(tag: str) -> str:
    return f"int pd_answer_{tag}(void) {{ return 42; }}\n"


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "pdserve" / "kernels"


def test_builds_once_and_loads(cache_home: Path) -> None:
    lib = native.load_library("answer", source("a"))
    assert lib is not None and lib.pd_answer_a() == 42
    (built,) = cache_home.glob("answer-*.so")
    assert (cache_home.stat().st_mode & 0o777) == 0o700
    mtime = built.stat().st_mtime_ns
    assert native._load("answer", source("a")) is not None  # found, not rebuilt
    assert built.stat().st_mtime_ns == mtime


def test_refuses_a_library_that_changed(cache_home: Path) -> None:
    assert native.load_library("answer", source("b")) is not None
    (built,) = cache_home.glob("answer-*.so")
    with open(built, "ab") as f:
        f.write(b"\0")
    with pytest.raises(native.UntrustedLibraryError, match="hash"):
        native._load("answer", source("b"))


def test_refuses_a_directory_others_can_write(cache_home: Path) -> None:
    cache_home.mkdir(parents=True)
    os.chmod(cache_home, 0o777)
    with pytest.raises(native.UntrustedLibraryError, match="writable"):
        native._load("answer", source("c"))
    assert native.load_library("answer", source("c")) is None  # logged, torch path


def test_a_source_that_does_not_compile_gives_none(cache_home: Path) -> None:
    assert native.load_library("broken", "this is not C") is None


def test_a_kernels_source_carries_the_shared_header() -> None:
    """The header is pasted in, so a change to it changes the source (the cache key)."""
    header = native.kernel_source("pd_common.h")
    for name in ("decode_attention.c", "elementwise.c"):
        source = native.kernel_source(name)
        assert header in source
        assert not any(line.startswith('#include "') for line in source.splitlines())
