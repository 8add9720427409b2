"""The capacity probes of `pdserve bench autoscale`: what the config's minimum fleet takes of
each stressing request shape, measured on this machine before the ramp, and the ramp's rates
derived from it (`bench/autoscale_plan.py` says how and why).

The config is deployed with every pool fixed at its minimum replicas (so nothing scales
while it is measured), on a private Ray instance torn down before the ramp's own deployment.
Each probe is closed-loop (`bench/capacity.py`) with the ramp's own requests
(`bench.autoscale_load`), every prompt new to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import httpx

from bench.autoscale_load import Record, Shape, request_body, send
from bench.autoscale_plan import RampRates, decode_probe_concurrency, fixed_at_minimum, ramp_rates
from bench.capacity import LoadPoint, Send, closed_loop, find_saturation
from bench.serve_app import RunningApp, running_app

PROBE_WARMUP_S = 2.0  # a fresh fleet's first requests are cold: not counted


async def measure_peaks(
    app: RunningApp,
    stressing: dict[str, Shape],
    decode_concurrency: int | None,
    args: argparse.Namespace,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Closed-loop probes (`bench.capacity`) of each stressing shape against `app`, each
    request a prompt of its own; (peak rate per role, what each probe measured). Decode with
    `decode_concurrency`: one point at that many in flight; otherwise a saturation search."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    timeout = httpx.Timeout(args.request_timeout)
    peaks: dict[str, float] = {}
    record: dict[str, Any] = {}
    sent = 0  # requests so far: the next point's first index (its prompts' prefix)
    async with httpx.AsyncClient(base_url=app.base_url, limits=limits, timeout=timeout) as client:
        for role, shape in stressing.items():

            async def one(index: int, shape: Shape = shape) -> bool:
                request = Record(0.0, "probe", shape.prompt_tokens, shape.max_tokens)
                body = request_body(app.model_name, shape, index)
                await send(client, body, request, time.monotonic(), args.request_timeout)
                return request.ok

            async def point(concurrency: int, one: Send = one, role: str = role) -> LoadPoint:
                nonlocal sent
                result = await closed_loop(one, concurrency, args.probe_s, PROBE_WARMUP_S, sent)
                sent += result.sent
                print(
                    f"probe {role}: {concurrency} in flight, {result.throughput:.2f} req/s "
                    f"({result.failed} failed)",
                    file=sys.stderr,
                )
                return result

            if role == "decode" and decode_concurrency is not None:
                measured = await point(decode_concurrency)
                peaks[role] = measured.throughput
                record[role] = {
                    "method": f"closed loop at {decode_concurrency} in flight: "
                    f"{args.decode_overshoot:g} x the decode pool's target_running_seqs x its "
                    "minimum replicas; the throughput holds that many (Little's law)",
                    "requests_per_s": measured.throughput,
                    "points": [measured.to_dict()],
                }
            else:
                capacity = await find_saturation(point, max_concurrency=16)
                peaks[role] = args.prefill_load * capacity.requests_per_s
                record[role] = {
                    "method": "closed-loop saturation: concurrency doubled from 1 until the "
                    "throughput gains < 10%; capacity = the best throughput",
                    **capacity.to_dict(),
                }
    return peaks, record


def measure_rates(
    config_args: dict[str, Any], stressing: dict[str, Shape], args: argparse.Namespace
) -> tuple[RampRates, dict[str, Any]]:
    """Deploy the config at its minimum fleet, probe each stressed role's shape and size the
    ramp from what it takes (`bench.autoscale_plan`); (rates, the probes' record)."""
    from app.config import load_config

    probe_args, fleet = fixed_at_minimum(config_args)
    decode = next((p for p in load_config(config_args).pools if p.role == "decode"), None)
    target = decode.autoscaling.target_running_seqs if decode and decode.autoscaling else None
    concurrency = None
    if decode is not None and target is not None:
        concurrency = decode_probe_concurrency(target, fleet[decode.name], args.decode_overshoot)
    with running_app(probe_args, args.num_cpus) as app:
        peaks, record = asyncio.run(measure_peaks(app, stressing, concurrency, args))
    return ramp_rates(peaks, args.low_load), {"fleet": fleet, **record}
