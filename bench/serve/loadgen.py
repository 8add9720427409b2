"""The load generator, and `pdserve bench serve`: one run at one rate against any
OpenAI-compatible endpoint.

Each request is a streaming `POST /v1/completions` (httpx, async) sent at its scheduled
offset, with `ignore_eos: true` (a vLLM/pdserve extension) so outputs have the requested
length, `temperature: 0`, and `stream_options.include_usage` so the server's token counts
are recorded. Every streamed chunk is timestamped on arrival (chunks may carry several
tokens; token counts come from the usage chunk). An optional concurrency cap
delays sends (the delay shows as `start_s - arrival_s` in the records; latencies are
measured from the actual send, as `vllm bench serve` does).

    pdserve bench serve --url http://127.0.0.1:8000 --workload mixed --rate 2 --duration 60 \
        --slo-ttft 2000 --slo-tpot 100 --json out.json

writes the summary, per-label breakdown and per-request records to `out.json`; the last
stdout line is the summary as one JSON object. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.serve.metrics import (
    SLO,
    RequestRecord,
    finite_or_none,
    prefill_interference,
    route_breakdown,
    summarize,
)
from bench.serve.server_report import add_server_args, fetch_stats, print_server_side, server_side
from bench.serve.sse import stream_completion
from bench.serve.workloads import (
    ScheduledRequest,
    add_workload_args,
    describe_workload,
    requests_from_args,
)

logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send requests."""

    base_url: str  # scheme://host:port, without /v1
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True
    admin_key: str | None = None  # for pdserve's stats (default: api_key)
    usd_per_hour: float | None = None  # the fleet's price (default: the server's config)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class RunResult:
    """All records of one run and its wall time (first send to last response)."""

    records: list[RequestRecord]
    duration_s: float
    started_at: float = 0.0  # Unix time the clock started (after the warm-up)


def normalize_base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all mean the server at `http://h:p`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id `GET /v1/models` lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _send(
    client: httpx.AsyncClient, target: Target, request: ScheduledRequest, t0: float
) -> RequestRecord:
    spec = request.spec
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    record = RequestRecord(
        index=request.index,
        label=spec.label,
        input_len=spec.input_len,
        max_tokens=spec.max_tokens,
        arrival_s=request.arrival_s,
        start_s=time.perf_counter() - t0,
    )
    streamed = await stream_completion(client, body, t0, target.headers())
    record.route, record.error = streamed.route, streamed.error
    record.first_token_s, record.chunk_times_s = streamed.first_token_s, streamed.chunk_times_s
    if record.error is not None:
        return record
    record.end_s = streamed.end_s
    usage = streamed.usage
    if usage is not None:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        record.output_tokens = len(record.chunk_times_s)
    record.success = bool(record.chunk_times_s)
    if not record.success:
        record.error = "stream ended without tokens"
    return record


async def run_load(
    target: Target,
    requests: Sequence[ScheduledRequest],
    concurrency: int | None = None,
    warmup: int = 0,
    progress: bool = True,
    desc: str = "requests",
) -> RunResult:
    """Replay `requests` at their offsets; at most `concurrency` in flight if set.

    `warmup` requests (copies of the first one) run one after another before the clock
    starts and are not recorded.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=target.base_url, limits=limits, timeout=timeout
    ) as client:
        for _ in range(warmup if requests else 0):
            await _send(client, target, requests[0], time.perf_counter())
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        bar = tqdm(total=len(requests), desc=desc, file=sys.stderr, disable=not progress)
        started_at = time.time()
        t0 = time.perf_counter()

        async def one(request: ScheduledRequest) -> RequestRecord:
            delay = request.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                record = await _send(client, target, request, t0)
            else:
                async with gate:
                    record = await _send(client, target, request, t0)
            bar.update(1)
            return record

        try:
            records = await asyncio.gather(*(one(r) for r in requests))
        finally:
            bar.close()
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) if ends else time.perf_counter() - t0
    return RunResult(sorted(records, key=lambda r: r.index), duration, started_at)


def run_load_sync(
    target: Target,
    requests: Sequence[ScheduledRequest],
    concurrency: int | None = None,
    warmup: int = 0,
    progress: bool = True,
    desc: str = "requests",
) -> RunResult:
    """`run_load` from synchronous code (its own event loop)."""
    return asyncio.run(run_load(target, requests, concurrency, warmup, progress, desc))


def run_report(result: RunResult, slo: SLO, target: Target | None = None) -> dict[str, Any]:
    """Summary, interference and route breakdowns and records of one run, JSON-ready; with `target`,
    also what the server measured over the run (`bench/serve/server_report.py`)."""
    summary = summarize(result.records, result.duration_s, slo)
    report: dict[str, Any] = {
        "summary": summary,
        "interference": prefill_interference(result.records),
        "routes": route_breakdown(result.records, slo),
        "records": [r.to_dict() for r in result.records],
    }
    if target is not None:
        # Since the clock started (after the warm-up): the server's view of the recorded run.
        key = target.admin_key or target.api_key
        stats = fetch_stats(target.base_url, key, result.started_at)
        report["server"] = server_side(stats, summary, target.usd_per_hour)
    return finite_or_none(report)


# ------------------------------------------------------------------------------ command line


def add_target_args(parser: argparse.ArgumentParser, url_required: bool = True) -> None:
    """Endpoint, load and SLO options shared by `bench serve` and `bench goodput`."""
    parser.add_argument("--url", required=url_required, help="server base URL (with or w/o /v1)")
    parser.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded requests first")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar on stderr")
    parser.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms")
    parser.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in ms")
    add_server_args(parser)


def target_from_args(args: argparse.Namespace) -> Target:
    """The `Target` the options name, asking the server for its model if not given."""
    base_url = normalize_base_url(args.url)
    model = args.model or discover_model(base_url, args.api_key)
    return Target(
        base_url,
        model,
        args.api_key,
        args.timeout,
        admin_key=args.admin_key,
        usd_per_hour=args.usd_per_hour,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--rate", type=float, default=None, help="requests/s (not for trace)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--json", type=Path, default=None, help="write everything here")
    add_workload_args(parser)
    args = parser.parse_args(argv)

    target = target_from_args(args)
    requests = requests_from_args(args, args.rate, args.duration)
    result = run_load_sync(
        target, requests, args.concurrency, args.warmup, not args.no_progress, "bench serve"
    )
    report = run_report(result, SLO(args.slo_ttft, args.slo_tpot), target)
    server = report["server"]
    print_server_side(server)
    run = {
        "url": target.base_url,
        "model": target.model,
        "rate": args.rate,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        **describe_workload(args),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"run": run, **report}, indent=1) + "\n")
    summary = {k: v for k, v in report["summary"].items() if k != "by_label"}
    print(json.dumps({"rate": args.rate, **summary, "server": server}))
    return 0 if report["summary"]["num_completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
