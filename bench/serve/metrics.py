"""Serving metrics from per-request records: pure functions, no I/O.

Definitions (all times from the moment the request was sent):

- TTFT: time to the first streamed token.
- ITL: gaps between consecutive streamed chunks. A chunk is usually one token; a server may
  coalesce several tokens into one chunk when the stream lags (pdserve does), so ITL is what
  a client sees, and TPOT (exact token counts) is the per-token figure.
- TPOT: (last token time - first token time) / (output tokens - 1); undefined for 1 token.
- E2E latency: time to the end of the stream.
- SLO attainment: share of *all* requests (failed ones count as misses) that meet both
  TTFT <= `slo.ttft_ms` and TPOT <= `slo.tpot_ms` (a request with one output token has no
  TPOT and is judged by TTFT alone). An SLO left as None is not checked.

Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What the load generator saw of one request; times are seconds from the run start."""

    index: int
    label: str
    input_len: int  # requested prompt tokens
    max_tokens: int  # requested output tokens
    arrival_s: float  # scheduled send time
    start_s: float  # actual send time
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    prompt_tokens: int | None = None  # as the server reported (usage)
    output_tokens: int = 0  # usage.completion_tokens, else the number of chunks
    success: bool = False
    error: str | None = None
    route: str | None = None  # the server's x-pdserve-route header, if any

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None if none arrived."""
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency of a completed request."""
        return self.end_s - self.start_s if self.success and self.end_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if not self.success or self.output_tokens < 2 or len(self.chunk_times_s) < 1:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive chunks."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with derived latencies in ms and chunk times rounded to 0.1 ms."""
        out = asdict(self)
        out["chunk_times_s"] = [round(t, 4) for t in self.chunk_times_s]
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(self, f"{name}_s")
            out[f"{name}_ms"] = None if value is None else round(value * 1000, 3)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        """Inverse of `to_dict` (derived fields are ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in milliseconds; None leaves that one unchecked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100) by linear interpolation, as `numpy.percentile`."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int]:
    """Count, mean, p50/p90/p99 and max of `values` times `scale` (seconds -> ms by default)."""
    scaled = [v * scale for v in values]
    if not scaled:
        return {"count": 0, "mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    stats: dict[str, float | int] = {"count": len(scaled), "mean": sum(scaled) / len(scaled)}
    stats.update({f"p{p}": percentile(scaled, p) for p in PERCENTILES})
    stats["max"] = max(scaled)
    return stats


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Whether a request completed and met every SLO that is set."""
    if not record.success:
        return False
    ttft = record.ttft_s
    if slo.ttft_ms is not None and (ttft is None or ttft * 1000 > slo.ttft_ms):
        return False
    tpot = record.tpot_s
    return slo.tpot_ms is None or tpot is None or tpot * 1000 <= slo.tpot_ms


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Share of requests meeting the SLO (NaN for no requests)."""
    if not records:
        return math.nan
    return sum(meets_slo(r, slo) for r in records) / len(records)


def _latencies(records: Iterable[RequestRecord]) -> dict[str, dict[str, float | int]]:
    done = [r for r in records if r.success]
    return {
        "ttft_ms": distribution(t for r in done if (t := r.ttft_s) is not None),
        "tpot_ms": distribution(t for r in done if (t := r.tpot_s) is not None),
        "itl_ms": distribution(gap for r in done for gap in r.itls_s),
        "e2e_ms": distribution(t for r in done if (t := r.e2e_s) is not None),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Every aggregate of one run. `duration_s` is the run's wall time (first send to last
    response), the denominator of throughputs."""
    done = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    met = sum(meets_slo(r, slo) for r in records)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_token_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (out_tokens + in_tokens) / duration_s
        if duration_s > 0
        else math.nan,
        "num_output_tokens": out_tokens,
        "num_input_tokens": in_tokens,
        **_latencies(records),
        "slo": {
            "ttft_ms": slo.ttft_ms,
            "tpot_ms": slo.tpot_ms,
            "attainment": met / len(records) if records else math.nan,
            "ttft_attainment": attainment(records, SLO(ttft_ms=slo.ttft_ms)),
            "tpot_attainment": attainment(records, SLO(tpot_ms=slo.tpot_ms)),
            "goodput": met / duration_s if duration_s > 0 else math.nan,
        },
    }
    labels = sorted({r.label for r in records})
    if len(labels) > 1:
        summary["by_label"] = {
            label: {
                "num_requests": len(group := [r for r in records if r.label == label]),
                "attainment": attainment(group, slo),
                **_latencies(group),
            }
            for label in labels
        }
    return summary


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def prefill_interference(
    records: Sequence[RequestRecord], long_label: str = "long"
) -> dict[str, Any]:
    """Where decode time goes: decoding requests whose streaming window overlapped some
    `long_label` request's prefill window (its send -> first token) against those that did
    not. A large TPOT/ITL gap between the two groups is prefill interference. `alone`: the
    requests (any label) that overlapped no other request from send to end, an in-run
    control of the host's speed: the same request alone should decode as fast in any
    config and at any rate, so a shift there is the machine, not the design."""
    prefills = [
        (r.start_s, r.first_token_s)
        for r in records
        if r.label == long_label and r.first_token_s is not None
    ]
    groups: dict[str, list[RequestRecord]] = {"overlapped": [], "clear": [], "alone": []}
    for r in records:
        if not r.success or r.label == long_label or len(r.chunk_times_s) < 2:
            continue
        window = (r.chunk_times_s[0], r.chunk_times_s[-1])
        hit = any(_overlaps(window, p) for p in prefills)
        groups["overlapped" if hit else "clear"].append(r)
    spans = [(r.start_s, r.end_s if r.end_s is not None else math.inf) for r in records]
    for i, r in enumerate(records):
        if not r.success or len(r.chunk_times_s) < 2:
            continue
        if not any(_overlaps(spans[i], other) for j, other in enumerate(spans) if j != i):
            groups["alone"].append(r)
    return {
        name: {
            "num_requests": len(group),
            "tpot_ms": distribution(t for r in group if (t := r.tpot_s) is not None),
            "itl_ms": distribution(g for r in group for g in r.itls_s),
        }
        for name, group in groups.items()
    }


def route_kind(route: str | None) -> str:
    """Where pdserve placed a request, from its `x-pdserve-route` header: `whole` (decode
    overflow: prompt and decode on a prefill replica), `local` (prefilled on the replica
    that decodes it), `remote` (prefilled on a prefill pool, its KV moved), or `unknown`
    (no header: another server)."""
    if not route:
        return "unknown"
    if "-> served whole on" in route:
        return "whole"
    return "local" if "-> local prefill" in route else "remote"


def route_breakdown(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Per `route_kind`: requests, those that missed the SLO, and their TPOT. Tells which
    placement the misses came from (a config's routing is only as good as its worst
    path)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(route_kind(r.route), []).append(r)
    return {
        kind: {
            "num_requests": len(group),
            "num_missed": sum(not meets_slo(r, slo) for r in group),
            "tpot_ms": distribution(t for r in group if (t := r.tpot_s) is not None),
        }
        for kind, group in sorted(groups.items())
    }


def finite_or_none(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj
