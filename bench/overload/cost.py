"""`python -m bench.overload.cost`: CPU time per request of the front door, by process.

What one request costs the Serve HTTP proxy, the ingress replica, the other Serve
processes and the load generator itself (`bench.overload.load.send`, the client `pdserve bench
overload` uses), for the two kinds of request a `bench overload` run is made of:

- `reject`: a request refused with 429 by its tenant's rate quota (a tenant `capped` with
  `requests_per_second` close to 0 is added to the config; its first request uses the burst,
  every later one is refused after the ingress's quota check, like the batch tenant's
  `tenant_queue_full` refusals in the overload run);
- `stream`: a streamed completion of `--max-tokens` tokens (default 32, `ignore_eos`) of a
  `--prompt-tokens` prompt (default 128) by the config's interactive tenant.

Each path sends `--requests` requests, `--concurrency` at a time, after a warm-up, and reads
the CPU time (user + system) of this process and of the private Ray instance it started
before and after, by role (`bench.serve.cpu`: `proxy`, each deployment, `ray` for Ray's and
Serve's other processes, `client` for this one). CPU time is
far less noisy than wall time on a shared host; it still includes whatever else a process
did meanwhile (Serve's health checks and metrics pushes: small next to these figures). The
load generator (`client`) is this process, which is also the Ray driver: its figure
includes the driver's own threads, so it is an upper bound of the client's cost.

    python -m bench.overload.cost --config cpu-tenants --requests 300 --json out.json

prints one JSON object: per path, CPU ms per request by process role, and the requests'
outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.overload.load import client_session, send
from bench.overload.plan import ClassPlan, class_plans
from bench.overload.report import ClassSLO, Record
from bench.serve import cpu
from bench.serve.deploy import RunningApp, add_app_arguments, app_args, free_port, running_app
from bench.serve.workloads import make_prompt

CAPPED_KEY = "sk-capped-overload-cost"


def with_capped_tenant(args: dict[str, Any]) -> dict[str, Any]:
    """`args` plus a tenant `capped` whose every request after the first is refused (429)."""
    capped = {
        "name": "capped",
        "api_keys": [CAPPED_KEY],
        "quota": {"requests_per_second": 0.0001, "request_burst": 1},
    }
    return {**args, "tenants": [*(args.get("tenants") or []), capped]}


async def _drive(
    app: RunningApp, plan: ClassPlan, prompts: Sequence[str], concurrency: int
) -> list[Record]:
    url = f"{app.base_url}/v1/completions"
    records = [Record(i, plan.name, 0.0) for i in range(len(prompts))]
    gate = asyncio.Semaphore(concurrency)
    async with client_session() as session:
        t0 = time.monotonic()

        async def one(prompt: str, record: Record) -> None:
            async with gate:
                await send(session, url, app.model_name, plan, prompt, record, 60.0, 90.0, t0)

        await asyncio.gather(*(one(p, r) for p, r in zip(prompts, records, strict=True)))
    return records


def measure(
    app: RunningApp, plan: ClassPlan, num_requests: int, concurrency: int, seed: int
) -> dict[str, Any]:
    """CPU ms per request by process while `num_requests` of `plan` are sent."""
    rng = np.random.default_rng(seed)
    warm = [make_prompt(plan.prompt_tokens, rng) for _ in range(max(4, concurrency))]
    asyncio.run(_drive(app, plan, warm, concurrency))
    prompts = [make_prompt(plan.prompt_tokens, rng) for _ in range(num_requests)]
    before, wall = cpu.cpu_times(), time.monotonic()
    records = asyncio.run(_drive(app, plan, prompts, concurrency))
    after, wall = cpu.cpu_times(), time.monotonic() - wall
    outcomes: dict[str, int] = {}
    for r in records:
        key = f"{r.outcome} {r.status}" + (f" {r.code}" if r.code else "")
        outcomes[key] = outcomes.get(key, 0) + 1
    return {
        "requests": num_requests,
        "concurrency": concurrency,
        "wall_s": round(wall, 2),
        "outcomes": outcomes,
        **cpu.usage(before, after, num_requests, wall),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overload.cost", description=__doc__)
    add_app_arguments(parser, "cpu-tenants")
    parser.add_argument("--requests", type=int, default=300, help="per path")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--paths", default="reject,stream", help="comma list: reject, stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    options = parser.parse_args(argv)
    args = with_capped_tenant(app_args(options.config, options.model, options.dtype, free_port()))
    options.classes, options.interactive_prompt_tokens = ["interactive"], options.prompt_tokens
    options.interactive_max_tokens = options.max_tokens
    interactive = class_plans(args, options)[0]
    slo = ClassSLO(interactive.slo.ttft_s, interactive.slo.tpot_s)
    plans = {
        "stream": interactive,
        "reject": ClassPlan(
            "capped", "capped", CAPPED_KEY, options.prompt_tokens, options.max_tokens, slo
        ),
    }
    paths = [p.strip() for p in options.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(plans):
        parser.error("--paths: a comma list of reject, stream")
    result: dict[str, Any] = {"config": options.config, "loadavg_before": os.getloadavg()}
    with running_app(args, options.num_cpus) as app:
        for path in paths:
            result[path] = measure(
                app, plans[path], options.requests, options.concurrency, options.seed
            )
            print(f"{path}: {json.dumps(result[path])}", file=sys.stderr)
    result["loadavg_after"] = os.getloadavg()
    if options.json is not None:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
