#!/usr/bin/env bash
# Fetch, on this machine, the wheels pdserve needs on a lent GPU machine and lack there, and
# pack them into two parts that each fit one device call (scripts/wheel_parts.py).
#
# The device image has PyTorch, transformers, numpy, aiohttp, grpcio and more (the list in
# /work/.library/device/KINDS.md, "Python packages already there"), but not Ray, FastAPI,
# pydantic or openai; it reaches no package registry. Ray's wheel alone (~76 MiB) is larger
# than one call may carry (64 MiB, the working tree included), so:
#
#   scripts/gpu_wheels.sh    # here: .whl/part1, .whl/part2, at most 54 MiB each (the tree,
#                             # ~9 MiB, travels with each)
#   call 1, carry [".whl/part1"]:  bash scripts/gpu_serve_check.sh park
#   call 2, carry [".whl/part2"]:  bash scripts/gpu_serve_check.sh run
#
# The machine must stay warm between the two calls (it does for 30 s after each): call 1
# parks part 1 in /root/pdserve-part1, outside the working tree the next call replaces.
# Versions are those pdserve is tested with here; Python 3.12, manylinux x86-64, as there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl/all
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
  manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl/all \
  "ray[serve]==2.60.0" "openai==3.63.0" "pydantic==2.13.4" "fastapi==0.165.0" \
  "opentelemetry-sdk==1.45.2"
# Already on the device (KINDS.md): one version of each, or the install there breaks.
present=" aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
  charset-normalizer click filelock frozenlist grpcio h11 idna jinja2 markupsafe msgpack
  multidict numpy packaging prometheus-client propcache protobuf pyyaml requests six
  typing-extensions urllib3 uvloop wrapt yarl "
for wheel in .whl/all/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
  case "$present" in *" $name "* | *" $name"$'\n'*) rm "$wheel" ;; esac
done
python3 scripts/wheel_parts.py split .whl/all .whl --limit-mib 54
rm -rf .whl/all
