"""The requests of `pdserve bench chaos`: the fixed prompt pool with its greedy references,
one checked completion, and the capacity of the run's mix.

`request_pool` makes distinct short prompts (prefilled on decode) and long ones (prefilled
remotely); `with_references` computes each one's expected text offline with
`engine.engine.Engine` on the same model; `send` is one greedy completion, streamed or not,
ending as exactly one outcome. `measure_capacity` is the closed-loop saturation search
(`bench/serve/capacity.py`) with that mix, run on the deployed app before the faults: the bench
offers a fraction of it (`--load`, 0.7) unless `--rate` fixes the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from bench.serve.capacity import Capacity, LoadPoint, closed_loop, find_saturation
from bench.serve.deploy import RunningApp
from bench.serve.sse import sse_lines

PROBE_WARMUP_S = 1.0  # per point: requests ending sooner are not counted
# Short requests batch well: throughput can still grow past 32 in flight (BENCHMARKS.md).
MAX_PROBE_CONCURRENCY = 128


@dataclass(frozen=True, slots=True)
class Shape:
    """One request of the fixed pool: its prompt, length and expected (greedy) text."""

    label: str  # "short" (prefilled on decode) | "long" (prefilled remotely)
    prompt: str
    max_tokens: int
    expected: str = ""


def request_pool(num_short: int, num_long: int, seed: int) -> list[Shape]:
    """Distinct short and long prompts (one character per token with the built-in models)."""
    rng = random.Random(seed)
    shapes = [Shape("short", f"chaos {i:03d}: hello", 16) for i in range(num_short)]
    for i in range(num_long):
        words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.randrange(60, 200)))
        shapes.append(Shape("long", f"chaos long {i:03d}: {words}", 8))
    return shapes


def with_references(shapes: list[Shape], args: dict[str, Any]) -> list[Shape]:
    """Each shape with its expected text: greedy generation with the offline engine."""
    from app.config import load_config
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(load_config(args).model.to_engine_config())
    params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0) for s in shapes]
    outputs = engine.generate([s.prompt for s in shapes], params)
    return [
        Shape(s.label, s.prompt, s.max_tokens, out.text)
        for s, out in zip(shapes, outputs, strict=True)
    ]


# ---------------------------------------------------------------------------------- requests


Outcome = tuple[str, str | None, int | None, str | None]


async def send(
    client: httpx.AsyncClient, model: str, shape: Shape, stream: bool, timeout_s: float
) -> Outcome:
    """(outcome, text when completed, status, error message) of one greedy completion."""
    body = {
        "model": model,
        "prompt": shape.prompt,
        "max_tokens": shape.max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    status: int | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                status = response.status_code
                if status != 200:
                    return _error_outcome(status, await response.aread())
                if not stream:
                    text = json.loads(await response.aread())["choices"][0]["text"]
                    return "completed", str(text), status, None
                parts: list[str] = []
                error: str | None = None
                async for line in sse_lines(response):
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        if error is not None:
                            return "failed_clean", None, status, error
                        return "completed", "".join(parts), status, None
                    event = json.loads(data)
                    if "error" in event:
                        error = str(event["error"].get("message"))[:300]
                    parts += [c.get("text") or "" for c in event.get("choices") or []]
                return "failed_unclean", None, status, error or "stream ended without [DONE]"
    except (TimeoutError, httpx.TimeoutException):  # the whole request, or one silent read
        return "hung", None, status, f"no answer within {timeout_s} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        return "failed_unclean", None, status, repr(exc)[:300]


def _error_outcome(status: int, raw: bytes) -> Outcome:
    try:
        error = json.loads(raw)["error"]
        return "failed_clean", None, status, str(error["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return "failed_unclean", None, status, raw[:300].decode(errors="replace")


async def measure_capacity(
    app: RunningApp,
    shapes: list[Shape],
    args: argparse.Namespace,
    max_concurrency: int = MAX_PROBE_CONCURRENCY,
) -> Capacity:
    """The saturation capacity (`bench.serve.capacity.find_saturation`, `--probe-s` per point) of
    the run's mix: prompts drawn from `shapes` as the load draws them, half streamed. A
    request counts when it completed with its reference text."""
    rng = random.Random(args.seed + 2)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=app.base_url, limits=limits, timeout=args.request_timeout
    ) as client:

        async def one(index: int) -> bool:
            shape = shapes[rng.randrange(len(shapes))]
            stream = rng.random() < 0.5
            outcome = await send(client, app.model_name, shape, stream, args.request_timeout)
            return outcome[0] == "completed" and outcome[1] == shape.expected

        async def point(concurrency: int) -> LoadPoint:
            result = await closed_loop(one, concurrency, args.probe_s, PROBE_WARMUP_S)
            tqdm.write(
                f"capacity probe: {concurrency} in flight, {result.throughput:.2f} req/s "
                f"({result.failed} failed)",
                file=sys.stderr,
            )
            return result

        return await find_saturation(point, max_concurrency=max_concurrency)
