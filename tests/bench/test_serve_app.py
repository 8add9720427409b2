"""`bench.serve_app.running_app`: a port taken before Serve binds it is replaced when the
caller said any free port will do, and refused otherwise."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from bench.serve_app import app_args, running_app


def test_taken_port_is_replaced_only_when_any_port_will_do(tiny_model_dir: Path) -> None:
    from app.main import DEFAULT_ARGS

    with socket.socket() as taken:  # what one of Ray's processes may do to a picked port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = app_args(DEFAULT_ARGS, model=str(tiny_model_dir), dtype="float32", port=port)
        with (
            pytest.raises(Exception, match="Failed to bind"),
            running_app(args, num_cpus=2, startup_timeout_s=180),
        ):
            pass
        with running_app(args, num_cpus=2, startup_timeout_s=180, any_port=True) as app:
            assert app.port != port and app.args["http"]["port"] == app.port
            assert httpx.get(f"{app.base_url}/health", timeout=30).status_code == 200
