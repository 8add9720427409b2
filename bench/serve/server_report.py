"""What the server measured during a bench run: pdserve's TTFT breakdown and unit cost.

After a run, `GET /v1/pdserve/stats?since=<run start>` gives the TTFT breakdown (p50/p90 of
queue, prefill, transfer, handover and first step, over the requests the run sent) and the
pools' $ per hour (`observability.cost` in the app's config, times the running replicas).
$ per request and per 1M tokens then come from those rates, the run's duration and the
tokens the client counted. Any other OpenAI-compatible server has no such endpoint: pass
`--usd-per-hour` for its cost; the breakdown is then reported as unavailable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx

from app.observability.cost import fleet_cost, unit_cost

STATS = "/v1/pdserve/stats"
PHASES = ("queue_ms", "prefill_ms", "transfer_ms", "handover_ms", "first_step_ms", "total_ms")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Options of the server-side part of a report."""
    parser.add_argument(
        "--admin-key", default=None, help="key for /v1/pdserve/stats (default: --api-key)"
    )
    parser.add_argument(
        "--usd-per-hour",
        type=float,
        default=None,
        help="the whole fleet's $/hour (default: the server's configured pool prices)",
    )


def fetch_stats(base_url: str, key: str | None, since: float, timeout_s: float = 30.0) -> dict:
    """pdserve's stats for requests finished since `since` (Unix s), or {"error": ...}."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(
            f"{base_url}{STATS}", params={"since": str(since)}, headers=headers, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code} from {STATS}"}
    data: dict = response.json()
    return data


def server_side(
    stats: dict[str, Any], summary: dict[str, Any], usd_per_hour: float | None
) -> dict[str, Any]:
    """The report's `server` section: TTFT breakdown and cost over the run."""
    breakdown = stats.get("ttft_breakdown") or {"error": stats.get("error", "not reported")}
    duration_s = float(summary["duration_s"])
    if usd_per_hour is not None:
        rates, roles, source = {"fleet": usd_per_hour}, {"fleet": "decode"}, "--usd-per-hour"
    elif "cost" in stats:
        rates, roles = stats["cost"]["usd_per_hour"], stats["cost"]["pool_roles"]
        source = "server config (observability.cost)"
    else:
        return {"ttft_breakdown": breakdown, "cost": {"error": "no prices: pass --usd-per-hour"}}
    prefill_usd, decode_usd = fleet_cost(rates, roles, duration_s)
    cost = unit_cost(
        prefill_usd,
        decode_usd,
        int(summary["num_completed"]),
        int(summary["num_input_tokens"]),
        int(summary["num_output_tokens"]),
    )
    return {
        "ttft_breakdown": breakdown,
        "cost": {"source": source, "usd_per_hour": rates, **cost},
    }


def print_server_side(server: dict[str, Any], file: Any = sys.stderr) -> None:
    """A short human-readable table of the `server` section."""
    breakdown = server["ttft_breakdown"]
    if "error" in breakdown:
        print(f"server TTFT breakdown: unavailable ({breakdown['error']})", file=file)
    else:
        print(
            f"server TTFT breakdown over {breakdown['num_requests']} requests "
            f"({breakdown['num_remote_prefill']} prefilled remotely), ms:",
            file=file,
        )
        for phase in PHASES:
            p50, p90 = breakdown[phase]["p50"], breakdown[phase]["p90"]
            if p50 is not None:
                print(f"  {phase[:-3]:<11} p50 {p50:9.2f}  p90 {p90:9.2f}", file=file)
    cost = server["cost"]
    if "error" in cost:
        print(f"cost: unavailable ({cost['error']})", file=file)
        return
    print(f"cost ({cost['source']}):", file=file)
    for label, key in (
        ("$ per request", "usd_per_request"),
        ("$ per 1M tokens", "usd_per_1m_tokens"),
        ("$ per 1M prompt tokens", "usd_per_1m_prompt_tokens"),
        ("$ per 1M generated tokens", "usd_per_1m_generated_tokens"),
    ):
        value = cost[key]
        print(f"  {label:<26} {'n/a' if value is None else f'{value:.6g}'}", file=file)
