"""What a `pdserve bench chaos` run records, and how it is summarized and plotted.

`Record` is one request's fate, `Fault` one injected fault; `summarize` turns them (and the
pools' block counts at the end) into the JSON's top-level fields, `plot` draws each request's
latency at its send time by outcome, with the faults, and `human_summary` prints a few lines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OUTCOMES = ("completed", "failed_clean", "failed_unclean", "hung")


@dataclass(slots=True)
class Record:
    """One request's fate; times in seconds since the load started."""

    index: int
    label: str
    prompt_index: int  # into the run's fixed pool of prompts
    stream: bool
    sent_s: float
    end_s: float = 0.0
    outcome: str = "hung"
    wrong: bool = False
    status: int | None = None
    error: str | None = None
    wrong_text: str | None = None  # what a wrong answer said instead of the reference
    on_killed_decode: bool = False


@dataclass(slots=True)
class Fault:
    """One injected fault; `recovery_s`: until a probe succeeded (None: never, in time)."""

    what: str  # "SIGKILL" | "SIGSTOP"
    target: str  # deployment: "prefill" | "decode" (or another pool's name)
    pid: int
    at_s: float
    resumed_s: float | None = None  # SIGCONT sent (SIGSTOP only)
    restart_s: float | None = None  # the replacement process alive (SIGKILL only)
    recovery_s: float | None = None


def mark_decode_kills(records: list[Record], faults: list[Fault], decode_pools: set[str]) -> None:
    """Flag requests in flight at a decode SIGKILL, or sent before its replacement was up."""
    kills = [f for f in faults if f.what == "SIGKILL" and f.target in decode_pools]
    for record in records:
        for kill in kills:
            down_until = kill.at_s + (kill.restart_s if kill.restart_s is not None else 0.0)
            in_flight = record.sent_s <= kill.at_s <= (record.end_s or float("inf"))
            if in_flight or kill.at_s <= record.sent_s <= down_until:
                record.on_killed_decode = True


def summarize(
    records: list[Record],
    faults: list[Fault],
    probes: Mapping[str, int],
    pools: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """The top-level fields of the JSON: outcome counts, leaks, faults."""
    counts = Counter(r.outcome for r in records)
    failed = [r for r in records if r.outcome in ("failed_clean", "failed_unclean")]
    return {
        "sent": len(records),
        **{k: counts[k] for k in OUTCOMES},
        "wrong": sum(r.wrong for r in records),
        "leaked_blocks": sum(p["num_blocks"] - p["num_free_blocks"] for p in pools.values()),
        "failed_on_killed_decode": sum(r.on_killed_decode for r in failed),
        "failed_elsewhere": sum(not r.on_killed_decode for r in failed),
        "probes": dict(probes),
        "faults": [asdict(f) for f in faults],
        "pools_end": pools,
    }


def plot(summary: dict[str, Any], records: list[Record], path: Path) -> str:
    """Latency of each request at its send time, coloured by outcome, with the faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"completed": "tab:green", "failed_clean": "tab:orange"}
    colors |= {"failed_unclean": "tab:red", "hung": "black"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for outcome, color in colors.items():
        chosen = [r for r in records if r.outcome == outcome and not r.wrong]
        ax.scatter(
            [r.sent_s for r in chosen],
            [max(r.end_s - r.sent_s, 1e-3) for r in chosen],
            s=10,
            color=color,
            label=f"{outcome} ({len(chosen)})",
        )
    wrong = [r for r in records if r.wrong]
    if wrong:
        ax.scatter(
            [r.sent_s for r in wrong],
            [max(r.end_s - r.sent_s, 1e-3) for r in wrong],
            s=30,
            marker="x",
            color="magenta",
            label=f"wrong ({len(wrong)})",
        )
    for fault in summary["faults"]:
        color = "tab:red" if fault["what"] == "SIGKILL" else "tab:blue"
        ax.axvline(fault["at_s"], color=color, ls="--", lw=1)
        if fault["resumed_s"] is not None:
            ax.axvspan(fault["at_s"], fault["resumed_s"], color=color, alpha=0.12)
        if fault["recovery_s"] is not None:
            ax.axvline(fault["at_s"] + fault["recovery_s"], color=color, ls=":", lw=1)
        ax.annotate(
            f"{fault['what'][3:].lower()} {fault['target']}",
            (fault["at_s"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
        )
    ax.set(xlabel="sent at (s)", ylabel="latency (s)", yscale="log")
    ax.set_title(
        f"{summary['config']}: {summary['sent']} requests, {len(summary['faults'])} faults "
        f"(-- fault, : recovered)",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def human_summary(summary: dict[str, Any]) -> str:
    """A few lines for a person: outcomes, then each fault and its recovery."""
    lines = [
        f"sent {summary['sent']}: completed {summary['completed']} (wrong {summary['wrong']}), "
        f"failed clean {summary['failed_clean']}, unclean {summary['failed_unclean']}, "
        f"hung {summary['hung']}; leaked blocks {summary['leaked_blocks']}",
        f"failures on a killed decode replica {summary['failed_on_killed_decode']}, "
        f"elsewhere {summary['failed_elsewhere']}",
    ]
    for f in summary["faults"]:
        lines.append(
            f"  {f['at_s']:7.1f} s {f['what']} {f['target']} pid {f['pid']}: "
            f"restart {f['restart_s']} s, recovered after {f['recovery_s']} s"
        )
    return "\n".join(lines)
