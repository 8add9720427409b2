"""The load of `pdserve bench overload`: its HTTP client, one streamed completion read into a
`Record`, and a phase of arrivals sent at their times.

`send` is also what `python -m bench.overload.cost` measures the client's own CPU time with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm

from bench.overload.plan import Arrival, ClassPlan
from bench.overload.report import Record, classify
from bench.serve.deploy import RunningApp


def client_session() -> aiohttp.ClientSession:
    """The load generator's HTTP client (aiohttp, which ray[serve] brings: about a quarter
    of httpx's CPU per streamed request): no connection limit, 30 s to connect, no other
    timeout (each request has its own, `send`'s `hung_after_s`)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
    )


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    plan: ClassPlan,
    prompt: str,
    record: Record,
    request_timeout_s: float,
    hung_after_s: float,
    t0: float,
) -> None:
    """Stream one completion from `url` (the server's `/v1/completions`) into `record`
    (outcome, status, code, Retry-After, latencies).

    The stream is read as raw bytes and scanned, not parsed: at 3x overload this client
    shares the host's cores with the server, so it must cost little per event. TTFT is
    taken when the bytes holding the first non-empty `text` arrive; only the usage chunk
    and error events are decoded as JSON (`SSEScanner`).
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {
        "Authorization": f"Bearer {plan.api_key}",
        "x-pdserve-timeout": f"{request_timeout_s:g}",
    }
    sent = time.monotonic()
    scanner = SSEScanner()
    try:
        async with asyncio.timeout(hung_after_s):
            async with session.post(url, json=body, headers=headers) as response:
                record.status = response.status
                if response.status != 200:
                    raw = await response.read()
                    record.outcome = classify(response.status, streamed_tokens=False)
                    record.retry_after = response.headers.get("retry-after")
                    record.code, record.error = _error_fields(raw)
                    return
                async for chunk in response.content.iter_any():
                    if scanner.feed(chunk, time.monotonic()):
                        break
                record.code, record.error = scanner.code, scanner.error
                if scanner.done:
                    record.outcome = "ok" if record.error is None else "error"
                else:
                    record.outcome, record.error = "error", "stream ended without [DONE]"
    except (aiohttp.ClientError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        # (before TimeoutError: aiohttp's connect timeout is both, and is not a hang)
        record.outcome, record.error = "error", repr(exc)[:200]
    except TimeoutError:
        record.outcome, record.error = "hung", f"no end within {hung_after_s:g} s"
    finally:
        record.end_s = time.monotonic() - t0
        record.num_tokens = scanner.num_tokens
        if scanner.first_at is not None:
            record.ttft_s = scanner.first_at - sent
            if scanner.last_at is not None and record.num_tokens > 1:
                record.tpot_s = (scanner.last_at - scanner.first_at) / (record.num_tokens - 1)


class SSEScanner:
    """Reads a completions event stream from raw bytes with as little work as possible.

    Events are split on the blank line that ends them. An event with a non-empty `text`
    is content: `"text":"` followed by anything but `"` (a quote inside a JSON string is
    always escaped, so these bytes only ever match the key). Only events holding an
    `"error"` key or a `"usage":{` object are decoded. `feed` returns True at `[DONE]`.
    """

    __slots__ = ("_pending", "code", "done", "error", "first_at", "last_at", "num_tokens")

    def __init__(self) -> None:
        self._pending = b""
        self.first_at: float | None = None  # arrival of the first content bytes
        self.last_at: float | None = None  # arrival of the last content bytes
        self.num_tokens = 0  # the usage chunk's completion_tokens
        self.code: str | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, chunk: bytes, now: float) -> bool:
        """Scan `chunk`, which arrived at `now`; True once `data: [DONE]` was seen."""
        *events, self._pending = (self._pending + chunk).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                self.done = True
                return True
            at = event.find(b'"text":"')
            if at >= 0 and event[at + 8 : at + 9] != b'"':
                self.last_at = now
                if self.first_at is None:
                    self.first_at = now
            if b'"error"' in event:
                error = json.loads(event[6:]).get("error") or {}
                self.code = error.get("code")
                self.error = str(error.get("message"))[:200]
            elif b'"usage":{' in event:
                usage = json.loads(event[6:])["usage"]
                self.num_tokens = int(usage.get("completion_tokens") or 0)
        return False


def _error_fields(raw: bytes) -> tuple[str | None, str]:
    try:
        error = json.loads(raw)["error"]
        return error.get("code"), str(error.get("message"))[:200]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, raw[:200].decode(errors="replace")


async def run_phase(
    app: RunningApp,
    plans: Sequence[ClassPlan],
    plan_arrivals: Sequence[Arrival],
    options: argparse.Namespace,
    desc: str,
    progress: bool = True,
) -> list[Record]:
    """Send every arrival at its time; return once each has ended (or hung)."""
    by_name = {p.name: p for p in plans}
    records: list[Record] = []
    bar = tqdm(
        total=len(plan_arrivals),
        desc=desc,
        file=sys.stderr,
        disable=options.no_progress or not progress,
    )
    url = f"{app.base_url}/v1/completions"
    async with client_session() as session:
        t0 = time.monotonic()

        async def one(arrival: Arrival, record: Record) -> None:
            plan = by_name[arrival.slo_class]
            await send(
                session,
                url,
                app.model_name,
                plan,
                arrival.prompt,
                record,
                options.request_timeout,
                options.hung_after_s,
                t0,
            )
            bar.update(1)
            if bar.n % 20 == 0:
                bar.set_postfix(_outcome_counts(records))

        tasks = []
        for i, arrival in enumerate(plan_arrivals):
            await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - t0)))
            record = Record(i, arrival.slo_class, time.monotonic() - t0)
            records.append(record)
            tasks.append(asyncio.create_task(one(arrival, record)))
        await asyncio.gather(*tasks)
    bar.close()
    return records


def _outcome_counts(records: Sequence[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r.end_s is not None:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts
