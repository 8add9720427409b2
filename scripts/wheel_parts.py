"""Carry wheels larger than one device call's limit in parts, over two calls.

A device call carries at most 64 MiB of the working tree, and Ray's wheel alone is ~76 MiB.
So `split` packs a folder of wheels into two folders, `part1` and `part2`, each under the
limit: whole wheels where they fit, and any wheel too large cut in two byte ranges, the
first range in `part1`. Each part holds a `MANIFEST.json`: every file's name, size and
sha256, and for a cut wheel the name of each piece. The first call parks `part1` outside
the working tree (which the next call replaces); the second call, carrying `part2`, runs
`join`, which checks every piece and whole file against both manifests and writes the
wheels, byte for byte, into one folder for `pip install --no-index`.

    python scripts/wheel_parts.py split .whl/all .whl --limit-mib 60
    python scripts/wheel_parts.py join /root/pdserve-part1 .whl/part2 /tmp/wheels

`scripts/gpu_serve_check.sh` runs both steps; tests/scripts/test_wheel_parts.py checks
them on small files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "MANIFEST.json"
MiB = 1024 * 1024


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def split(source: Path, out: Path, limit: int) -> tuple[Path, Path]:
    """Pack every file of `source` into `out/part1` and `out/part2`, each at most `limit`
    bytes (manifests included, which are small): largest first, whole where it fits, a
    file too large cut in two. Raises ValueError when the files exceed two parts."""
    files = sorted(
        (p for p in source.iterdir() if p.is_file()), key=lambda p: (-p.stat().st_size, p.name)
    )
    budget = limit - 16 * 1024  # room for the manifests (~150 bytes a wheel)
    if sum(p.stat().st_size for p in files) > 2 * budget:
        raise ValueError(f"{source} holds more than two parts of {limit} bytes")
    parts = [out / "part1", out / "part2"]
    for part in parts:
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
    used = [0, 0]
    manifests: list[dict[str, dict]] = [{}, {}]
    for path in files:
        size = path.stat().st_size
        entry = {"size": size, "sha256": sha256(path)}
        whole = next((i for i in (0, 1) if used[i] + size <= budget), None)
        if whole is not None:
            shutil.copyfile(path, parts[whole] / path.name)
            used[whole] += size
            manifests[whole][path.name] = {**entry, "pieces": [path.name]}
            continue
        first = budget - used[0]
        if first <= 0 or size - first > budget - used[1]:
            raise ValueError(f"{path.name} ({size} bytes) does not fit in what is left")
        pieces = [f"{path.name}.part1", f"{path.name}.part2"]
        with path.open("rb") as f:
            (parts[0] / pieces[0]).write_bytes(f.read(first))
            (parts[1] / pieces[1]).write_bytes(f.read())
        used[0] += first
        used[1] += size - first
        manifests[0][path.name] = {**entry, "pieces": pieces}  # both parts name it
        manifests[1][path.name] = {**entry, "pieces": pieces}
    for part, manifest in zip(parts, manifests, strict=True):
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return parts[0], parts[1]


def join(part1: Path, part2: Path, out: Path) -> list[Path]:
    """The wheels of both parts, whole and checked, in `out`. Raises ValueError on a
    missing piece or a size or sha256 that differs from the manifests."""
    manifests = [json.loads((p / MANIFEST).read_text()) for p in (part1, part2)]
    entries = {**manifests[0], **manifests[1]}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entry in sorted(entries.items()):
        target = out / name
        with target.open("wb") as dst:
            for piece in entry["pieces"]:
                source = part1 / piece if (part1 / piece).exists() else part2 / piece
                if not source.exists():
                    raise ValueError(f"{name}: piece {piece} is in neither part")
                with source.open("rb") as src:
                    shutil.copyfileobj(src, dst, MiB)
        size = target.stat().st_size
        if size != entry["size"] or sha256(target) != entry["sha256"]:
            target.unlink()
            raise ValueError(f"{name}: joined {size} bytes differ from the manifest's")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="pack a folder of wheels into part1 and part2")
    cut.add_argument("source", type=Path)
    cut.add_argument("out", type=Path)
    cut.add_argument("--limit-mib", type=float, default=60.0)
    glue = sub.add_parser("join", help="the wheels of two parts, checked, in one folder")
    glue.add_argument("part1", type=Path)
    glue.add_argument("part2", type=Path)
    glue.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            for part in split(args.source, args.out, int(args.limit_mib * MiB)):
                size = sum(p.stat().st_size for p in part.iterdir())
                print(f"{part}: {size / MiB:.1f} MiB, {len(list(part.iterdir())) - 1} files")
        else:
            written = join(args.part1, args.part2, args.out)
            print(f"{args.out}: {len(written)} wheels joined and checked")
    except ValueError as exc:
        print(f"wheel_parts: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
