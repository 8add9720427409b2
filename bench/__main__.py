"""`python -m bench <name> [args]`: the same benchmarks as `pdserve bench` (`bench/cli.py`)."""

from __future__ import annotations

import logging
import sys

from bench.cli import main

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    raise SystemExit(main(prog="python -m bench"))
