"""How often Ray Serve's own machinery wakes up in every process of the app.

Serve's defaults wake its controller every 0.1 s (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`) and
every handle's router every 0.1 s to export its request metrics
(`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`). On a few cores shared with the engine that is CPU
the engine's threads could use. Measured on the 2-core CI kind (`pdserve bench idle-cost
--config cpu-tenants --model small`, BENCHMARKS.md "Batch jobs"): every process on the
machine took 4.9 CPU-s per 20 s of an idle app with Serve's defaults and 3.7 with these.
What that buys the engine beside the app is below this host's run-to-run spread: the
offline engine beside the idle app made 214 and 220 tok/s, an idle batch job 204 and 189.

What slows down: the controller notices a state change (a replica that started or died, an
autoscaling decision) up to 0.5 s later instead of 0.1 s, and Serve's own `ray_serve_*`
request metrics are exported once a second. Requests never go through the controller, and
routing stats are still pulled every `request_routing_stats_period_s` (1 s, `app/main.py`).

Each value is a default: one the environment already sets wins. They reach

- the replicas: every deployment's `runtime_env.env_vars` (`with_serve_env`);
- the controller and the HTTP proxies it starts: `controller_options()` where this
  project's code starts Serve, the `controller_options` block of `configs/*.yaml`;
- a cluster `serve run app.main:app` starts on this machine: the environment, set when
  `app.main` is imported (`set_defaults`), before `serve run` starts Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

SERVE_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def serve_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`SERVE_ENV_VARS`, each one `environ` (default: this process's) sets taking its place."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name, value) for name, value in SERVE_ENV_VARS.items()}


def set_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Put `SERVE_ENV_VARS` into `environ` (default: this process's) where it has none, so
    a Ray instance started from this process (and every process it starts) runs with them."""
    environ = os.environ if environ is None else environ
    for name, value in SERVE_ENV_VARS.items():
        environ.setdefault(name, value)


def with_serve_env(ray_actor_options: Mapping[str, Any]) -> dict[str, Any]:
    """`ray_actor_options` with `serve_env_vars()` added to its `runtime_env.env_vars`
    (variables it already sets are kept)."""
    runtime_env = dict(ray_actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**serve_env_vars(), **(runtime_env.get("env_vars") or {})}
    return {**ray_actor_options, "runtime_env": runtime_env}


def controller_options() -> dict[str, Any]:
    """`serve.start(controller_options=...)`: the controller (and the proxies it starts)
    run with `serve_env_vars()`."""
    return {"runtime_env": {"env_vars": serve_env_vars()}}
