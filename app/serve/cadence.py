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

They reach Serve's processes through the environment Ray starts them in, except where a
config file writes them:

- `serve run app.main:app` on this machine: `app.main` sets them in its process's
  environment when imported (`set_defaults`: a value already set wins), before `serve run`
  starts Ray, whose every process inherits them; so does any driver that imports `app.main`
  before `ray.init`, as the tests and benchmarks do;
- the controller and its HTTP proxies: also `controller_options()` where this project's
  code starts Serve (`bench.serve.deploy.start_serve`);
- `serve run configs/<name>.yaml`: the file's `controller_options` block and its
  application's `runtime_env` (the replicas); edit both to change them;
- a cluster: `cluster.yaml` exports them before `ray start` on every node.

Deployments carry no `runtime_env` of their own in `app.main`: one would make Serve drop
the job's (`serve run --runtime-env-json`, a driver's `ray.init(runtime_env=...)`) for
them, all but its `working_dir`, and the replicas would lose the variables a user put there
(`api_keys_env`, `PDSERVE_BF16_GEMM`).
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


def controller_options() -> dict[str, Any]:
    """`serve.start(controller_options=...)`: the controller (and the proxies it starts)
    run with `serve_env_vars()`."""
    return {"runtime_env": {"env_vars": serve_env_vars()}}
