"""Wheels carried in two parts (`scripts/wheel_parts.py`), as `scripts/gpu_serve_check.sh`
carries Ray's 76 MiB wheel over two device calls of at most 64 MiB each: the split keeps
each part under the limit, the join gives every file back byte for byte, and a piece lost
or changed on the way is refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wheel_parts.py"
KiB = 1024


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def wheels(folder: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    """Files of the given sizes with distinct pseudo-random contents."""
    folder.mkdir()
    contents = {}
    for i, (name, size) in enumerate(sizes.items()):
        block = hashlib.sha256(name.encode()).digest()
        data = (block * (size // len(block) + 1))[:size]
        data = bytes((b + i * 7) % 256 for b in data[:4096]) + data[4096:]
        (folder / name).write_bytes(data)
        contents[name] = data
    return contents


def part_bytes(part: Path) -> int:
    return sum(p.stat().st_size for p in part.iterdir())


@pytest.fixture
def split_parts(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    # as on the device, scaled down: one wheel larger than a part (ray), the rest small
    sizes = {"ray.whl": 760 * KiB, "fastapi.whl": 90 * KiB, "pydantic_core.whl": 200 * KiB}
    sizes |= {f"dep{i}.whl": 17 * KiB for i in range(5)}
    contents = wheels(tmp_path / "all", sizes)
    result = run("split", tmp_path / "all", tmp_path / "out", "--limit-mib", 600 / 1024)
    assert result.returncode == 0, result.stderr
    return tmp_path / "out" / "part1", tmp_path / "out" / "part2", contents


def test_each_part_stays_under_the_limit_and_the_join_is_exact(
    split_parts: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    part1, part2, contents = split_parts
    assert part_bytes(part1) <= 600 * KiB and part_bytes(part2) <= 600 * KiB
    assert (part1 / "ray.whl.part1").exists() and (part2 / "ray.whl.part2").exists()
    result = run("join", part1, part2, tmp_path / "joined")
    assert result.returncode == 0, result.stderr
    joined = {p.name: p.read_bytes() for p in (tmp_path / "joined").iterdir()}
    assert joined == contents


def test_a_lost_or_changed_piece_is_refused(
    split_parts: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    part1, part2, _ = split_parts
    piece = part2 / "ray.whl.part2"
    data = bytearray(piece.read_bytes())
    data[100] ^= 1
    piece.write_bytes(bytes(data))
    result = run("join", part1, part2, tmp_path / "joined")
    assert result.returncode == 1 and "ray.whl: joined" in result.stderr
    assert not (tmp_path / "joined" / "ray.whl").exists()
    piece.unlink()
    result = run("join", part1, part2, tmp_path / "joined")
    assert result.returncode == 1 and "piece ray.whl.part2 is in neither part" in result.stderr


def test_more_than_two_parts_is_refused(tmp_path: Path) -> None:
    wheels(tmp_path / "all", {"a.whl": 700 * KiB, "b.whl": 700 * KiB})
    result = run("split", tmp_path / "all", tmp_path / "out", "--limit-mib", 600 / 1024)
    assert result.returncode == 1 and "more than two parts" in result.stderr


def test_the_manifests_name_every_wheel(split_parts: tuple[Path, Path, dict[str, bytes]]) -> None:
    part1, part2, contents = split_parts
    names = set(json.loads((part1 / "MANIFEST.json").read_text()))
    names |= set(json.loads((part2 / "MANIFEST.json").read_text()))
    assert names == set(contents)
