"""`bench.serve.deploy.running_app`: a port taken before Serve binds it is replaced when the
caller said any free port will do, and refused otherwise; `start_serve` survives Serve
replacing its first HTTP proxy."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from app.serve.cadence import serve_env_vars
from bench.serve.deploy import app_args, running_app, start_serve


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


def test_start_serve_connects_when_serve_replaced_its_first_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load the controller kills a proxy not ready in time and starts another on the
    same port, and `serve.start`, waiting for the first, raises: Serve is up all the same."""
    from ray import serve
    from ray.exceptions import ActorDiedError

    class ProxyReplaced(ActorDiedError):
        def __str__(self) -> str:
            return "The actor died unexpectedly. class_name: ProxyActor (killed by ray.kill)"

    ports: list[int] = []
    first_error: ActorDiedError = ProxyReplaced()

    def start(http_options: dict[str, object], controller_options: dict[str, object]) -> None:
        assert controller_options == {"runtime_env": {"env_vars": serve_env_vars()}}
        ports.append(int(str(http_options["port"])))
        if len(ports) == 1:
            raise first_error

    monkeypatch.setattr(serve, "start", start)
    assert start_serve(port=8123) == 8123 and ports == [8123, 8123]
    ports.clear()
    first_error = ActorDiedError()  # another actor died: not this race, raised as it is
    with pytest.raises(ActorDiedError):
        start_serve(port=8123)
    assert ports == [8123]
