"""Shared setup of the kvtransfer tests.

The multi-process tests run `kvt_peers` functions in spawned children, which import them
by module name: this directory goes on sys.path (children inherit the parent's sys.path),
whatever pytest's import mode, and so does the repo root for a plain `pytest` run.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _path in (_ROOT, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from kvt_peers import BACKENDS, Peer  # noqa: E402


@pytest.fixture(scope="session")
def peer() -> Iterator[Peer]:
    """One long-lived prefill process shared by the multi-process tests."""
    p = Peer()
    yield p
    p.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
