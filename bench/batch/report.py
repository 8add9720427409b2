"""`bench batch`'s verdicts and its figure: a job's throughput over time, idle and beside
interactive load (the load's window shaded), against the engine's offline throughput."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.serve.metrics import RequestRecord

IDLE_TARGET = 0.8  # job_tok_s / offline_tok_s
INTERACTIVE_TARGET = 0.95  # attainment with the job / without


def verdicts(document: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's two ratios and whether each meets its target."""
    job, offline = document["idle"]["job_tok_s"], document["offline"]["tok_s"]
    with_job = document["loaded"]["interactive_attainment_with_job"]
    without = document["loaded"]["interactive_attainment_without"]
    idle_ratio = job / offline if job and offline else None
    load_ratio = with_job / without if without else None
    return {
        "job_vs_offline": idle_ratio,
        "job_vs_offline_ok": idle_ratio is not None and idle_ratio >= IDLE_TARGET,
        "attainment_ratio": load_ratio,
        "attainment_ok": load_ratio is not None and load_ratio >= INTERACTIVE_TARGET,
    }


def rates(
    timeline: Sequence[Sequence[float]], tokens_per_line: int, bin_s: float
) -> tuple[list[float], list[float]]:
    """A job's generated tokens/s per `bin_s` bin, from its (seconds, lines done) polls."""
    if not timeline:
        return [], []
    end = timeline[-1][0]
    times, values = [], []
    done_before: float = 0
    t = 0.0
    points = list(timeline)
    while t < end:
        done = max([n for s, n in points if s <= t + bin_s] or [done_before])
        times.append(t + bin_s / 2)
        values.append((done - done_before) * tokens_per_line / bin_s)
        done_before, t = done, t + bin_s
    return times, values


def interactive_rates(
    records: Sequence[RequestRecord], offset_s: float, end_s: float, bin_s: float
) -> tuple[list[float], list[float]]:
    """Interactive generated tokens/s per bin (each chunk counts its share of the request's
    tokens), on the job's clock (`offset_s`: when the load started on it)."""
    bins = [0.0] * (int(end_s / bin_s) + 1)
    for record in records:
        if not record.chunk_times_s:
            continue
        per_chunk = record.output_tokens / len(record.chunk_times_s)
        for t in record.chunk_times_s:
            index = int((t + offset_s) / bin_s)
            if 0 <= index < len(bins):
                bins[index] += per_chunk / bin_s
    return [(i + 0.5) * bin_s for i in range(len(bins))], bins


def plot(
    document: Mapping[str, Any],
    records: Sequence[RequestRecord],
    path: Path,
    bin_s: float = 8.0,
) -> str:
    """Write the figure; returns its path. Bins of `bin_s` seconds: an idle job finishes
    its lines in waves (as many as the decode replica's KV holds, ~4 s apart on `small`),
    and bins shorter than two waves draw the waves, not the throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_tokens = int(document["job"]["max_tokens"])
    offline = float(document["offline"]["tok_s"])
    idle = document["idle"]["job"]
    loaded = document["loaded"]["job"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharey=True)
    times, values = rates(idle["timeline"], max_tokens, bin_s)
    top.plot(times, values, label="batch job (generated tok/s)")
    top.axhline(offline, color="k", linestyle="--", label=f"engine offline {offline:.0f} tok/s")
    top.set_title(f"idle service: job {document['idle']['job_tok_s'] or 0:.0f} tok/s")
    times, values = rates(loaded["timeline"], max_tokens, bin_s)
    bottom.plot(times, values, label="batch job (generated tok/s)")
    start, end = document["loaded"]["load_window_s"]
    it, iv = interactive_rates(records, start, end, bin_s)
    bottom.plot(it, iv, label="interactive (generated tok/s)")
    bottom.axvspan(start, end, color="orange", alpha=0.15, label="interactive load")
    bottom.axhline(offline, color="k", linestyle="--")
    attained = document["loaded"]
    bottom.set_title(
        f"interactive at {attained['interactive_rate']:.2f} req/s: attainment "
        f"{attained['interactive_attainment_with_job']:.1%} with the job, "
        f"{attained['interactive_attainment_without']:.1%} without"
    )
    for axis in (top, bottom):
        axis.set_xlabel("seconds since the job was submitted")
        axis.set_ylabel("tokens/s")
        axis.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
