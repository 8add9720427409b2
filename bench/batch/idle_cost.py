"""`pdserve bench idle-cost`: what an idle app costs the engine beside it.

1. **Offline alone**: the `bench batch` job's requests (`--requests` greedy completions of
   64 random tokens, `--max-tokens` each) on one `Engine` in this process, with the config's
   decode pool's settings and `--num-cpus` torch threads: generated tok/s.
2. The config is deployed on a private Ray instance with `--num-cpus` CPUs; once the
   ingress reads it idle (`batch.idle` of `/v1/pdserve/stats`), the CPU time of every
   process on the machine is read from `/proc` over `--seconds` of nothing sent: CPU-s by
   process (Ray's title: `ray::ServeController`, `ray::ServeReplica:<app>:<deployment>`,
   ...; the others by their executable).
3. **Offline beside the idle app**: step 1 again while the app idles.

The app and the engine run the model `bench batch` runs (`bench.batch.main.job_model`: the
config's, but `small` where it serves the built-in `tiny`, unless `--model` says so).

Serve's cadence (`app/serve/cadence.py`) is in force unless the environment sets its
variables: `RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=100
pdserve bench idle-cost ...` measures Serve's defaults.

    pdserve bench idle-cost --config cpu-tenants --model small --json out.json

The last stdout line is the summary as one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.batch.jobs import JobShape, offline_tok_s, with_threads
from bench.batch.main import plan_args, wait_idle
from bench.serve.cpu import cpu_seconds
from bench.serve.deploy import add_app_arguments, running_app


def process_cpu_s() -> dict[int, tuple[str, float]]:
    """pid -> (its name, CPU seconds so far) for every process this user can read."""
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            found[int(entry.name)] = (process_name(argv0), cpu_seconds(int(entry.name)))
        except OSError:  # gone meanwhile
            continue
    return found


def process_name(argv0: str) -> str:
    """A Ray worker's title without the task it runs (`ray::ServeController.listen_for_change`
    -> `ray::ServeController`); another process's executable name."""
    if argv0.startswith("ray::"):
        return argv0.split(".", 1)[0]
    return os.path.basename(argv0) or "?"


def cpu_used(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds by process name between two `process_cpu_s` readings (names as first
    read: a Ray worker's title changes with its task), largest first."""
    used: collections.defaultdict[str, float] = collections.defaultdict(float)
    for pid, (name, seconds) in after.items():
        first_name, first = before.get(pid, (name, 0.0))
        used[first_name] += seconds - first
    ranked = sorted(used.items(), key=lambda item: -item[1])
    return {name: round(s, 3) for name, s in ranked if s >= 0.005}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench idle-cost",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-tenants")
    parser.add_argument("--requests", type=int, default=128, help="the offline job's requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0, help="idle time measured")
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    options = parser.parse_args(argv)
    options.batch_class, options.interactive_class = "batch", "interactive"

    from app.config import load_config
    from app.serve.cadence import serve_env_vars

    args, _ = plan_args(options)
    config = load_config(args)
    engine_config = with_threads(
        config.engine_config(config.pools_by_role("decode")[0]), options.num_cpus
    )
    shape = JobShape(options.requests, 64, options.max_tokens)
    print("offline alone", file=sys.stderr)
    alone = offline_tok_s(engine_config, shape)
    with running_app(args, options.num_cpus, any_port=True) as app:
        wait_idle(app.base_url, args["admin_api_keys"][0])
        print(f"idle app: {options.seconds:g} s of /proc", file=sys.stderr)
        before = process_cpu_s()
        time.sleep(options.seconds)
        idle = cpu_used(before, process_cpu_s())
        print("offline beside the idle app", file=sys.stderr)
        before = process_cpu_s()
        beside = offline_tok_s(engine_config, shape)
        during = cpu_used(before, process_cpu_s())
    document: dict[str, Any] = {
        "config": options.config,
        "model": config.model.model,
        "num_cpus": options.num_cpus,
        "serve_env_vars": serve_env_vars(),
        "job": {"num_requests": shape.num_requests, "max_tokens": shape.max_tokens},
        "offline_alone": alone,
        "offline_beside_idle_app": beside,
        "beside_vs_alone": beside["tok_s"] / alone["tok_s"],
        "idle_seconds": options.seconds,
        "idle_cpu_s_by_process": idle,
        "idle_cpu_s": round(sum(idle.values()), 3),  # every process, this one included
        "cpu_s_by_process_beside": during,
    }
    options.json.write_text(json.dumps(document, indent=1))
    summary = {
        key: document[key]
        for key in ("serve_env_vars", "idle_seconds", "idle_cpu_s", "beside_vs_alone")
    }
    summary["offline_alone_tok_s"] = alone["tok_s"]
    summary["offline_beside_idle_app_tok_s"] = beside["tok_s"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
