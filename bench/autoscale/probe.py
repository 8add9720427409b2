"""The capacity probes of `pdserve bench autoscale`: what the config's minimum fleet takes of
each stressing request shape, measured on this machine before the ramp, and the ramp's rates
derived from it (`bench/autoscale/plan.py` says how and why).

The config is deployed with every pool fixed at its minimum replicas (so nothing scales
while it is measured), on a private Ray instance torn down before the ramp's own deployment.
Each probe is closed-loop (`bench/serve/capacity.py`) with the ramp's own requests
(`bench.autoscale.load`), every prompt new to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.autoscale.load import Record, Shape, request_body, send
from bench.autoscale.plan import (
    RampRates,
    decode_peak,
    decode_probe_concurrency,
    fixed_at_minimum,
    ramp_rates,
)
from bench.serve.capacity import LoadPoint, Send, closed_loop, find_saturation
from bench.serve.deploy import RunningApp, running_app


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """What the decode probe aims for: the pool, the concurrency its search starts from (the
    pool's target of running sequences on its minimum replicas), the running sequences the
    peak should hold, and the headers that may read `/v1/pdserve/stats`."""

    pool: str
    first_concurrency: int
    running: float
    headers: dict[str, str]


PROBE_WARMUP_S = 2.0  # a fresh fleet's first requests are cold: not counted
RUNNING_SAMPLE_S = 0.5  # how often the decode probe reads the decode pool's running sequences


async def decode_running(client: httpx.AsyncClient, pool: str, headers: dict[str, str]) -> float:
    """The sequences the decode `pool` (one replica: the probe fleet's minimum) runs now, as
    `/v1/pdserve/stats` reports them (the occupancy its autoscaling signal is read from)."""
    response = await client.get("/v1/pdserve/stats", headers=headers)
    response.raise_for_status()
    return float(response.json()["pools"][pool].get("num_running", 0))


async def measure_peaks(
    app: RunningApp,
    stressing: dict[str, Shape],
    decode: DecodeTarget | None,
    args: argparse.Namespace,
) -> tuple[dict[str, float], dict[str, Any]]:
    """A closed-loop saturation search (`bench.serve.capacity`) per stressing shape against `app`,
    each request a prompt of its own; with `decode`, the decode search starts at its target
    and reads the pool's running sequences at every point. (Peak rate per role, what each
    probe measured.)"""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    timeout = httpx.Timeout(args.request_timeout)
    peaks: dict[str, float] = {}
    record: dict[str, Any] = {}
    sent = 0  # requests so far: the next point's first index (its prompts' prefix)
    async with httpx.AsyncClient(base_url=app.base_url, limits=limits, timeout=timeout) as client:
        for role, shape in stressing.items():
            tracked = decode if role == "decode" else None
            running: list[float] = []  # per point: the decode pool's mean running sequences

            async def one(index: int, shape: Shape = shape) -> bool:
                request = Record(0.0, "probe", shape.prompt_tokens, shape.max_tokens)
                body = request_body(app.model_name, shape, index)
                await send(client, body, request, time.monotonic(), args.request_timeout)
                return request.ok

            async def sample(into: list[float], tracked: DecodeTarget) -> None:
                await asyncio.sleep(PROBE_WARMUP_S)
                closes = time.monotonic() + args.probe_s
                while time.monotonic() < closes:
                    into.append(await decode_running(client, tracked.pool, tracked.headers))
                    await asyncio.sleep(RUNNING_SAMPLE_S)

            async def point(
                concurrency: int,
                one: Send = one,
                role: str = role,
                tracked: DecodeTarget | None = tracked,
                running: list[float] = running,
            ) -> LoadPoint:
                nonlocal sent
                samples: list[float] = []
                sampler = asyncio.create_task(sample(samples, tracked)) if tracked else None
                result = await closed_loop(one, concurrency, args.probe_s, PROBE_WARMUP_S, sent)
                if sampler is not None:
                    await sampler
                    running.append(sum(samples) / len(samples) if samples else 0.0)
                sent += result.sent
                print(
                    f"probe {role}: {concurrency} in flight, {result.throughput:.2f} req/s "
                    f"({result.failed} failed)"
                    + (f", {running[-1]:.1f} running" if tracked else ""),
                    file=sys.stderr,
                )
                return result

            first = tracked.first_concurrency if tracked else 1
            capacity = await find_saturation(point, start=first, max_concurrency=max(16, 8 * first))
            record[role] = capacity.to_dict()
            if tracked is None:
                peaks[role] = args.load * capacity.requests_per_s
                record[role]["method"] = (
                    "closed loop from 1 in flight, doubled until the throughput gains < 10% "
                    f"twice in a row; capacity = the best throughput, peak = {args.load:g} x it"
                )
            else:
                measured = [
                    (r, p.throughput) for r, p in zip(running, capacity.points, strict=True)
                ]
                peaks[role] = decode_peak(
                    measured, tracked.running, capacity.requests_per_s, args.load
                )
                record[role]["method"] = (
                    f"closed loop from {first} in flight (the decode pool's target), doubled "
                    "until the throughput gains < 10% twice in a row, reading the pool's "
                    "running sequences at each point; peak = the rate at which it runs "
                    f"{tracked.running:g} ({args.decode_overshoot:g} x its target), "
                    f"interpolated, at most {args.load:g} x the best throughput"
                )
                record[role]["running"] = running
                record[role]["target_running"] = tracked.running
            record[role]["peak"] = peaks[role]
    return peaks, record


def measure_rates(
    config_args: dict[str, Any], stressing: dict[str, Shape], args: argparse.Namespace
) -> tuple[RampRates, dict[str, Any]]:
    """Deploy the config at its minimum fleet, probe each stressed role's shape and size the
    ramp from what it takes (`bench.autoscale.plan`); (rates, the probes' record)."""
    from app.config import load_config

    config = load_config(config_args)
    probe_args, fleet = fixed_at_minimum(config_args)
    pool = next((p for p in config.pools if p.role == "decode"), None)
    target = pool.autoscaling.target_running_seqs if pool and pool.autoscaling else None
    decode = None
    if pool is not None and target is not None:
        keys = sorted(config.resolve_admin_keys())
        decode = DecodeTarget(
            pool.name,
            first_concurrency=decode_probe_concurrency(target, fleet[pool.name], 1.0),
            running=args.decode_overshoot * target * fleet[pool.name],
            headers={"Authorization": f"Bearer {keys[0]}"} if keys else {},
        )
    with running_app(probe_args, args.num_cpus) as app:
        peaks, record = asyncio.run(measure_peaks(app, stressing, decode, args))
    return ramp_rates(peaks, args.low_load), {"fleet": fleet, **record}
