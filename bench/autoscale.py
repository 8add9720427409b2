"""`pdserve bench autoscale`: a load ramp (low -> 4x -> low) against an autoscaling config.

The config (`configs/<name>.yaml`, default `cpu-autoscale`) is deployed on a private Ray
instance (`bench.serve_app`). Requests (streamed greedy completions of `--prompt-tokens`
prompt tokens and `--max-tokens` output tokens) arrive as a Poisson process whose rate
follows the ramp: `--low-s` at `--rate`, `--ramp-s` up to `--peak` x the rate, `--peak-s`
there, `--ramp-s` down, `--low-s` at `--rate` again. Every `--sample-s` the running replicas
of each pool are read from Serve; after the load, the pools get `--settle-s` to scale back
to their minimum. Every request that did not complete (HTTP error, error event, cut stream,
timeout) counts as `failed`: the goal is 0, as scaling (starting, draining, stopping
replicas) must never fail a request.

Prints a timeline (offered rate, replicas per pool, TTFT/TPOT p50/p90 per window) and the
summary; writes JSON (`max_replicas` and `final_replicas` per pool, `failed`, the timeline,
every request) and a plot beside it (`.png`).

    pdserve bench autoscale --config cpu-autoscale --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.metrics import finite_or_none, percentile
from bench.serve_app import RunningApp, add_app_arguments, app_args, free_port, running_app


@dataclass(frozen=True, slots=True)
class Ramp:
    """Offered load over time: low, ramp up to `peak` x, hold, ramp down, low."""

    rate: float  # requests/s at low load
    peak: float
    low_s: float
    ramp_s: float
    peak_s: float

    @property
    def duration_s(self) -> float:
        return 2 * self.low_s + 2 * self.ramp_s + self.peak_s

    def rate_at(self, t: float) -> float:
        """Requests/s at `t` seconds from the start (0 after the end)."""
        high = self.rate * self.peak
        up_end = self.low_s + self.ramp_s
        down_start = up_end + self.peak_s
        if t < 0 or t >= self.duration_s:
            return 0.0
        if t < self.low_s:
            return self.rate
        if t < up_end:
            return self.rate + (high - self.rate) * (t - self.low_s) / self.ramp_s
        if t < down_start:
            return high
        if t < down_start + self.ramp_s:
            return high - (high - self.rate) * (t - down_start) / self.ramp_s
        return self.rate


@dataclass(slots=True)
class Record:
    """One request: when it was sent (s from the start) and how it ended."""

    sent_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_tokens: int = 0
    ok: bool = False
    error: str | None = None


def arrival_times(ramp: Ramp, seed: int) -> list[float]:
    """Poisson arrivals following `ramp.rate_at` (thinning of a peak-rate process)."""
    rng = random.Random(seed)
    peak_rate = ramp.rate * max(ramp.peak, 1.0)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= ramp.duration_s:
            return times
        if rng.random() < ramp.rate_at(t) / peak_rate:
            times.append(t)


async def send(
    client: httpx.AsyncClient, body: dict[str, Any], record: Record, start: float, timeout_s: float
) -> None:
    """Stream one completion into `record`."""
    first: float | None = None
    sent = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = (
                        f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    )
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        record.ok = record.error is None
                        break
                    event = json.loads(data)
                    if "error" in event:
                        record.error = str(event["error"].get("message"))[:200]
                    if any(c.get("text") for c in event.get("choices") or []):
                        first = first or time.monotonic()
                        record.num_tokens += 1
                else:
                    record.error = "stream ended without [DONE]"
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = repr(exc)[:200]
    finally:
        end = time.monotonic()
        record.end_s = end - start
        if first is not None:
            record.ttft_s = first - sent
            if record.num_tokens > 1:
                record.tpot_s = (end - first) / (record.num_tokens - 1)


def running_replicas(app_name: str, pools: Sequence[str]) -> dict[str, int]:
    """RUNNING replicas of each pool, as Serve reports them now."""
    from ray import serve

    status = serve.status().applications.get(app_name)
    counts = {pool: 0 for pool in pools}
    if status is None:
        return counts
    for name in pools:
        deployment = status.deployments.get(name)
        if deployment is not None:
            states = deployment.replica_states.items()
            counts[name] = sum(n for state, n in states if state == "RUNNING")
    return counts


class Bench:
    """Runs the ramp against `app` while sampling each pool's replicas."""

    def __init__(self, app: RunningApp, app_name: str, pools: list[str], args: argparse.Namespace):
        self.app, self.app_name, self.pools, self.args = app, app_name, pools, args
        self.ramp = Ramp(args.rate, args.peak, args.low_s, args.ramp_s, args.peak_s)
        self.records: list[Record] = []
        self.samples: list[dict[str, Any]] = []
        self.start = 0.0

    async def run(self) -> None:
        self.start = time.monotonic()
        body = {
            "model": self.app.model_name,
            "prompt": "x" * self.args.prompt_tokens,  # byte-level tokenizer: 1 token each
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=self.app.base_url, limits=limits) as client:
            sampler = asyncio.create_task(self._sample_until(None))
            tasks = []
            for at in arrival_times(self.ramp, self.args.seed):
                await asyncio.sleep(max(0.0, self.start + at - time.monotonic()))
                record = Record(sent_s=time.monotonic() - self.start)
                self.records.append(record)
                tasks.append(
                    asyncio.create_task(
                        send(client, body, record, self.start, self.args.request_timeout)
                    )
                )
            await asyncio.gather(*tasks)
            if sampler.done():
                sampler.result()  # the sampler failed: raise its error
            sampler.cancel()
            await self._sample_until(self._settled)

    def _settled(self, counts: dict[str, int]) -> bool:
        return all(counts[pool] <= self.args.min_replicas[pool] for pool in self.pools)

    async def _sample_until(self, done: Any) -> None:
        """Sample every `--sample-s`; with `done`, stop once `done(counts)` or `--settle-s`."""
        deadline = time.monotonic() + self.args.settle_s
        while True:
            counts = await asyncio.to_thread(running_replicas, self.app_name, self.pools)
            now = time.monotonic() - self.start
            self.samples.append({"t_s": now, "rate": self.ramp.rate_at(now), **counts})
            if done is not None and (done(counts) or time.monotonic() > deadline):
                return
            await asyncio.sleep(self.args.sample_s)


def timeline(bench: Bench, window_s: float) -> list[dict[str, Any]]:
    """Per window: offered rate, most replicas per pool, TTFT/TPOT p50/p90 (ms) of requests
    sent in it."""
    end = max([s["t_s"] for s in bench.samples] + [r.end_s for r in bench.records] + [0.0])
    rows = []
    t = 0.0
    while t < end:
        sent = [r for r in bench.records if t <= r.sent_s < t + window_s and r.ok]
        samples = [s for s in bench.samples if t <= s["t_s"] < t + window_s]
        row: dict[str, Any] = {"t_s": t, "rate": bench.ramp.rate_at(t + window_s / 2)}
        for pool in bench.pools:
            row[pool] = max((s[pool] for s in samples), default=None)
        for name, values in (
            ("ttft", [r.ttft_s for r in sent if r.ttft_s is not None]),
            ("tpot", [r.tpot_s for r in sent if r.tpot_s is not None]),
        ):
            for p in (50, 90):
                row[f"{name}_p{p}_ms"] = percentile(values, p) * 1000 if values else None
        rows.append(row)
        t += window_s
    return rows


def plot(bench: Bench, rows: list[dict[str, Any]], path: Path) -> str:
    """Replicas per pool and offered rate over time, above TTFT/TPOT p90 per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    times = [s["t_s"] for s in bench.samples]
    for pool in bench.pools:
        top.step(times, [s[pool] for s in bench.samples], where="post", label=f"{pool} replicas")
    top.set_ylabel("replicas")
    rate_axis = top.twinx()
    rate_axis.plot(times, [s["rate"] for s in bench.samples], color="gray", ls=":", label="rate")
    rate_axis.set_ylabel("offered requests/s")
    top.legend(loc="upper left")
    mids = [row["t_s"] for row in rows]
    for key in ("ttft_p90_ms", "tpot_p90_ms", "ttft_p50_ms", "tpot_p50_ms"):
        bottom.plot(mids, [row[key] for row in rows], marker=".", label=key)
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds from start")
    bottom.set_ylabel("ms")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def summarize(bench: Bench) -> dict[str, Any]:
    """`max_replicas` / `final_replicas` per pool, `failed` and the latency overall."""
    final = bench.samples[-1] if bench.samples else {}
    failed = [r for r in bench.records if not r.ok]
    ok = [r for r in bench.records if r.ok]
    return {
        "requests": len(bench.records),
        "failed": len(failed),
        "failures": sorted({r.error or "?" for r in failed})[:20],
        "max_replicas": {p: max((s[p] for s in bench.samples), default=0) for p in bench.pools},
        "final_replicas": {p: final.get(p, 0) for p in bench.pools},
        "min_replicas": bench.args.min_replicas,
        "ttft_p90_ms": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 90) * 1000,
        "tpot_p90_ms": percentile([r.tpot_s for r in ok if r.tpot_s is not None], 90) * 1000,
    }


def human(summary: dict[str, Any], rows: list[dict[str, Any]], pools: list[str]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.0f}" if isinstance(value, float) else str(value)

    header = ["t_s", "rate", *pools, "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"]
    lines = ["  ".join(f"{h:>9}" for h in header)]
    for row in rows:
        values = [row["t_s"], f"{row['rate']:.1f}", *(row[p] for p in pools)]
        values += [row[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")]
        lines.append("  ".join(f"{cell(v):>9}" for v in values))
    lines.append(
        f"requests {summary['requests']}, failed {summary['failed']}; replicas max "
        f"{summary['max_replicas']}, final {summary['final_replicas']}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench autoscale",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-autoscale")
    parser.add_argument("--rate", type=float, default=1.0, help="low load, requests/s")
    parser.add_argument("--peak", type=float, default=4.0, help="peak load = rate x this")
    parser.add_argument("--low-s", type=float, default=30.0, help="seconds at low load, each end")
    parser.add_argument("--ramp-s", type=float, default=20.0, help="seconds of each ramp")
    parser.add_argument("--peak-s", type=float, default=60.0, help="seconds at peak load")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=1.0, help="replica sampling period")
    parser.add_argument("--settle-s", type=float, default=120.0, help="wait for scale-down")
    parser.add_argument("--window-s", type=float, default=10.0, help="timeline window")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    from app.config import load_config

    config_args = app_args(args.config, args.model, args.dtype, free_port())
    config = load_config(config_args)
    pools = [pool.name for pool in config.pools]
    args.min_replicas = {
        pool.name: pool.autoscaling.min_replicas if pool.autoscaling else pool.num_replicas
        for pool in config.pools
    }
    with running_app(config_args, args.num_cpus) as app:
        bench = Bench(app, config.app_name, pools, args)
        asyncio.run(bench.run())
    rows = timeline(bench, args.window_s)
    summary = {"config": args.config, "model": app.model_name, **summarize(bench)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary["plot"] = plot(bench, rows, args.json.with_suffix(".png"))
    document = {
        **summary,
        "ramp": asdict(bench.ramp),
        "timeline": rows,
        "samples": bench.samples,
        "records": [asdict(r) for r in bench.records],
    }
    args.json.write_text(json.dumps(finite_or_none(document), indent=1) + "\n")
    print(human(summary, rows, pools), file=sys.stderr)
    print(json.dumps(finite_or_none(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
