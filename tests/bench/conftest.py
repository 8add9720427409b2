"""Fixtures of the serving-benchmark tests: a real pdserve app to point the load generator at.

`bench_server` starts the default application (`app.main.DEFAULT_ARGS`: 1 prefill + 1 decode
replica at 0.5 CPU each, KV over shared memory) on a freshly written built-in `tiny` model,
on a private local Ray instance (2 CPUs) and a free port, once per test module, through
`bench.serve.deploy` (the same helper `pdserve bench compare` uses).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.serve.deploy import RunningApp, app_args, free_port, running_app
from engine.builtin import write_builtin_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model; its directory name makes the served name `pdserve-tiny`."""
    return write_builtin_model(tmp_path_factory.mktemp("bench-models") / "tiny", "tiny")


@pytest.fixture(scope="module")
def bench_server(tiny_model_dir: Path) -> Iterator[RunningApp]:
    """The default app on the tiny model, up and healthy, torn down after the module."""
    from app.main import DEFAULT_ARGS

    args = app_args(DEFAULT_ARGS, model=str(tiny_model_dir), dtype="float32", port=free_port())
    with running_app(args, num_cpus=2, startup_timeout_s=180, any_port=True) as app:
        yield app
