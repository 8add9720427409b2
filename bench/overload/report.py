"""What a `pdserve bench overload` run records, and how it is summarized and plotted.

`Record` is one request's fate as the client saw it. Every request ends as exactly one of:
`ok` (a streamed answer that ended with `[DONE]`), `shed` (refused with 429 or 503, before
any token), `error` (any other HTTP error, an SSE error event, a cut stream) or `hung` (no
end within the client's deadline). `mode_report` turns one mode's records into the JSON's
`admission_on` / `admission_off` entry: per class `attainment` (the share of the class's
requests that completed within both its TTFT and TPOT SLO; shed and failed requests count
as misses) and `goodput` (those requests per second of offered load), `shed` counts by
reason (`"<status> <code>"`, e.g. `"429 tenant_queue_full"`), `retry_after` (shed requests
with and without a Retry-After header), `errors` (other failures by `"<status> <code>"`, or
`"SSE <code>"` for an error event in a stream that had started) and `hung`. Pure functions,
no I/O except `plot`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serve.metrics import percentile

OUTCOMES = ("ok", "shed", "error", "hung")
MODE_KEYS = ("admission_on", "admission_off", "admission_no_quotas")
SHED_STATUSES = (429, 503)


@dataclass(frozen=True, slots=True)
class ClassSLO:
    """A class's latency targets (seconds), from the config's `admission.classes`."""

    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class Record:
    """One request: its class, when it was sent (s from the phase start) and how it ended."""

    index: int
    slo_class: str
    sent_s: float
    end_s: float | None = None
    outcome: str = "hung"  # one of OUTCOMES; "hung" until the request ends
    status: int | None = None
    code: str | None = None  # the OpenAI error body's `code`
    retry_after: str | None = None  # the Retry-After header of an error response
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_tokens: int = 0
    error: str | None = None

    def meets(self, slo: ClassSLO) -> bool:
        """Completed within the TTFT SLO and (with two tokens or more) the TPOT SLO."""
        if self.outcome != "ok" or self.ttft_s is None or self.ttft_s > slo.ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= slo.tpot_s


def shed_reason(record: Record) -> str | None:
    """`"<status> <code>"` of a shed request (429/503 before any token), else None."""
    if record.outcome != "shed" or record.status is None:
        return None
    return f"{record.status} {record.code or 'no_code'}"


def classify(status: int, streamed_tokens: bool) -> str:
    """The outcome of a request that got an HTTP error status (never "ok")."""
    return "shed" if status in SHED_STATUSES and not streamed_tokens else "error"


def _ms(values: Iterable[float | None], p: float) -> float | None:
    present = [v * 1000 for v in values if v is not None]
    return percentile(present, p) if present else None


def class_report(records: Sequence[Record], slo: ClassSLO, duration_s: float) -> dict[str, Any]:
    """Attainment, goodput (requests meeting the SLO per second of `duration_s`), outcome
    counts and latency percentiles of one class's requests."""
    met = sum(r.meets(slo) for r in records)
    outcomes = Counter(r.outcome for r in records)
    ok = [r for r in records if r.outcome == "ok"]
    return {
        "attainment": met / len(records) if records else math.nan,
        "goodput": met / duration_s if duration_s > 0 else math.nan,
        "sent": len(records),
        "offered_rate": len(records) / duration_s if duration_s > 0 else math.nan,
        "met_slo": met,
        **{outcome: outcomes[outcome] for outcome in OUTCOMES},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "ttft_p50_ms": _ms((r.ttft_s for r in ok), 50),
        "ttft_p90_ms": _ms((r.ttft_s for r in ok), 90),
        "tpot_p50_ms": _ms((r.tpot_s for r in ok), 50),
        "tpot_p90_ms": _ms((r.tpot_s for r in ok), 90),
    }


def shed_counts(records: Iterable[Record]) -> dict[str, int]:
    """Shed requests by reason (`shed_reason`), most frequent first."""
    counts = Counter(reason for r in records if (reason := shed_reason(r)) is not None)
    return dict(counts.most_common())


def mode_report(
    records: Sequence[Record], slos: Mapping[str, ClassSLO], duration_s: float
) -> dict[str, Any]:
    """One mode's entry: a `class_report` per class of `slos`, then `shed`, `shed_by_class`,
    `retry_after`, `errors` (non-shed failures by reason) and `hung`."""
    report: dict[str, Any] = {
        name: class_report([r for r in records if r.slo_class == name], slo, duration_s)
        for name, slo in slos.items()
    }
    shed = [r for r in records if r.outcome == "shed"]
    report["shed"] = shed_counts(records)
    report["shed_by_class"] = {
        name: shed_counts(r for r in shed if r.slo_class == name) for name in slos
    }
    report["retry_after"] = {
        "with_header": sum(r.retry_after is not None for r in shed),
        "without_header": sum(r.retry_after is None for r in shed),
    }
    errors = Counter(
        f"{'SSE' if r.status == 200 else r.status or '-'} {r.code or (r.error or '?')[:60]}"
        for r in records
        if r.outcome == "error"
    )
    report["errors"] = dict(errors.most_common())
    report["hung"] = sum(r.outcome == "hung" for r in records)
    report["sent"] = len(records)
    return report


def joint_attainment(records: Sequence[Record], slos: Mapping[str, ClassSLO]) -> float:
    """Share of all requests meeting their own class's SLO (NaN without requests)."""
    if not records:
        return math.nan
    return sum(r.meets(slos[r.slo_class]) for r in records) / len(records)


def human_table(document: Mapping[str, Any], classes: Sequence[str]) -> str:
    """Per mode and class: attainment, goodput, outcomes; then shed reasons and hung."""
    header = f"{'mode':<20}{'class':<13}{'sent':>6}{'ok':>6}{'shed':>6}{'error':>6}"
    header += f"{'attain':>8}{'goodput':>9}{'ttft p90':>10}{'tpot p90':>10}"
    lines = [header]
    for mode in MODE_KEYS:
        entry = document.get(mode)
        if entry is None:
            continue
        for name in classes:
            c = entry[name]
            ttft = "-" if c["ttft_p90_ms"] is None else f"{c['ttft_p90_ms']:.0f}ms"
            tpot = "-" if c["tpot_p90_ms"] is None else f"{c['tpot_p90_ms']:.0f}ms"
            attain = "-" if not math.isfinite(c["attainment"]) else f"{c['attainment']:.1%}"
            lines.append(
                f"{mode:<20}{name:<13}{c['sent']:>6}{c['ok']:>6}{c['shed']:>6}{c['error']:>6}"
                f"{attain:>8}{c['goodput']:>8.2f}/s{ttft:>10}{tpot:>10}"
            )
        retry = entry["retry_after"]
        lines.append(
            f"{mode:<20}shed {entry['shed'] or '{}'} (Retry-After on {retry['with_header']}, "
            f"missing on {retry['without_header']}); errors {entry['errors'] or '{}'}; "
            f"hung {entry['hung']}"
        )
    return "\n".join(lines)


def _failure_counts(entry: Mapping[str, Any]) -> dict[str, int]:
    """Shed, failed and hung requests of one mode, by reason (`shed 429 ...`, `error 504 ...`)."""
    counts = {f"shed {reason}": n for reason, n in entry["shed"].items()}
    counts |= {f"error {reason}": n for reason, n in entry["errors"].items()}
    counts["hung"] = entry["hung"]
    return counts


def plot(document: Mapping[str, Any], classes: Sequence[str], path: Path) -> str:
    """Three panels, admission on vs off: attainment and goodput per class, and the requests
    not served (shed, failed, hung) by reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODE_KEYS if m in document]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / max(len(modes), 1)
    colors = dict(zip(MODE_KEYS, ("tab:green", "tab:red", "tab:blue"), strict=True))
    for panel, key, label in (
        (0, "attainment", "SLO attainment"),
        (1, "goodput", "goodput (req/s)"),
    ):
        ax = axes[panel]
        for i, mode in enumerate(modes):
            values = [document[mode][c][key] for c in classes]
            xs = [j + i * width for j in range(len(classes))]
            bars = ax.bar(
                xs,
                [0 if v is None or not math.isfinite(v) else v for v in values],
                width,
                label=mode,
                color=colors[mode],
            )
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(classes))], classes)
        ax.set_title(label, fontsize=10)
    axes[0].axhline(0.9, color="gray", ls="--", lw=1)
    axes[0].set_ylim(0, 1.1)
    axes[0].legend(fontsize=8)
    outcomes = {mode: _failure_counts(document[mode]) for mode in modes}
    reasons = sorted({r for counts in outcomes.values() for r in counts})
    ax = axes[2]
    for i, mode in enumerate(modes):
        ys = [j + i * width for j in range(len(reasons))]
        bars = ax.barh(ys, [outcomes[mode].get(r, 0) for r in reasons], width, color=colors[mode])
        ax.bar_label(bars, fontsize=7)
    ticks = [j + width * (len(modes) - 1) / 2 for j in range(len(reasons))]
    ax.set_yticks(ticks, reasons, fontsize=7)
    ax.set_title("requests not served, by reason", fontsize=10)
    rate = document.get("offered_rate")
    goodput = document.get("calibration", {}).get("goodput")
    if rate is not None and goodput:
        fig.suptitle(
            f"{document.get('config')}: {rate:.1f} req/s offered = {rate / goodput:.1f}x "
            f"the fleet's goodput ({goodput:.2f} req/s)",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
