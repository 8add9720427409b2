"""Start and stop a pdserve config on this machine, for benchmarks and their tests.

`app_args("cpu-disagg", model="small", dtype="float32", port=p)` reads
`configs/cpu-disagg.yaml` (or any Serve config path, or a `PDServeConfig` dict), overrides
the model, dtype and port, and validates the result. `running_app(args)` starts a private
local Ray instance (`num_cpus` CPUs, never someone else's cluster), deploys the app, waits
until `GET /health` answers 200, yields the base URL, and shuts everything down on exit.

    python -m bench.serve.deploy cpu-disagg --model small --port 8000   # serve until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.config import ConfigError, load_config
from app.driver_exit import cancel_abort_alarm

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class RunningApp:
    """A deployed app: where it listens and the args it was built from."""

    base_url: str
    port: int
    args: dict[str, Any]

    @property
    def model_name(self) -> str:
        """The name clients send as `model`."""
        return str(load_config(self.args).model.served_model_name)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_path(name: str) -> Path:
    """`cpu-disagg` -> `configs/cpu-disagg.yaml`; an existing path is returned as is."""
    path = Path(name)
    if path.exists():
        return path
    candidate = CONFIG_DIR / f"{name}.yaml"
    if candidate.exists():
        return candidate
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"no config {name!r}: not a file, and not one of {known}")


def app_args(
    config: str | Path | Mapping[str, Any],
    model: str | None = None,
    dtype: str | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """The application args (a `PDServeConfig` document) of `config`, with overrides."""
    if isinstance(config, Mapping):
        data: Any = copy.deepcopy(dict(config))
    else:
        with open(config_path(str(config)), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    if isinstance(data, Mapping) and "applications" in data:
        load_config(data)  # the file's own consistency checks (names, ports)
        data = copy.deepcopy(dict(data["applications"][0].get("args") or {}))
    args: dict[str, Any] = dict(data)
    args["model"] = dict(args.get("model") or {})
    if model is not None:
        args["model"]["model"] = model
        args["model"].pop("served_model_name", None)
    if dtype is not None:
        args["model"]["dtype"] = dtype
    if port is not None:
        args["http"] = {**(args.get("http") or {}), "port": port}
    load_config(args)  # validate before anything starts
    return args


def add_app_arguments(parser: argparse.ArgumentParser, default_config: str) -> None:
    """`--config`, `--model`, `--dtype`, `--num-cpus`: the app a bench deploys (the config's
    own model and dtype unless overridden; see `app_args`) and its Ray instance's CPUs."""
    parser.add_argument("--config", default=default_config, help="configs/<name>.yaml or a path")
    parser.add_argument("--model", default=None, help="override the config's model")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the Ray instance")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=15).status_code == 200
    except httpx.HTTPError:
        return False


def start_serve(port: int | None = None, attempts: int = 3) -> int:
    """`serve.start` on 127.0.0.1 (after `ray.init`); returns the port it listens on. With
    `port` None any free port will do: one of Ray's own processes can take the chosen port
    before the proxy binds it ("Failed to bind to address"), and then Serve is shut down and
    started on another free one, `attempts` times at most. A given `port` is not replaced.
    On a loaded machine the controller may find its first proxy not ready in time (three
    5 s checks), kill it and start another on the same port, while `serve.start` still waits
    for the first one (ActorDiedError): Serve is then up, and this connects to it (callers
    wait for the app's health, which waits for the new proxy)."""
    from ray import serve
    from ray.exceptions import ActorDiedError

    from app.serve.cadence import controller_options

    def start(at: int) -> None:
        serve.start(
            http_options={"host": "127.0.0.1", "port": at},
            controller_options=controller_options(),  # Serve's cadence: app/serve/cadence.py
        )

    chosen = free_port() if port is None else port
    for attempt in range(1, attempts + 1):
        try:
            start(chosen)
            return chosen
        except ActorDiedError as exc:
            if "ProxyActor" not in str(exc):
                raise
            logger.warning("Serve replaced its first HTTP proxy while starting; connecting")
            start(chosen)
            return chosen
        except Exception as exc:  # noqa: BLE001 - only the bind race is retried
            if port is not None or "Failed to bind" not in str(exc) or attempt == attempts:
                raise
            with contextlib.suppress(Exception):
                serve.shutdown()
            logger.warning("port %d was taken before Serve bound it; trying another", chosen)
            chosen = free_port()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_app(
    args: dict[str, Any],
    num_cpus: int = 2,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    any_port: bool = False,
) -> Iterator[RunningApp]:
    """Deploy `args` on a fresh local Ray instance; tear it all down on exit. `any_port`:
    the args' port was picked with `free_port` and another free one will do if it is taken
    by the time Serve binds it (the yielded app's `port` and `args` say which)."""
    import ray
    from ray import serve

    from app.main import build_app

    config = load_config(args)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = start_serve(None if any_port else config.http.port)
        if port != config.http.port:
            args = {**args, "http": {**(args.get("http") or {}), "port": port}}
        serve.run(build_app(args), name=config.app_name, route_prefix=config.route_prefix)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health not 200 after {startup_timeout_s} s")
            time.sleep(0.5)
        yield RunningApp(url, port, args)
    finally:
        # A SIGTERM that brought us here armed Ray's 3 s abort; draining outlasts it.
        cancel_abort_alarm()
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve.deploy", description=__doc__)
    parser.add_argument("config", help="configs/<name>.yaml name or a Serve config path")
    parser.add_argument("--model", default=None, help="override args.model.model")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    app = app_args(args.config, args.model, args.dtype, args.port)
    with running_app(app, args.num_cpus) as running:
        print(f"{running.base_url}/v1 serving {running.model_name}; Ctrl-C stops", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
