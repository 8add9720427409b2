"""What `pdserve bench autoscale` found: scaling decisions, replica changes, the verdict.

The pools' policies log each decision once (`app.serve.autoscaling.SCALING_EVENT`, then JSON with
the pool, current and desired count, the driving `signal` and its metric values) on the Serve
controller's log. Here those lines become events on the run's clock, each change of a pool's
RUNNING replicas is paired with the decision that caused it (the pool's latest decision in
the same direction before it), and the verdict says per pool whether it scaled up during the
phases that stress its role, on which signals, and whether it came back to its minimum.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.serve.autoscaling import SCALING_EVENT
from bench.autoscale.load import Ramp, Record
from bench.serve.metrics import percentile


def scaling_events(lines: Iterable[str], app_name: str, wall_start: float) -> list[dict[str, Any]]:
    """The decision records of `app_name` in log `lines`, with `t_s` (seconds from
    `wall_start`, a `time.time()`), oldest first."""
    events = []
    for line in lines:
        _, marker, payload = line.partition(SCALING_EVENT)
        if not marker:
            continue
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("app") == app_name:
            events.append({"t_s": round(float(event["time"]) - wall_start, 3), **event})
    return sorted(events, key=lambda e: e["t_s"])


def replica_changes(samples: Sequence[Mapping[str, Any]], pools: Sequence[str]) -> list[dict]:
    """Every change of a pool's RUNNING replicas between consecutive samples."""
    changes = []
    for before, after in zip(samples, samples[1:], strict=False):
        for pool in pools:
            if after[pool] != before[pool]:
                changes.append(
                    {"t_s": after["t_s"], "pool": pool, "from": before[pool], "to": after[pool]}
                )
    return changes


def attribute(
    changes: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]], ramp: Ramp
) -> list[dict[str, Any]]:
    """Each change with the decision that caused it (`decision`: None when none was logged)
    and the phase that decision was made in."""
    out = []
    for change in changes:
        up = change["to"] > change["from"]
        decisions = [
            e
            for e in events
            if e["pool"] == change["pool"]
            and e["t_s"] <= change["t_s"]
            and (e["desired"] > e["current"]) == up
        ]
        decision = decisions[-1] if decisions else None
        found = ramp.phase_at(decision["t_s"]) if decision else None
        out.append(
            {
                **change,
                "direction": "up" if up else "down",
                "signal": decision["signal"] if decision else None,
                "phase": found[0].name if found else "after" if decision else None,
                "decision": dict(decision) if decision else None,
            }
        )
    return out


def verdict(
    scaled: Sequence[Mapping[str, Any]],
    roles: Mapping[str, str],
    min_replicas: Mapping[str, int],
    final_replicas: Mapping[str, int],
    ramp: Ramp,
    events: Sequence[Mapping[str, Any]] = (),
) -> dict[str, dict[str, Any]]:
    """Per pool: the signals of its scale-ups during the phases that stress its role, the
    scale-ups elsewhere (replicas that started, and decisions to add one that `events` show
    outside those phases even if no replica came of them), whether it scaled down, and `ok`
    (up under load on its own signal, never up elsewhere, back to its minimum)."""
    stressing = {p.name: p.stresses for p in ramp.phases}
    result = {}
    for pool, role in roles.items():
        ups = [s for s in scaled if s["pool"] == pool and s["direction"] == "up"]
        own = [s for s in ups if stressing.get(s["phase"]) == role]
        elsewhere = [
            {"t_s": s["t_s"], "phase": s["phase"], "signal": s["signal"]}
            for s in ups
            if s not in own
        ]
        for event in events:
            found = ramp.phase_at(event["t_s"])
            phase = found[0] if found else None
            wanted_more = event["pool"] == pool and event["desired"] > event["current"]
            if wanted_more and phase is not None and phase.stresses != role:
                decision = {"t_s": event["t_s"], "phase": phase.name, "signal": event["signal"]}
                elsewhere.append({**decision, "decision_only": True})
        result[pool] = {
            "role": role,
            "scaled_up_on": sorted({s["signal"] for s in own}),
            "scaled_up_elsewhere": elsewhere,
            "scaled_down": any(s["pool"] == pool and s["direction"] == "down" for s in scaled),
            "back_to_min": final_replicas.get(pool, 0) <= min_replicas.get(pool, 1),
        }
        entry = result[pool]
        entry["ok"] = bool(
            own and not entry["scaled_up_elsewhere"] and entry["scaled_down"]
        ) and bool(entry["back_to_min"])
    return result


def timeline(
    ramp: Ramp,
    records: Sequence[Record],
    samples: Sequence[Mapping[str, Any]],
    pools: Sequence[str],
    window_s: float,
) -> list[dict[str, Any]]:
    """Per window: phase, offered rate, most replicas per pool, TTFT/TPOT p50/p90 (ms) of the
    requests sent in it that completed."""
    end = max([s["t_s"] for s in samples] + [r.end_s for r in records] + [0.0])
    rows = []
    t = 0.0
    while t < end:
        sent = [r for r in records if t <= r.sent_s < t + window_s and r.ok]
        in_window = [s for s in samples if t <= s["t_s"] < t + window_s]
        found = ramp.phase_at(t + window_s / 2)
        row: dict[str, Any] = {
            "t_s": t,
            "phase": found[0].name if found else "settle",
            "rate": ramp.rate_at(t + window_s / 2),
        }
        for pool in pools:
            row[pool] = max((s[pool] for s in in_window), default=None)
        for name, values in (
            ("ttft", [r.ttft_s for r in sent if r.ttft_s is not None]),
            ("tpot", [r.tpot_s for r in sent if r.tpot_s is not None]),
        ):
            for p in (50, 90):
                row[f"{name}_p{p}_ms"] = percentile(values, p) * 1000 if values else None
        rows.append(row)
        t += window_s
    return rows


def plot(
    ramp: Ramp,
    samples: Sequence[Mapping[str, Any]],
    scaled: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    pools: Sequence[str],
    path: Path,
) -> str:
    """Replicas per pool (each change labelled with its signal) over the shaded stress
    phases and the offered rate, above TTFT/TPOT p90 per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    start = 0.0
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for phase in ramp.phases:
        if phase.stresses:
            color = colors.get(phase.stresses, "gray")
            for axis in (top, bottom):
                axis.axvspan(start, start + phase.duration_s, color=color, alpha=0.08)
        start += phase.duration_s
    times = [s["t_s"] for s in samples]
    for i, pool in enumerate(pools):
        offset = 0.04 * (i - (len(pools) - 1) / 2)  # keep overlapping steps apart
        values = [s[pool] + offset for s in samples]
        top.step(times, values, where="post", label=f"{pool} replicas")
    for change in scaled:
        top.annotate(
            f"{change['pool']} {change['direction']}: {change['signal']}",
            (change["t_s"], change["to"]),
            textcoords="offset points",
            xytext=(4, 6 if change["direction"] == "up" else -12),
            fontsize=7,
        )
    top.set_ylabel("RUNNING replicas")
    top.set_ylim(0, max([s[p] for s in samples for p in pools] + [1]) + 0.8)
    rate_axis = top.twinx()
    rate_axis.plot(times, [s["rate"] for s in samples], color="gray", ls=":", label="rate")
    rate_axis.set_ylabel("offered requests/s")
    top.legend(loc="upper left", fontsize=8)
    mids = [row["t_s"] for row in rows]
    for key in ("ttft_p90_ms", "tpot_p90_ms"):
        bottom.plot(mids, [row[key] for row in rows], marker=".", label=key)
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds from start (shaded: blue prefill stress, orange decode stress)")
    bottom.set_ylabel("ms")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def human(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], pools: list[str]) -> str:
    """The timeline, each replica change with its signal, and the verdict, as text."""

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.0f}" if isinstance(value, float) else str(value)

    header = ["t_s", "phase", "rate", *pools, "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"]
    lines = ["  ".join(f"{h:>12}" for h in header)]
    for row in rows:
        values = [row["t_s"], row["phase"], f"{row['rate']:.1f}", *(row[p] for p in pools)]
        values += [row[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")]
        lines.append("  ".join(f"{cell(v):>12}" for v in values))
    for change in summary["replica_changes"]:
        lines.append(
            f"t={change['t_s']:.0f}s {change['pool']} {change['from']}->{change['to']}: "
            f"{change['signal']} (decided in {change['phase']})"
        )
    lines.append(
        f"requests {summary['requests']}, failed {summary['failed']}; replicas max "
        f"{summary['max_replicas']}, final {summary['final_replicas']}; "
        f"verdict {json.dumps(summary['verdict'])}"
    )
    return "\n".join(lines)
