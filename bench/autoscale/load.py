"""The load of `pdserve bench autoscale`: phases of a ramp, Poisson arrivals, one request.

The ramp is a list of `Phase`s, each with its own request shape, so one run can stress each
pool's own signal in turn (`stress_ramp`):

    low ─ prefill ↗ peak ↘ (long prompts, short outputs: the prefill queue grows)
        ─ low ─ decode ↗ peak ↘ (short prompts, long outputs: running sequences and KV grow)
        ─ low

Each peak's rate is its own (`bench/autoscale/plan.py` sizes them from measured capacity).

Pure except `send` (one streamed HTTP completion).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from bench.serve.sse import sse_lines


@dataclass(frozen=True, slots=True)
class Shape:
    """The requests of a phase: prompt and output lengths in tokens."""

    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Phase:
    """`duration_s` seconds whose request rate goes linearly from `rate_from` to `rate_to`
    (requests/s), all requests of `shape`. `stresses` names the pool role the phase loads
    (`prefill`, `decode`), or is None for the low-load phases."""

    name: str
    duration_s: float
    rate_from: float
    rate_to: float
    shape: Shape
    stresses: str | None = None


@dataclass(frozen=True, slots=True)
class Ramp:
    """Phases back to back."""

    phases: tuple[Phase, ...]

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def peak_rate(self) -> float:
        return max((max(p.rate_from, p.rate_to) for p in self.phases), default=0.0)

    def phase_at(self, t: float) -> tuple[Phase, float] | None:
        """The phase at `t` seconds from the start and the seconds into it (None outside)."""
        if t < 0:
            return None
        for phase in self.phases:
            if t < phase.duration_s:
                return phase, t
            t -= phase.duration_s
        return None

    def rate_at(self, t: float) -> float:
        """Requests/s at `t` seconds from the start (0 outside the ramp)."""
        found = self.phase_at(t)
        if found is None:
            return 0.0
        phase, into = found
        return phase.rate_from + (phase.rate_to - phase.rate_from) * into / phase.duration_s


def stress_ramp(
    rate: float,
    peaks: Mapping[str, float],
    low_s: float,
    ramp_s: float,
    peak_s: float,
    base: Shape,
    shapes: Mapping[str, Shape],
) -> Ramp:
    """`low_s` of `base` requests at `rate`; then for each pool role in `shapes` (in order) a
    ramp to that role's rate in `peaks` (requests/s) of its stressing shape, `peak_s` there,
    a ramp back down, and `low_s` of `base` at `rate` again."""
    phases = [Phase("low", low_s, rate, rate, base)]
    for role, shape in shapes.items():
        high = peaks[role]
        phases += [
            Phase(f"{role}-up", ramp_s, rate, high, shape, role),
            Phase(f"{role}-peak", peak_s, high, high, shape, role),
            Phase(f"{role}-down", ramp_s, high, rate, shape, role),
            Phase("low", low_s, rate, rate, base),
        ]
    return Ramp(tuple(p for p in phases if p.duration_s > 0))


def arrival_times(ramp: Ramp, seed: int) -> list[float]:
    """Poisson arrivals following `ramp.rate_at` (thinning of a peak-rate process)."""
    rng = random.Random(seed)
    peak_rate = ramp.peak_rate
    times: list[float] = []
    if peak_rate <= 0:
        return times
    t = 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= ramp.duration_s:
            return times
        if rng.random() < ramp.rate_at(t) / peak_rate:
            times.append(t)


@dataclass(slots=True)
class Record:
    """One request: when it was sent (s from the start), in which phase, how it ended."""

    sent_s: float
    phase: str
    prompt_tokens: int
    max_tokens: int
    end_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_tokens: int = 0
    ok: bool = False
    error: str | None = None


def request_body(model: str, shape: Shape, index: int) -> dict[str, Any]:
    """A streamed greedy completion of `shape` (byte-level tokenizer: one token a byte).
    The prompt starts with the request's index, so no two share a cached prefix block."""
    head = f"{index:08d} "
    prompt = (head * (shape.prompt_tokens // len(head) + 1))[: shape.prompt_tokens]
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": shape.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


async def send(
    client: httpx.AsyncClient, body: dict[str, Any], record: Record, start: float, timeout_s: float
) -> None:
    """Stream one completion into `record`; every way it can fail is `record.error`."""
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
                async for line in sse_lines(response):
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
