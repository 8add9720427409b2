"""Where `kvtransfer.nccl_lib` looks for NCCL (CPU: fake library files, fake maps text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtransfer import BackendUnavailableError, nccl_lib


def fake_library(directory: Path, name: str = "libnccl.so.2") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(b"not really a shared object")
    return str(path)


def maps_line(path: str) -> str:
    return f"7f00c0000000-7f00c1000000 r-xp 00000000 103:02 4242   {path}"


def test_the_library_torch_loaded_comes_first_then_torch_lib(tmp_path: Path) -> None:
    loaded = fake_library(tmp_path / "site" / "nvidia" / "nccl" / "lib")
    other_wheel = fake_library(tmp_path / "other" / "nvidia" / "nccl" / "lib")
    torch_lib = fake_library(tmp_path / "torch" / "lib")
    maps = "\n".join(
        [
            maps_line("/usr/lib/libc.so.6"),
            maps_line(loaded),
            maps_line(loaded),  # one mapping per segment: listed once
            "7f00c2000000-7f00c3000000 rw-p 00000000 00:00 0",  # anonymous: no path
        ]
    )
    paths = list(
        nccl_lib.candidate_paths(
            maps=maps,
            torch_lib_dir=str(Path(torch_lib).parent),
        )
    )
    # the loaded file once, torch/lib, the loader; an unloaded wheel is not searched
    assert paths == [loaded, torch_lib, nccl_lib.LIBRARY_NAME]
    assert other_wheel not in paths


def test_without_torch_having_loaded_nccl_torch_lib_is_first(tmp_path: Path) -> None:
    torch_lib = fake_library(tmp_path / "torch" / "lib")
    paths = list(nccl_lib.candidate_paths(maps="", torch_lib_dir=str(Path(torch_lib).parent)))
    assert paths == [torch_lib, nccl_lib.LIBRARY_NAME]
    assert list(nccl_lib.candidate_paths(maps="", torch_lib_dir="")) == [nccl_lib.LIBRARY_NAME]


def test_maps_parsing_keeps_only_nccl_paths() -> None:
    maps = "\n".join(
        [
            maps_line("/x/libnccl.so.2"),
            maps_line("/x/libnccl-net.so"),  # a plugin, not NCCL itself
            maps_line("/x/libtorch_cuda.so"),
            maps_line("/y/path with spaces/libnccl.so.2.27.3"),
        ]
    )
    assert nccl_lib.loaded_libraries(maps) == [
        "/x/libnccl.so.2",
        "/y/path with spaces/libnccl.so.2.27.3",
    ]


def test_unloadable_candidates_give_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = fake_library(tmp_path / "nvidia" / "nccl" / "lib")  # not an ELF file
    nccl_lib.load_nccl.cache_clear()
    monkeypatch.setattr(nccl_lib, "candidate_paths", lambda: iter([broken, "/nope/libnccl.so.2"]))
    try:
        with pytest.raises(BackendUnavailableError) as info:
            nccl_lib.load_nccl()
    finally:
        nccl_lib.load_nccl.cache_clear()
    message = str(info.value)
    assert broken in message and "/nope/libnccl.so.2" in message
    assert "CUDA build of torch" in message
